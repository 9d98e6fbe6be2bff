"""vLLM engine command lines and environments for each P/D mode.

Pure functions: nothing here starts a process. ``plan_engines`` decides which engines a mode
needs; ``engine_argv`` and ``engine_env`` say how to run one.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from router.config import Mode

ENGINE_SITE_DIR = Path(__file__).resolve().parent / "engine_site"
LOCALHOST = "127.0.0.1"


# This project's connector (connector/), loaded by vLLM from the installed package.
PIPELINED_CONNECTOR = "PipelinedPushConnector"

# The vLLM KV connector both engines of a mode use; a mode not here (aggregated) has no P/D.
_CONNECTORS = {
    Mode.PULL: "NixlConnector",
    Mode.PUSH: "NixlPushConnector",
    Mode.PUSH_SEQUENTIAL: "NixlPushConnector",
    Mode.PIPELINED: PIPELINED_CONNECTOR,
}


def connector_of(mode: Mode) -> str | None:
    """The vLLM KV connector both engines of ``mode`` use (None: no P/D)."""
    return _CONNECTORS.get(mode)


# What an engine is started as: the router's roles (router.engines.instance.Role), or a whole
# engine serving alone (aggregated mode).
EngineKind = Literal["prefill", "decode", "aggregated"]


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to launch one engine and to describe it in the router config."""

    name: str
    role: EngineKind
    port: int
    core: int | str  # a CPU, or a list in VLLM_CPU_OMP_THREADS_BIND syntax ("0-1")
    connector: str | None = None
    kv_port: int | None = None
    engine_id: str | None = None
    extra_args: tuple[str, ...] = field(default=())
    # vLLM's KV cache events (``--kv-events-config``): the publisher's and the replay
    # endpoint's ports on LOCALHOST; None: no events.
    kv_events: tuple[int, int] | None = None
    # More kv_connector_extra_config keys: this project's connector's (connector/README.md),
    # or vLLM's (NixlConnector's bidirectional_kv_xfer, decoder_kv_blocks_ttl).
    connector_extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"


@dataclass(frozen=True)
class EngineOptions:
    """Settings shared by every engine of a stack."""

    model_path: Path
    served_model_name: str = "tiny"
    max_model_len: int = 4096
    kv_cache_bytes: int = 64 * 1024 * 1024
    dtype: str = "bfloat16"


def plan_engines(
    mode: Mode,
    ports: list[int],
    kv_ports: list[int],
    engine_id: str,
    cores: tuple[int, int] = (0, 1),
    aggregated_cpus: str | None = None,
    aggregated_replicas: int = 1,
) -> list[EngineSpec]:
    """The engines ``mode`` needs: one P (``cores[0]``) and one D (``cores[1]``), or in
    aggregated mode one engine (on ``aggregated_cpus`` if given, e.g. ``"0-1"``, else on
    ``cores[1]``) or, with ``aggregated_replicas=2``, two: one on each of ``cores`` (the same
    hardware as a P/D pair, served as two data-parallel replicas).

    ``ports``/``kv_ports`` must hold at least two distinct free ports each; ``engine_id`` is
    pinned on P so the router knows it before any request (push needs it up front).
    """
    connector = connector_of(mode)
    if connector is None:
        return _aggregated(ports, cores, aggregated_cpus, aggregated_replicas)
    # The pipelined connector's P writes into D, so D's identity is pinned too.
    d_engine_id = f"{engine_id}-decode" if mode is Mode.PIPELINED else None
    return [
        EngineSpec("prefill-0", "prefill", ports[0], cores[0], connector, kv_ports[0], engine_id),
        EngineSpec("decode-0", "decode", ports[1], cores[1], connector, kv_ports[1], d_engine_id),
    ]


def _aggregated(
    ports: list[int], cores: tuple[int, int], cpus: str | None, replicas: int
) -> list[EngineSpec]:
    if replicas == 1:
        return [EngineSpec("aggregated-0", "aggregated", ports[0], cpus or cores[1])]
    if replicas != 2 or cpus is not None:
        raise ValueError("aggregated_replicas is 1, or 2 (one per core) without aggregated_cpus")
    return [EngineSpec(f"aggregated-{i}", "aggregated", ports[i], cores[i]) for i in range(2)]


