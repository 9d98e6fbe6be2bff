"""P and D of unequal tensor-parallel sizes with real NIXL agents (UCX, DRAM), one process per
worker: each D worker's blocks hold exactly its heads of the full KV (what an equal-TP
transfer of the same KV gives, head slices in place), and each D worker reports the receive
exactly once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import torch

from connector.address import NixlAddress
from connector.metadata import RecvSpec, SendSpec, StepMeta
from router.stack.ports import pick_ports, port_is_free
from tests.connector.test_nixl_real import AgentNotStarted, Proc, until
from tests.needs import need_module

need_module("nixl")

pytestmark = pytest.mark.xdist_group("kv-ports")  # see test_nixl_real

HEADS = 4  # the model's KV heads


def _bases() -> tuple[int, int]:
    """Base side-channel ports of P and D, each with its next 3 ports free (one per worker)."""
    for _ in range(20):
        bases = pick_ports(2, range(6600, 6800, 4))
        if all(port_is_free(b + k) for b in bases for k in range(1, 4)):
            return bases[0], bases[1]
    raise AssertionError("no free port runs")


@contextmanager
def engines(
    tp_p: int, tp_d: int, mla: bool = False, attempts: int = 3
) -> Iterator[tuple[list[Proc], list[Proc], NixlAddress, NixlAddress]]:
    """P's ``tp_p`` and D's ``tp_d`` workers, one process each (P random, distinct per worker
    unless MLA; D zeroed); yields them with each engine's address as the other's requests
    name it (its TP size included). Ports taken between probe and bind: picked again."""
    for attempt in range(1, attempts + 1):
        p_base, d_base = _bases()
        p_addr = NixlAddress("it-prefill", "127.0.0.1", p_base, tp_size=tp_p)
        d_addr = NixlAddress("it-decode", "127.0.0.1", d_base, tp_size=tp_d)
        with ExitStack() as stack:
            try:
                ps = [
                    _proc(stack, p_addr, None, tp_p, r, mla, 7 if mla else 7 + r)
                    for r in range(tp_p)
                ]
                ds = [_proc(stack, d_addr, 0.0, tp_d, r, mla, 0) for r in range(tp_d)]
            except AgentNotStarted:
                if attempt == attempts:
                    raise
                continue
            yield ps, ds, p_addr, d_addr
            return


def _proc(
    stack: ExitStack,
    addr: NixlAddress,
    fill: float | None,
    tp: int,
    rank: int,
    mla: bool,
    seed: int,
) -> Proc:
    compat: dict[str, Any] = {
        "tp_size": tp,
        "num_kv_heads": 1 if mla else HEADS // tp,
        "use_mla": mla,
    }
    proc = Proc(addr, fill, {}, compat, rank, seed)
    stack.callback(proc.close)
    return proc


def transfer(
    ps: list[Proc], ds: list[Proc], p_addr: NixlAddress, d_addr: NixlAddress
) -> Counter[str]:
    """D registers blocks 10-12, P computes blocks 1-3 in two chunks; steps everyone until
    each D worker reported the receive and each P worker its send, then a few steps more.
    Returns how often each worker reported each request (``<side><rank>:<req>``)."""
    seen: Counter[str] = Counter()

    def note(tag: str, got: Any) -> None:
        sending, recving, failed = got
        seen.update(f"{tag}:{r}" for r in sending | recving)
        seen.update(f"{tag}:failed:{r}" for r in failed)

    for r, d in enumerate(ds):
        note(f"d{r}", d.step(StepMeta(recvs=[RecvSpec("d1", "t1", p_addr, 0, [10, 11, 12], 10)])))
    for r, p in enumerate(ps):
        note(
            f"p{r}", p.step(StepMeta(sends=[SendSpec("p1", "t1", d_addr, 0, [1], 4, False)]), True)
        )
        p.call("finish", "p1")
    for r, p in enumerate(ps):
        spec = SendSpec("p1", "t1", d_addr, 1, [2, 3], 10, True)
        note(f"p{r}", p.step(StepMeta(sends=[spec]), True))

    def all_reported() -> bool:
        for r, p in enumerate(ps):
            note(f"p{r}", p.step())
        for r, d in enumerate(ds):
            note(f"d{r}", d.step())
        return all(seen[f"d{r}:d1"] for r in range(len(ds))) and all(
            seen[f"p{r}:p1"] for r in range(len(ps))
        )

    until(all_reported, 30)  # D's receive timeout (120 s) cannot have ended a receive
    for _ in range(3):  # nothing is reported twice
        all_reported()
    return seen


def expected(ps: int, ds: int) -> Counter[str]:
    return Counter({**{f"d{r}:d1": 1 for r in range(ds)}, **{f"p{r}:p1": 1 for r in range(ps)}})


@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 2), (2, 1)])
def test_unequal_tp_lands_each_head_in_place(tp_p: int, tp_d: int) -> None:
    with engines(tp_p, tp_d) as (ps, ds, p_addr, d_addr):
        seen = transfer(ps, ds, p_addr, d_addr)
        assert seen == expected(tp_p, tp_d)
        # [layer, block, head, token, content]: the model's heads are the workers' in order.
        full_p = torch.cat([p.call("blocks", [1, 2, 3]) for p in ps], dim=2)
        full_d = torch.cat([d.call("blocks", [10, 11, 12]) for d in ds], dim=2)
        assert full_p.shape[2] == HEADS and torch.equal(full_d, full_p)
        untouched = torch.cat([d.call("blocks", [0, 9, 13]) for d in ds], dim=2)
        assert not untouched.any()


def test_mla_larger_prefill_one_worker_writes_the_latent() -> None:
    with engines(2, 1, mla=True) as (ps, ds, p_addr, d_addr):
        seen = transfer(ps, ds, p_addr, d_addr)
        assert seen == expected(2, 1)
        assert torch.equal(ds[0].call("blocks", [10, 11, 12]), ps[0].call("blocks", [1, 2, 3]))
        assert ps[0].call("stats")["num_writes"] > 0
        idle = ps[1].call("stats")  # P worker 1 holds the same latent: it writes nothing
        assert idle is None or idle["num_writes"] == 0
