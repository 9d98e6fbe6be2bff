"""P and D of unequal tensor-parallel sizes on the fake fabric (which really copies the bytes):
each D worker's blocks end up holding exactly its heads of the full KV, and each D worker
reports a receive once, after every P worker that writes it has said DONE."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from connector.address import NixlAddress
from connector.kept_turns import prefix_hashes
from connector.metadata import (
    KeepSpec,
    Kind,
    RecvSpec,
    SendSpec,
    StepMeta,
    agent_name,
    decode,
    encode,
)
from connector.worker import WorkerSide
from tests.connector.helpers import (
    BLOCK_SIZE,
    BLOCKS,
    HEAD_SIZE,
    LAYERS,
    Clock,
    Side,
    compat_fields,
    forward,
    idle,
)
from tests.connector.layouts import strided_caches
from tests.fakes.fake_nixl import Fabric

HEADS = 4  # the model's KV heads
P_BASE = NixlAddress("prefill-0", "127.0.0.1", 6600)
D_BASE = NixlAddress("decode-0", "127.0.0.1", 6700)


@dataclass
class Engine:
    sides: list[Side]
    addr: NixlAddress  # as the other engine's requests name it (with this engine's TP size)


def engine(
    fabric: Fabric,
    base: NixlAddress,
    clock: Clock,
    tp: int,
    *,
    seed: int | None,
    mla: bool = False,
    layout: str = "LBHNC",
) -> Engine:
    """``tp`` workers of one engine, each with its share of the heads (MLA: the latent, the
    same on every worker); random contents per worker from ``seed`` (None: zeros)."""
    heads = 1 if mla else HEADS // tp
    sides = []
    for rank in range(tp):
        caches = strided_caches(layout, LAYERS, BLOCKS, heads, BLOCK_SIZE, 2 * HEAD_SIZE)
        if seed is not None:
            gen = torch.Generator().manual_seed(seed + (0 if mla else rank))
            for t in caches.values():
                t.copy_(torch.rand(t.shape, generator=gen))
        name = agent_name(base.engine_id, rank)
        worker = WorkerSide(
            fabric.agent(name, base.port + rank),
            engine_id=base.engine_id,
            tp_rank=rank,
            host=base.host,
            port=base.port,
            compat_fields=compat_fields(
                tp_size=tp, num_kv_heads=heads, use_mla=mla, kv_layout=layout
            ),
            clock=clock,
            write_per_layer=True,
        )
        worker.register_kv_caches(caches, BLOCKS)
        sides.append(Side(worker, caches, name, fabric.agents[name]))
    addr = NixlAddress(base.engine_id, base.host, base.port, tp_size=tp)
    return Engine(sides, addr)


def full_kv(e: Engine, layer: str, ids: list[int], mla: bool) -> torch.Tensor:
    """The model's whole KV of ``ids`` as the engine holds it: its workers' heads in order
    (MLA: any one worker's latent)."""
    if mla:
        return e.sides[0].caches[layer][ids]
    return torch.cat([s.caches[layer][ids] for s in e.sides], dim=1)


def run(p: Engine, d: Engine, p_ids: list[int], d_ids: list[int], steps: int = 6) -> Counter[str]:
    """D registers, P computes the prompt in two chunks, everyone steps; returns how often
    each (D worker, request) and each (P worker, request) was reported finished."""
    seen: Counter[str] = Counter()
    for s in d.sides:
        count(seen, s, forward(s, StepMeta(recvs=[RecvSpec("d1", "t1", p.addr, 0, d_ids, 0)])))
    half = len(p_ids) // 2
    for s in p.sides:
        first = SendSpec("p1", "t1", d.addr, 0, p_ids[:half], 4, False)
        count(seen, s, forward(s, StepMeta(sends=[first])))
        s.finished.add("p1")
    for s in p.sides:
        last = SendSpec("p1", "t1", d.addr, half, p_ids[half:], 8, True)
        count(seen, s, forward(s, StepMeta(sends=[last])))
    return seen + settle(p, d, steps)


def count(seen: Counter[str], s: Side, got: tuple[set[str], set[str], set[str]]) -> None:
    sending, recving, failed = got
    seen.update(f"{s.name}:{r}" for r in sending | recving)
    seen.update(f"{s.name}:failed:{r}" for r in failed)


def settle(p: Engine, d: Engine, steps: int) -> Counter[str]:
    seen: Counter[str] = Counter()
    for _ in range(steps):
        for s in [*p.sides, *d.sides]:
            count(seen, s, idle(s))
    return seen


@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_each_decode_worker_gets_exactly_its_heads(tp_p: int, tp_d: int) -> None:
    fabric, clock = Fabric(), Clock()
    p = engine(fabric, P_BASE, clock, tp_p, seed=7)
    d = engine(fabric, D_BASE, clock, tp_d, seed=None)
    p_ids, d_ids = [1, 2, 3, 4], [10, 11, 12, 13]
    seen = run(p, d, p_ids, d_ids)
    for layer in p.sides[0].caches:
        # What an equal-TP transfer of the full KV gives: the model's heads, in place.
        assert torch.equal(full_kv(d, layer, d_ids, False), full_kv(p, layer, p_ids, False))
        others = [b for b in range(BLOCKS) if b not in d_ids]
        assert not full_kv(d, layer, others, False).any()  # nothing written elsewhere
    # Each D worker reports the receive once, successful; each P worker its send once.
    assert seen == Counter({f"{s.name}:{r}": 1 for s, r in [*_with(d, "d1"), *_with(p, "p1")]})


def _with(e: Engine, req: str) -> list[tuple[Side, str]]:
    return [(s, req) for s in e.sides]


def test_a_decode_worker_waits_for_every_prefill_worker_that_writes_it() -> None:
    fabric, clock = Fabric(), Clock()
    p = engine(fabric, P_BASE, clock, 2, seed=7)
    d = engine(fabric, D_BASE, clock, 1, seed=None)
    (d0,) = d.sides
    forward(d0, StepMeta(recvs=[RecvSpec("d1", "t1", p.addr, 0, [10, 11], 0)]))
    p0, p1 = p.sides
    forward(p0, StepMeta(sends=[SendSpec("p1", "t1", d.addr, 0, [1, 2], 8, True)]))
    forward(p1, StepMeta(sends=[SendSpec("p1", "t1", d.addr, 0, [1, 2], 8, False)]))
    for _ in range(4):  # P worker 0 is done (its DONE sent); P worker 1's prompt is not
        for s in (p0, p1, d0):
            assert "d1" not in idle(s)[1]
    dones = [m for _, raw in p0.agent.sent if (m := decode(raw)) and m.kind is Kind.DONE]
    assert len(dones) == 1
    forward(p1, StepMeta(sends=[SendSpec("p1", "t1", d.addr, 2, [], 8, True)]))
    got: list[str] = []
    for _ in range(4):
        idle(p1)
        got += list(idle(d0)[1])
    assert got == ["d1"]
    for layer in d0.caches:
        assert torch.equal(full_kv(d, layer, [10, 11], False), full_kv(p, layer, [1, 2], False))


@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 2), (2, 1)])
def test_mla_latent_is_written_whole_by_one_prefill_worker(tp_p: int, tp_d: int) -> None:
    fabric, clock = Fabric(), Clock()
    p = engine(fabric, P_BASE, clock, tp_p, seed=7, mla=True)
    d = engine(fabric, D_BASE, clock, tp_d, seed=None, mla=True)
    p_ids, d_ids = [1, 2, 3, 4], [10, 11, 12, 13]
    seen = run(p, d, p_ids, d_ids)
    for layer in p.sides[0].caches:
        for s in d.sides:
            assert torch.equal(s.caches[layer][d_ids], p.sides[0].caches[layer][p_ids])
    assert seen == Counter({f"{s.name}:{r}": 1 for s, r in [*_with(d, "d1"), *_with(p, "p1")]})
    # With P's TP larger, P worker 1 holds the same latent as worker 0 and writes nothing.
    writers = {x.src.name for x in fabric.xfers}
    assert writers == {p.sides[0].name}