def kv_transfer_config(spec: EngineSpec) -> str | None:
    """The ``--kv-transfer-config`` JSON for ``spec`` (None for an engine without connector)."""
    if spec.connector is None:
        return None
    config: dict[str, Any] = {
        "kv_connector": spec.connector,
        "kv_role": "kv_producer" if spec.role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
    }
    if spec.engine_id is not None:
        config["engine_id"] = spec.engine_id
    if spec.connector == PIPELINED_CONNECTOR:
        config["kv_connector_module_path"] = "connector"
        if spec.role == "prefill":
            # A kept turn's pull that fails is recomputed, not the request failed (P loads
            # nothing else; vLLM's default is "fail").
            config["kv_load_failure_policy"] = "recompute"
        config["kv_connector_extra_config"] = {
            "side_channel_host": LOCALHOST,
            "side_channel_port": spec.kv_port,
            **spec.connector_extra,
        }
    elif spec.connector_extra:  # vLLM's connectors' own keys (bidirectional_kv_xfer, ...)
        config["kv_connector_extra_config"] = dict(spec.connector_extra)
    return json.dumps(config, separators=(",", ":"))


def engine_argv(spec: EngineSpec, opts: EngineOptions) -> list[str]:
    """Command line: the vLLM CLI's ``serve`` through the current interpreter."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(opts.model_path),
        "--host", LOCALHOST,
        "--port", str(spec.port),
        "--served-model-name", opts.served_model_name,
        "--dtype", opts.dtype,
        "--max-model-len", str(opts.max_model_len),
        "--kv-cache-memory-bytes", str(opts.kv_cache_bytes),
        # Eager: no compile step at start. No prefix caching: a local hit on D would hide a
        # transfer, and a hit on P would make repeated prompts cheaper than fresh ones.
        "--enforce-eager",
        "--no-enable-prefix-caching",
    ]  # fmt: skip
    kv_config = kv_transfer_config(spec)
    if kv_config is not None:
        argv += ["--kv-transfer-config", kv_config]
    events = kv_events_config(spec)
    if events is not None:
        argv += ["--kv-events-config", events]
    return argv + list(spec.extra_args)


def kv_events_config(spec: EngineSpec) -> str | None:
    """The ``--kv-events-config`` JSON for ``spec`` (None: no events). vLLM binds an endpoint
    whose host is ``*`` and connects to any other, so both bind on every interface."""
    if spec.kv_events is None:
        return None
    publisher, replay = spec.kv_events
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{publisher}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    return json.dumps(config, separators=(",", ":"))


def kv_events_endpoints(spec: EngineSpec) -> dict[str, str]:
    """What a router config names for ``spec``'s KV events (empty: no events)."""
    if spec.kv_events is None:
        return {}
    publisher, replay = spec.kv_events
    return {
        "kv_events_endpoint": f"tcp://{LOCALHOST}:{publisher}",
        "kv_events_replay": f"tcp://{LOCALHOST}:{replay}",
    }


def cpu_set(core: int | str) -> frozenset[int]:
    """The CPUs of an ``EngineSpec.core``: ``1`` or a list such as ``"0-1"`` or ``"0,2-3"``, or
    one list per rank apart by ``|`` (``"0|1"``: vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for an
    engine of two data-parallel or tensor-parallel ranks)."""
    if isinstance(core, int):
        return frozenset({core})
    cpus: set[int] = set()
    for part in core.replace("|", ",").split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def vllm_python_path(base: Mapping[str, str]) -> str:
    """``PYTHONPATH`` for a process that runs vLLM's CLI: the run-time fixes folder first."""
    return os.pathsep.join(filter(None, [str(ENGINE_SITE_DIR), base.get("PYTHONPATH")]))


def engine_env(spec: EngineSpec, base: Mapping[str, str]) -> dict[str, str]:
    """Environment for ``spec``: ``base`` plus pinning, side channel, offline mode, and the
    run-time fixes folder first on ``PYTHONPATH`` (engine processes only)."""
    env = dict(base)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # --kv-cache-memory-bytes decides instead
    env.update(
        PYTHONPATH=vllm_python_path(base),
        VLLM_CPU_OMP_THREADS_BIND=str(spec.core),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
        # vLLM forks EngineCore from its API server by default, which has threads by then; a
        # restarted P once hung in that child before its first line (fork with a lock held).
        # Spawned children start as fast here (20.6-20.9 s vs 21.1-22.1 s to ready, 1P1D).
        VLLM_WORKER_MULTIPROC_METHOD="spawn",
    )
    if spec.kv_port is not None:
        env.update(
            VLLM_NIXL_SIDE_CHANNEL_HOST=LOCALHOST,
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(spec.kv_port),
        )
    return env


def kv_cache_bytes_for(kv_bytes_per_token: int, max_model_len: int) -> int:
    """KV memory for about eight full-length sequences, at least 64 MiB, in whole MiB."""
    mib = 1024 * 1024
    wanted = max(64 * mib, kv_bytes_per_token * max_model_len * 8)
    return -(-wanted // mib) * mib
