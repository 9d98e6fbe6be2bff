"""The connector checked on real memory and real NIXL: the one command a GPU owner runs.

* ``worker_check``: two ``connector.worker.WorkerSide``s with real NIXL agents in one process,
  KV tensors in vLLM 0.32's per-layer layout over one buffer (VRAM or DRAM), the hooks called in
  vLLM's order while a "kernel" writes each layer's KV late; D's bytes must equal P's final
  bytes, and with the readiness gate off (the negative control) they must not.
* ``engine_check``: P, D and one aggregated vLLM engine; greedy outputs through P/D must equal
  the aggregated engine's.

``scripts/gpu-check.sh`` runs both (``--cpu``: the reduced form CI can run).
"""
