#!/usr/bin/env bash
# One command for a GPU owner: checks the connector on a machine with CUDA vLLM and NIXL.
#   1. the worker check: P and D worker halves with real NIXL agents, KV in VRAM in vLLM 0.32's
#      layout, each layer's KV written late on the compute stream; D's bytes must equal P's
#      final bytes (and differ with the readiness gate off, the negative control);
#   2. the engine check: P, D and one aggregated engine on one GPU; greedy outputs through P/D
#      must equal the aggregated engine's, in both write_batch modes, graphs on and eager;
#   3. (CUDA) the engine check again with vLLM's defaults: no --kv-cache-memory-bytes, graphs on,
#      so vLLM 0.34's extensible KV cache stays on (the connector must declare kv_cache_access).
# Exits non-zero on any failure. Usage: scripts/gpu-check.sh [--cpu] [--worker-only]
#   --cpu          the reduced form CI can run: CPU tensors and vLLM CPU engines, eager only
#   --worker-only  skip the engine check (a GPU machine with CUDA PyTorch and NIXL, no vLLM)
# Python: $PYTHON, else the project's .venv, else python3. Engine logs go to a temp folder
# named in the output.
set -uo pipefail
cd "$(dirname "$0")/.."

device=cuda
engines=1
for arg in "$@"; do
  case "$arg" in
    --cpu) device=cpu ;;
    --worker-only) engines=0 ;;
    *) echo "usage: $0 [--cpu] [--worker-only]" >&2; exit 2 ;;
  esac
done

if [[ -n "${PYTHON:-}" ]]; then py=$PYTHON
elif [[ -x .venv/bin/python ]]; then py=.venv/bin/python
else py=python3
fi

need() {  # need <python statement> <message>
  if ! "$py" -c "$1" >/dev/null 2>&1; then
    echo "gpu-check: missing prerequisite: $2" >&2
    exit 2
  fi
}
need "import torch" "PyTorch is not importable by $py"
if [[ $device == cuda ]]; then
  need "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    "torch.cuda.is_available() is False: no GPU visible, or a CPU-only PyTorch build (--cpu runs the CPU form)"
fi
need "import nixl" "NIXL is not importable (pip install nixl==1.5.1; the engine-cuda extra in pyproject.toml)"
if [[ $engines == 1 ]]; then
  need "import vllm" "vLLM is not importable (the engine-cuda extra; --worker-only checks without it)"
fi

status=0
"$py" -m scripts.gpu_check.worker_check --device "$device" || status=1
if [[ $engines == 1 ]]; then
  "$py" -m scripts.gpu_check.engine_check --device "$device" || status=1
  if [[ $device == cuda ]]; then
    "$py" -m scripts.gpu_check.engine_check --device cuda --vllm-defaults --variants layer,step \
      || status=1
  fi
fi
if [[ $status == 0 ]]; then echo "gpu-check: PASS"; else echo "gpu-check: FAIL"; fi
exit $status
