"""``PipelinedPushConnector``: the vLLM-facing facade. It only forwards to the role classes.

Load it on both engines with::

    --kv-transfer-config '{"kv_connector": "PipelinedPushConnector",
      "kv_connector_module_path": "connector", "kv_role": "kv_producer" | "kv_consumer",
      "kv_buffer_device": "cpu", "engine_id": "<unique id>",
      "kv_connector_extra_config": {"side_channel_host": "127.0.0.1", "side_channel_port": 6600}}'

``kv_connector_extra_config`` keys (all optional): ``side_channel_host``/``side_channel_port``
(default: ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``, else 127.0.0.1:5600; rank r listens on port+r),
``handshake_timeout_s``, ``registration_timeout_s``, ``receive_timeout_s``, ``write_timeout_s``
(see ``worker.Timeouts``), ``nudge_interval_s`` (1: how often a side still waiting on its
peer's notice sends its own last one again; 0: never), ``progress_thread`` (NIXL's UCX
progress thread, default false: the worker's own calls progress NIXL, see
``transport.RealNixlAgent``), ``progress_delay_us`` (that thread's sleep when it is on, default
1000),
``backends`` (default ``["UCX"]``), ``model_id`` (name compared in the handshake; default: the
model path), ``write_batch`` (``layer``: post each layer's WRITE as it is saved; ``step``: a
step's layers together after its forward; ``auto``, the default: ``step`` for a KV cache in DRAM,
``layer`` in device memory), ``keep_ttl_s`` (D: how long a finished turn asked to be kept,
``keep_turn``, waits for the next turn's P, 300), ``pull_timeout_s`` (a kept turn's ASK to PULL
and PULL to last WRITE, 5), ``reuse_timeout_s`` (P: how long a request waits for a kept
turn's D to answer before computing everything, 3). P needs vLLM's
``"kv_load_failure_policy": "recompute"`` for a failed pull to be recomputed, not failed.
``readiness_gate`` (default true) is for negative controls only: false posts WRITEs without
waiting for the device to write the KV (see ``connector.readiness``).

vLLM builds one instance with ``role=SCHEDULER`` in the engine-core process and one with
``role=WORKER`` in every worker process; each builds only its own half.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from connector.kept_turns import KeptTurnAnswer
from connector.metadata import CONNECTOR_VERSION, StepMeta, WorkerRank, engine_address
from connector.readiness import HostReadiness
from connector.scheduler import SchedulerSide
from connector.transport import RealNixlAgent
from connector.worker import Timeouts, WorkerSide

if TYPE_CHECKING:
    from connector.prom import PipelinedStats

__all__ = ["PINNED_LAYOUT", "KeptTurnAnswers", "PipelinedMetadata", "PipelinedPushConnector"]

# The KV cache layout P and D ask vLLM for (see get_required_kvcache_layout).
PINNED_LAYOUT = "LBHNC"

# Under "vllm." so the lines land in the engine log with vLLM's format and level.
log = logging.getLogger(f"vllm.{__name__}")


class PipelinedMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """The scheduler's per-step plan, as vLLM carries it to the workers."""

    def __init__(self, step: StepMeta) -> None:
        self.step = step