def test_head_slices_need_heads_outermost_in_a_block() -> None:
    fabric, clock = Fabric(), Clock()
    p = engine(fabric, P_BASE, clock, 1, seed=7, layout="LBNHC")
    d = engine(fabric, D_BASE, clock, 2, seed=None, layout="LBNHC")
    seen = run(p, d, [1, 2], [10, 11])
    assert {f"{s.name}:failed:d1" for s in d.sides} <= set(seen)
    assert fabric.xfers == []
    link = d.sides[0].worker.peers.get(p.sides[0].name)
    assert link is not None and "head axis outermost" in link.reason


def test_a_request_naming_the_wrong_decode_size_fails_saying_what_to_set() -> None:
    """D runs TP 2, but P's request says nothing of D's size (the router does not know it):
    P writes its worker at its own place, the handshake passes (the sizes map), and P's send
    fails naming the sizes instead of writing whole blocks into half-size ones."""
    fabric, clock = Fabric(), Clock()
    p = engine(fabric, P_BASE, clock, 1, seed=7)
    d = engine(fabric, D_BASE, clock, 2, seed=None)
    unnamed = NixlAddress(D_BASE.engine_id, D_BASE.host, D_BASE.port, tp_size=0)
    for s in d.sides:
        forward(s, StepMeta(recvs=[RecvSpec("d1", "t1", p.addr, 0, [10], 0)]))
    (p0,) = p.sides
    forward(p0, StepMeta(sends=[SendSpec("p1", "t1", unnamed, 0, [1], 4, True)]))
    p0.finished.add("p1")
    seen = settle(p, d, 4)
    assert seen[f"{p0.name}:p1"] == 1 and fabric.xfers == []
    assert seen[f"{d.sides[0].name}:failed:d1"] == 1  # P's FAIL ends D worker 0's wait
    stats = p0.worker.stats.take()
    assert stats is not None and stats["failures"] == {"refused": 1}


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2)])
def test_a_kept_turn_between_unequal_sizes_is_declined_at_once(tp_p: int, tp_d: int) -> None:
    """Kept turns are read worker by worker between equal sizes only: P's asking worker
    declines as soon as its link says D's size (no ASK, no wait for a D worker that does not
    exist, up to reuse_timeout_s), the miss counted; D's entry is not taken. A P that asks
    anyway (another version) is refused by D at once, with the reason."""
    fabric, clock = Fabric(), Clock()
    p = engine(fabric, P_BASE, clock, tp_p, seed=None)
    d = engine(fabric, D_BASE, clock, tp_d, seed=7)
    for s in d.sides:
        s.worker.bind(StepMeta(keeps=[KeepSpec("d1", "t1", [5, 6], 20, prefix_hashes(TURN))]))
    for s in p.sides:
        s.worker.bind(StepMeta(asks={"p2": ("t1", d.addr)}))
    settle(p, d, 4)  # the clock does not move: declined within the handshake's steps
    asker = p.sides[0]
    assert asker.worker.take_answers() == {"p2": None}
    assert not [m for _, m in asker.agent.sent if _kind(m) is Kind.ASK]
    stats = asker.worker.stats.take()
    assert stats is not None and stats["kept_missed"] == 1

    # An ASK sent regardless: D answers FAIL, naming both sizes, and keeps its entry.
    keeper = d.sides[0]
    asker.agent.send_notif(keeper.name, encode(Kind.ASK, "t1"))
    idle(keeper)
    fails = [decode(m) for a, m in keeper.agent.sent if a == asker.name and _kind(m) is Kind.FAIL]
    assert len(fails) == 1 and fails[0] is not None
    assert f"(P {tp_p}, D {tp_d})" in str(fails[0].body["reason"])
    assert not [m for _, m in keeper.agent.sent if _kind(m) is Kind.HELD]


TURN = list(range(20))


def _kind(raw: bytes) -> Kind | None:
    msg = decode(raw)
    return None if msg is None else msg.kind
