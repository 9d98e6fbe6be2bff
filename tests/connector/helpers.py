"""Builders for connector tests: KV caches, worker pairs on the fake fabric, a manual clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from connector.address import NixlAddress
from connector.metadata import CONNECTOR_VERSION, agent_name
from connector.readiness import Readiness
from connector.worker import Timeouts, WorkerSide
from tests.fakes import clock as fakes_clock
from tests.fakes.fake_nixl import Fabric, FakeAgent

if TYPE_CHECKING:
    import torch

LAYERS = 3
BLOCKS = 16
BLOCK_SIZE = 4
HEADS = 2  # KV heads
HEAD_SIZE = 4
P_ADDR = NixlAddress("prefill-0", "127.0.0.1", 6600)
D_ADDR = NixlAddress("decode-0", "127.0.0.1", 6700)


class Clock(fakes_clock.Clock):
    """The tests' clock, started at 1000 s (the connector's times are never near 0)."""

    def __init__(self, now: float = 1000.0) -> None:
        super().__init__(now)


def kv_caches(
    fill: float | None = None, heads: int = HEADS, seed: int = 7
) -> dict[str, torch.Tensor]:
    """The KV cache as vLLM 0.32's CPU worker hands it over: one buffer, one ``[B, H, N, C]``
    view per layer in the ``LBHNC`` layout (the only one its CPU attention reads; C is K then
    V of one head at one token), ``heads`` KV heads. Random contents from ``seed`` unless
    ``fill`` is given."""
    import torch  # lazily: the pure scheduler tests must run without the engine extra

    from tests.connector.layouts import strided_caches

    caches = strided_caches("LBHNC", LAYERS, BLOCKS, heads, BLOCK_SIZE, 2 * HEAD_SIZE)
    buffer = next(iter(caches.values())).untyped_storage()
    flat = torch.empty(0, dtype=torch.float32).set_(buffer)
    if fill is not None:
        flat.fill_(fill)
    else:
        flat.copy_(torch.rand(flat.shape, generator=torch.Generator().manual_seed(seed)))
    return caches


def compat_fields(**over: Any) -> dict[str, Any]:
    base = {
        "version": CONNECTOR_VERSION,
        "model": "tiny",
        "block_size": BLOCK_SIZE,
        "num_kv_heads": HEADS,
        "head_size": HEAD_SIZE,
        "tp_size": 1,
        "kv_layout": "LBHNC",
        "attn_backend": "CPU_ATTN",
        "kv_cache_dtype": "auto",
        "use_mla": False,
        "pp_size": 1,
        "dp_size": 1,
        "dcp_size": 1,
    }
    base.update(over)
    return base


@dataclass
class Side:
    worker: WorkerSide
    caches: dict[str, torch.Tensor]
    name: str
    agent: FakeAgent  # what the worker sent (``agent.sent``)
    finished: set[str] = field(default_factory=set)

    def layers(self) -> list[str]:
        return list(self.caches)


def make_side(
    fabric: Fabric,
    addr: NixlAddress,
    clock: Clock,
    *,
    fill: float | None = None,
    timeouts: Timeouts | None = None,
    write_per_layer: bool | None = True,
    readiness: Readiness | None = None,
    caches: dict[str, torch.Tensor] | None = None,
    blocks: int = BLOCKS,
    **compat: Any,
) -> Side:
    """A worker on ``fabric`` at ``addr`` with ``caches`` (``blocks`` blocks a layer)
    registered; by default ``kv_caches(fill)``."""
    name = agent_name(addr.engine_id, 0)
    agent = fabric.agent(name, addr.port)
    w = WorkerSide(
        agent,
        engine_id=addr.engine_id,
        tp_rank=0,
        host=addr.host,
        port=addr.port,
        compat_fields=compat_fields(**compat),
        timeouts=timeouts or Timeouts(),
        clock=clock,
        write_per_layer=write_per_layer,
        readiness=readiness,
    )
    caches = kv_caches(fill) if caches is None else caches
    w.register_kv_caches(caches, blocks)
    return Side(w, caches, name, agent)


def forward(side: Side, step: Any) -> tuple[set[str], set[str], set[str]]:
    """One engine step on a worker: bind, every layer's save, wait_for_save, get_finished."""
    side.worker.bind(step)
    for name in side.layers():
        side.worker.save_layer(name)
    side.worker.end_step()
    return side.worker.get_finished(side.finished)


def idle(side: Side) -> tuple[set[str], set[str], set[str]]:
    """A step with nothing scheduled (no forward)."""
    from connector.metadata import StepMeta

    side.worker.bind(StepMeta())
    side.worker.end_step()
    return side.worker.get_finished(side.finished)


def request(
    req_id: str, params: dict[str, Any] | None, prompt_len: int, status: str = "RUNNING"
) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        kv_transfer_params=params,
        num_prompt_tokens=prompt_len,
        status=SimpleNamespace(name=status),
    )


def sched_output(
    new: list[tuple[str, list[int], int, int]] = (),  # type: ignore[assignment]
    cached: list[tuple[str, list[int] | None, int, int]] = (),  # type: ignore[assignment]
    resumed: set[str] | None = None,
) -> SimpleNamespace:
    """(req_id, block_ids, num_computed_before, num_scheduled) per request."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, *_ in cached],
            new_block_ids=[None if b is None else (b,) for _, b, _, _ in cached],
            num_computed_tokens=[c for _, _, c, _ in cached],
            resumed_req_ids=resumed or set(),
        ),
        num_scheduled_tokens={r: n for r, _, _, n in [*new, *cached]},
    )