class KeptTurnAnswers(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Kept turns' answers to P's questions, by request id, as vLLM carries them from the
    workers to the scheduler (only rank 0 asks, so merging ranks is a union)."""

    def __init__(self, answers: dict[str, KeptTurnAnswer]) -> None:
        self.answers = answers

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KeptTurnAnswers):
            self.answers = {**self.answers, **other.answers}
        return self


class PipelinedPushConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """P pushes KV layer by layer into blocks D registered; see ``connector.worker``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError(
                "PipelinedPushConnector supports one KV cache group only; "
                "hybrid models are not supported"
            )
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                vllm_config.cache_config.block_size,
                float(extra.get("idle_sleep_s", 0.001)),
                reuse_timeout_s=float(extra.get("reuse_timeout_s", 3.0)),
            )
        else:
            self._worker = _build_worker(
                vllm_config, self._kv_transfer_config, extra, kv_cache_config
            )

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Registers the cache; the memory type follows its device, checked against
        ``kv_buffer_device``. ValueError (the engine does not start) for a layout or buffer
        device this connector cannot write (see ``connector.layout``)."""
        self._w().register_kv_caches(kv_caches, self._kv_cache_config.num_blocks)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, PipelinedMetadata):
            self._w().bind(connector_metadata.step)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing to start: D's KV arrives by P's WRITEs, before the request is scheduled."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for (see ``start_load_kv``)."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """The layer's kernels are launched, maybe not run: the worker records a mark and
        WRITEs the layer once it is ready (``connector.readiness``). Never blocks."""
        self._w().save_layer(layer_name)

    def wait_for_save(self) -> None:
        """The forward is launched: the worker closes the step behind one mark. Returns at
        once; the step's WRITEs are posted by later hooks as the device catches up."""
        self._w().end_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._w().get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().invalid_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        answers = self._w().take_answers()
        return KeptTurnAnswers(answers) if answers else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    def get_kv_connector_stats(self) -> PipelinedStats | None:
        from connector.prom import PipelinedStats

        data = self._w().stats.take() if self._worker is not None else None
        return PipelinedStats(data) if data else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()[0]
        self._s().update_state_after_alloc(request, list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return PipelinedMetadata(self._s().build_connector_meta(scheduler_output))

    def on_new_request(self, request: Any) -> None:
        self._s().on_new_request(request)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KeptTurnAnswers):
            self._s().on_answers(meta.answers)
        self._s().update_connector_output(
            set(connector_output.finished_sending or ()),
            set(connector_output.finished_recving or ()),
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids[0] if block_ids else [])

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()

    # -- class-level hooks ---------------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """``LBHNC`` (HND: layer-outer, blocks whole, heads outer inside a block), so P and D
        resolve the same layout whatever their attention backends prefer; MLA too, as P and D
        compare the layout's name. vLLM's engine core asks this once when it resolves the
        layout (``resolve_kv_cache_layout``); ``VLLM_KV_CACHE_LAYOUT`` overrides it, and a
        layout some backend cannot run is replaced by vLLM with a warning, so workers check
        what they got (``register_kv_caches``) and the handshake compares it."""
        if getattr(vllm_config, "model_config", None) is None:
            return None
        return PINNED_LAYOUT

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: P WRITEs layer by layer from ``save_kv_layer``, a Python hook that a full CUDA
        graph's replay skips. vLLM then runs attention outside the graphs (``PIECEWISE``), so
        each layer gets its hook and its mark. (A step that still misses a layer's hook has
        that layer written behind the step's end mark; this keeps the overlap.)"""
        return True

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34+ (``KVCacheAccess``): how the workers reach the KV cache, which decides
        how vLLM's extensible KV cache (on by default on CUDA and ROCm) allocates it. The
        workers register the cache with NIXL (UCX), which cannot register a range spanning
        several physical allocations, and peers on the host map it through UCX cuda_ipc:
        ``REGISTERS | EXPORTS_FABRIC`` for a cache in device memory, ``IN_PROCESS`` for one in
        host memory (``kv_buffer_device: cpu``), as vLLM's NIXL connector answers. vLLM 0.32
        and 0.33 have no such flags and never ask: None there."""
        flags = _kv_cache_access_flags()
        if flags is None:
            return None
        names = kv_cache_access_names(getattr(kv_transfer_config, "kv_buffer_device", None))
        access = flags[names[0]]
        for name in names[1:]:
            access |= flags[name]
        return access

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False (vLLM 0.33+ then refuses ``--enable-sleep-mode`` at start): sleep, and 0.34's
        ``/checkpoint/prepare``, release the KV memory that this connector's NIXL registrations
        and its peers' prepared descriptors still point at, and the connector implements no
        ``unregister_kv_caches`` / ``restore_kv_caches`` to tell them."""
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PipelinedStats:
        from connector.prom import PipelinedStats

        return PipelinedStats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        from connector.prom import PipelinedPromMetrics

        return PipelinedPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- helpers -------------------------------------------------------------------------------

    def _s(self) -> SchedulerSide:
        assert self._sched is not None, "scheduler-side method called on a worker connector"
        return self._sched

    def _w(self) -> WorkerSide:
        assert self._worker is not None, "worker-side method called on a scheduler connector"
        return self._worker


def kv_cache_access_names(kv_buffer_device: str | None) -> tuple[str, ...]:
    """The ``KVCacheAccess`` flags (vLLM 0.34+) of a cache on ``kv_buffer_device``: see
    :meth:`PipelinedPushConnector.kv_cache_access`."""
    if kv_buffer_device == "cpu":
        return ("IN_PROCESS",)
    return ("REGISTERS", "EXPORTS_FABRIC")


