"""vLLM engines for the engine-level check: one aggregated reference, P and D with this connector.

On CUDA the three share one GPU (each ``--gpu-memory-utilization`` of it, the KV cache sized by
``--kv-cache-memory-bytes``, or by vLLM itself in the run with vLLM's defaults: on 0.34 that
keeps the extensible KV cache on, which ``--kv-cache-memory-bytes`` turns off), with the KV
cache in VRAM (``kv_buffer_device: cuda``), CUDA graphs on unless ``--enforce-eager``. On CPU
they run with the stack's run-time fixes and pinning (``router.stack.engines.engine_env``),
eager, as the project's other engine tests do. P and the
aggregated engine run with prefix caching (a repeated prompt is then P's one-token step, which
vLLM would replay as a full CUDA graph), D without it (so every prompt is moved).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from connector.address import NixlAddress
from router.stack import engines as eng
from router.stack.engines import EngineKind
from router.stack.metrics import scrape
from router.stack.ports import ENGINE_HTTP_PORTS, SIDE_CHANNEL_PORTS, pick_ports
from router.stack.procs import ManagedProcess, stop_all

__all__ = ["Engine", "Launch", "Variant", "block_size", "started"]


SERVED_NAME = "check"


@dataclass(frozen=True, slots=True)
class Variant:
    """How P and D run: ``write_batch``, CUDA graphs or eager, the readiness gate."""

    write_batch: str
    eager: bool
    gate: bool = True

    @property
    def name(self) -> str:
        graphs = "eager" if self.eager else "graphs"
        return f"{self.write_batch}, {graphs}" + ("" if self.gate else ", gate OFF")


@dataclass(frozen=True, slots=True)
class Launch:
    """What every engine of the run shares."""

    device: str  # cuda | cpu
    model: Path
    dtype: str
    max_model_len: int
    max_batched_tokens: int  # small: long prompts are prefilled in chunks
    kv_cache_bytes: int | None  # None: vLLM sizes the cache (0.34: the extensible KV cache)
    gpu_fraction: float
    run_dir: Path
    startup_timeout_s: float


@dataclass
class Engine:
    name: str
    url: str
    identity: NixlAddress | None  # None: no connector
    proc: ManagedProcess


def kv_config(role: EngineKind, identity: NixlAddress, launch: Launch, variant: Variant) -> str:
    """``--kv-transfer-config`` for P or D (see connector/README.md)."""
    extra: dict[str, Any] = {
        "side_channel_host": identity.host,
        "side_channel_port": identity.port,
        "write_batch": variant.write_batch,
        "readiness_gate": variant.gate,
        # Measured on 2 shared cores with three engines: the first handshake took 4.5 s, and
        # once more than the default 5 s. The check is about bytes, not handshake latency.
        "handshake_timeout_s": 30,
    }
    config: dict[str, Any] = {
        "kv_connector": eng.PIPELINED_CONNECTOR,
        "kv_connector_module_path": "connector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": launch.device,
        "engine_id": identity.engine_id,
        "kv_connector_extra_config": extra,
    }
    if role == "prefill":
        config["kv_load_failure_policy"] = "recompute"  # a failed pull of a kept turn
    return json.dumps(config, separators=(",", ":"))


def argv(role: EngineKind, port: int, launch: Launch, eager: bool, kv: str | None) -> list[str]:
    """``vllm serve`` through this interpreter, with explicit flags."""
    args = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(launch.model),
        "--host", eng.LOCALHOST,
        "--port", str(port),
        "--served-model-name", SERVED_NAME,
        "--dtype", launch.dtype,
        "--max-model-len", str(launch.max_model_len),
        "--max-num-batched-tokens", str(launch.max_batched_tokens),
        "--no-enable-prefix-caching" if role == "decode" else "--enable-prefix-caching",
    ]  # fmt: skip
    if launch.kv_cache_bytes is not None:  # turns 0.34's extensible KV cache off
        args += ["--kv-cache-memory-bytes", str(launch.kv_cache_bytes)]
    if launch.device == "cuda":
        args += ["--gpu-memory-utilization", str(launch.gpu_fraction)]
    if eager or launch.device == "cpu":
        args.append("--enforce-eager")
    if kv is not None:
        args += ["--kv-transfer-config", kv]
    return args


_CPU_CORES: dict[EngineKind, int] = {"prefill": 0, "decode": 1, "aggregated": 1}


def _launch(
    role: EngineKind,
    launch: Launch,
    eager: bool,
    variant: Variant | None,
    tag: str,
    ports: tuple[int, int],
) -> Engine:
    http, kv_port = ports
    identity = None
    kv = None
    if variant is not None:
        identity = NixlAddress(f"check-{role}-{tag}", eng.LOCALHOST, kv_port)
        kv = kv_config(role, identity, launch, variant)
    spec = eng.EngineSpec(
        f"{role}-{tag}", role, http, _CPU_CORES[role], None, kv_port if kv else None
    )
    env = eng.engine_env(spec, os.environ)
    cpus = None
    if launch.device == "cpu":
        cpus = eng.cpu_set(spec.core)
    else:
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    log = launch.run_dir / f"{spec.name}.log"
    proc = ManagedProcess(spec.name, argv(role, http, launch, eager, kv), env, log, cpus)
    return Engine(spec.name, spec.url, identity, proc)


@contextmanager
def started(
    launch: Launch, roles: Sequence[EngineKind], eager: bool, variant: Variant | None = None
) -> Iterator[list[Engine]]:
    """Start ``roles`` (``variant``: P and D's connector settings) and wait until each answers
    ``/health``; always stops them all (process groups) on exit. ``eager``: no CUDA graphs."""
    tag = f"{int(time.time() * 1000) % 10**8:08d}"
    http = pick_ports(len(roles), ENGINE_HTTP_PORTS)
    kv = pick_ports(len(roles), SIDE_CHANNEL_PORTS)
    engines: list[Engine] = []
    try:
        for i, role in enumerate(roles):
            engines.append(_launch(role, launch, eager, variant, tag, (http[i], kv[i])))
        _wait_healthy(engines, launch.startup_timeout_s)
        yield engines
    finally:
        stop_all([e.proc for e in engines], grace_s=15.0)


def _wait_healthy(engines: list[Engine], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(engines)
    while pending:
        for e in list(pending):
            if e.proc.exit_code() is not None:
                raise RuntimeError(f"{e.name} exited during start-up:\n{e.proc.log_tail()}")
            try:
                if httpx.get(f"{e.url}/health", timeout=2).status_code == 200:
                    pending.remove(e)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            names = ", ".join(e.name for e in pending)
            raise RuntimeError(f"not healthy within {timeout_s:g}s: {names}")
        time.sleep(0.5)


def block_size(engine: Engine) -> int:
    """The engine's KV block size, from ``vllm:cache_config_info`` on its ``/metrics``."""
    for sample in scrape(engine.url).samples:
        if sample.name.startswith("vllm:cache_config_info"):
            value = sample.labels.get("block_size", "")
            if value.isdigit():
                return int(value)
    raise RuntimeError(f"{engine.name} reports no block size")