def _kv_cache_access_flags() -> Any:
    """vLLM's ``KVCacheAccess`` flag enum, or None where vLLM has none (0.32, 0.33)."""
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:
        return None
    return KVCacheAccess


def _build_worker(
    vllm_config: Any, kv_config: Any, extra: dict[str, Any], kv_cache_config: Any
) -> WorkerSide:
    """One agent per worker, listening on its engine's side-channel port + its index (see
    ``metadata.WorkerRank``, ``metadata.engine_address``)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.distributed.parallel_state import (
        get_pipeline_model_parallel_rank,
        get_tensor_model_parallel_rank,
    )

    parallel = vllm_config.parallel_config
    rank = WorkerRank(
        get_tensor_model_parallel_rank(),
        get_pipeline_model_parallel_rank(),
        parallel.tensor_parallel_size,
    )
    host = str(
        extra.get("side_channel_host") or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    )
    base_port = int(
        extra.get("side_channel_port") or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")
    )
    engine_id, port = engine_address(
        str(kv_config.engine_id),
        base_port,
        parallel.data_parallel_index,
        parallel.data_parallel_size,
        parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
    )
    backends = sorted({b.get_name() for b in get_current_attn_backends(vllm_config)})
    compat = compat_fields(vllm_config, kv_cache_config, backends, extra)
    keys = {
        "handshake_s": "handshake_timeout_s",
        "reg_s": "registration_timeout_s",
        "recv_s": "receive_timeout_s",
        "write_s": "write_timeout_s",
        "idle_wait_s": "idle_wait_s",
        "keep_s": "keep_ttl_s",
        "pull_s": "pull_timeout_s",
        "nudge_s": "nudge_interval_s",
    }
    timeouts = Timeouts(**{f: float(extra[k]) for f, k in keys.items() if k in extra})
    write_batch = str(extra.get("write_batch", "auto"))
    if write_batch not in ("auto", "layer", "step"):
        raise ValueError(f"write_batch must be 'auto', 'layer' or 'step', not {write_batch!r}")
    gate = extra.get("readiness_gate", True)
    if not isinstance(gate, bool):
        raise ValueError(f"readiness_gate must be true or false, not {gate!r}")
    if not gate:
        log.warning(
            "pd-connector: readiness_gate is off: WRITEs are posted without waiting for the "
            "device, and may read KV it has not written yet. For negative controls only."
        )
    thread = extra.get("progress_thread", False)
    if not isinstance(thread, bool):
        raise ValueError(f"progress_thread must be true or false, not {thread!r}")
    agent = RealNixlAgent(
        rank.agent_name(engine_id),
        port + rank.index,
        progress_thread=thread,
        progress_delay_us=int(extra.get("progress_delay_us", 1000)),
        backends=tuple(extra.get("backends", ("UCX",))),
    )
    return WorkerSide(
        agent,
        engine_id=engine_id,
        tp_rank=rank.tp_rank,
        pp_rank=rank.pp_rank,
        host=host,
        port=port,
        compat_fields=compat,
        kv_buffer_device=str(kv_config.kv_buffer_device),
        timeouts=timeouts,
        write_per_layer=None if write_batch == "auto" else write_batch == "layer",
        readiness=None if gate else HostReadiness(),
    )


def compat_fields(
    vllm_config: Any, kv_cache_config: Any, attn_backends: list[str], extra: dict[str, Any]
) -> dict[str, Any]:
    """``Compat``'s fields that vLLM's config decides (those of the cache's tensors are read
    at registration): what P and D must share for a block to be copied byte for byte."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or cache.kv_cache_layout
    return {
        "version": CONNECTOR_VERSION,
        "model": str(extra.get("model_id") or model.model),
        "block_size": cache.block_size,
        "num_kv_heads": model.get_num_kv_heads(parallel),
        "head_size": model.get_head_size(),
        "tp_size": parallel.tensor_parallel_size,
        "kv_layout": str(layout or ""),
        "attn_backend": ",".join(attn_backends),
        "kv_cache_dtype": str(cache.cache_dtype),
        "use_mla": bool(model.use_mla),
        "pp_size": parallel.pipeline_parallel_size,
        "dp_size": parallel.data_parallel_size,
        "dcp_size": parallel.decode_context_parallel_size,
    }
