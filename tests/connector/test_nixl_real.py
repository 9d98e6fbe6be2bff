"""Real NIXL agents (UCX, DRAM) in two processes: handshake, per-layer WRITEs, completion, and
both failure notices. Slower than the fake-fabric tests (process start, real sockets)."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pytest
import torch

from connector.address import NixlAddress
from connector.metadata import RecvSpec, SendSpec, StepMeta
from router.stack.ports import pick_ports
from tests.connector import nixl_proc
from tests.connector.helpers import LAYERS
from tests.needs import need_module

need_module("nixl")

# One xdist worker runs the real-NIXL modules (kv-ports): their agents pick ports from one
# range, and two workers probing it at once could both pick the same one.
pytestmark = pytest.mark.xdist_group("kv-ports")


class AgentNotStarted(Exception):
    """The process's NIXL agent never said it was ready (the process ended, e.g. its metadata
    listener could not bind the port picked for it)."""


class Proc:
    def __init__(
        self,
        addr: NixlAddress,
        fill: float | None,
        timeouts: dict[str, float],
        compat: dict[str, Any],
        tp_rank: int = 0,
        seed: int = 7,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        args = (child, addr, fill, timeouts, compat, tp_rank, seed)
        self.proc = ctx.Process(target=nixl_proc.serve, args=args, daemon=True)
        self.proc.start()
        child.close()  # only the child holds its end now: its exit reads as EOF here at once
        try:
            ready = self.conn.poll(60) and self.conn.recv() == "ready"
        except EOFError:
            ready = False
        if not ready:
            self.close()
            raise AgentNotStarted(f"{addr}: exit code {self.proc.exitcode}")

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        assert self.conn.poll(30), f"no reply to {cmd[0]}"
        return self.conn.recv()

    def step(self, meta: StepMeta | None = None, forward: bool = False) -> Any:
        return self.call("step", meta, forward)

    def close(self) -> None:
        if self.proc.is_alive():
            with suppress(AssertionError, OSError):
                self.call("exit")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


@contextmanager
def pair(
    timeouts: dict[str, float] | None = None, d_compat: dict[str, Any] | None = None
) -> Iterator[tuple[Proc, Proc, NixlAddress, NixlAddress]]:
    p, d, p_addr, d_addr = _started_pair(timeouts or {}, d_compat or {})
    try:
        yield p, d, p_addr, d_addr
    finally:
        p.close()
        d.close()


def _started_pair(
    timeouts: dict[str, float], d_compat: dict[str, Any], attempts: int = 3
) -> tuple[Proc, Proc, NixlAddress, NixlAddress]:
    """P and D agents on two ports picked free. A port probed free can be taken before the
    agent binds it (CI saw "Address already in use" once in three runs): then both are
    stopped and two other ports picked, up to ``attempts`` times."""
    for attempt in range(1, attempts + 1):
        p_port, d_port = pick_ports(2, range(6600, 6800))
        p_addr = NixlAddress("it-prefill", "127.0.0.1", p_port)
        d_addr = NixlAddress("it-decode", "127.0.0.1", d_port)
        p: Proc | None = None
        try:
            p = Proc(p_addr, None, timeouts, {})
            d = Proc(d_addr, 0.0, timeouts, d_compat)
        except AgentNotStarted as exc:
            if p is not None:
                p.close()
            if attempt == attempts:
                raise
            print(f"agent not started ({exc}); picking other ports")
            continue
        return p, d, p_addr, d_addr
    raise AssertionError("unreachable")


def until(fn: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = fn()
        if result:
            return result
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def test_per_layer_writes_land_and_complete() -> None:
    with pair() as (p, d, p_addr, d_addr):
        d.step(StepMeta(recvs=[RecvSpec("d1", "t1", p_addr, 0, [10, 11, 12], 10)]))
        p.step(StepMeta(sends=[SendSpec("p1", "t1", d_addr, 0, [1], 4, False)]), forward=True)
        p.step(StepMeta(sends=[SendSpec("p1", "t1", d_addr, 1, [2, 3], 10, True)]), forward=True)

        def d_done() -> bool:
            p.step()
            return "d1" in d.step()[1]

        until(d_done)  # within 10 s: D's receive timeout (120 s) cannot have ended it
        assert torch.equal(p.call("blocks", [1, 2, 3]), d.call("blocks", [10, 11, 12]))
        p.call("finish", "p1")
        until(lambda: "p1" in p.step()[0])
        stats = p.call("stats")
        # Layers of chunk 1 were queued until D's handles came; at most one write per layer
        # per flush, never one write for the whole request.
        assert LAYERS <= stats["num_writes"] <= 2 * LAYERS
        assert stats["bytes_written"] > 0


def test_prefill_failure_reaches_decode() -> None:
    with pair() as (p, d, p_addr, d_addr):
        d.step(StepMeta(recvs=[RecvSpec("d1", "t1", p_addr, 0, [10], 4)]))
        p.step(StepMeta(sends=[SendSpec("p1", "t1", d_addr, 0, [1], 2, False)]), forward=True)
        p.step(StepMeta(fail_sends={"p1": ("t1", d_addr)}))

        def d_failed() -> bool:
            p.step()
            return "d1" in d.step()[2]

        # Within 10 s: P's FAIL, not D's receive timeout (120 s), ends D's wait.
        until(d_failed)
        assert d.call("stats")["failures"] == {"peer_fail": 1}  # P's FAIL notice
        p.call("finish", "p1")
        until(lambda: "p1" in p.step()[0])


def test_decode_abort_reaches_prefill() -> None:
    with pair() as (p, d, p_addr, d_addr):
        d.step(StepMeta(recvs=[RecvSpec("d1", "t1", p_addr, 0, [10, 11], 8)]))
        p.step(StepMeta(sends=[SendSpec("p1", "t1", d_addr, 0, [1], 4, False)]), forward=True)

        def p_writes() -> bool:  # the handshake is done and D's REG reached P: P writes
            d.step()
            p.step()
            stats = p.call("stats")
            return bool(stats and stats["num_writes"])

        until(p_writes)
        finished = d.step(StepMeta(abort_recvs={"d1": ("t1", p_addr)}))
        assert finished[1] == {"d1"} and finished[2] == set()

        def p_saw_abort() -> bool:
            p.step()
            stats = p.call("stats")
            return bool(stats and stats["failures"].get("decode_abort"))

        until(p_saw_abort)
        p.call("finish", "p1")
        until(lambda: "p1" in p.step()[0])


def test_mismatched_decode_is_refused() -> None:
    with pair(d_compat={"num_kv_heads": 4}) as (p, d, p_addr, d_addr):
        d.step(StepMeta(recvs=[RecvSpec("d1", "t1", p_addr, 0, [10], 4)]))
        p.step(StepMeta(sends=[SendSpec("p1", "t1", d_addr, 0, [1], 4, True)]), forward=True)

        def d_failed() -> bool:
            p.step()
            return "d1" in d.step()[2]

        until(d_failed)
        stats = d.call("stats")
        assert stats["failures"].get("refused") == 1


def test_real_agent_progress_thread_does_not_spin() -> None:
    """nixl hard-codes a zero progress-thread delay; the adapter must not burn a core idle."""
    import os

    from connector.transport import RealNixlAgent

    port = pick_ports(1, range(6600, 6800))[0]
    agent = RealNixlAgent("idle-check", port)
    t0 = os.times()
    time.sleep(2)
    t1 = os.times()
    agent.close()
    assert (t1.user + t1.system) - (t0.user + t0.system) < 0.5


def test_a_missing_backend_plugin_is_an_error_naming_the_available_ones() -> None:
    """NIXL itself only warns and builds an agent that can never transfer."""
    from connector.transport import RealNixlAgent

    port = pick_ports(1, range(6600, 6800))[0]
    with pytest.raises(RuntimeError) as err:
        RealNixlAgent("no-plugin", port, backends=("UCX", "NO_SUCH_PLUGIN"))
    assert "['NO_SUCH_PLUGIN'] not available" in str(err.value) and "'UCX'" in str(err.value)


def test_deregistered_memory_can_no_longer_be_written_from() -> None:
    """Shutdown's ``deregister`` really deregisters: a list over that memory no longer
    prepares (and one over registered memory did, block rows included)."""
    from connector.transport import RealNixlAgent

    port = pick_ports(1, range(6600, 6800))[0]
    agent = RealNixlAgent("dereg-check", port)
    buf = torch.zeros(4096, dtype=torch.int8)
    rows = [(buf.data_ptr(), 256, 0, 512, 8)]
    try:
        agent.register([(buf.data_ptr(), buf.numel(), 0)], "DRAM")
        agent.release_prepped(agent.prep_blocks(None, rows, "DRAM"))
        agent.deregister()
        with pytest.raises(Exception, match="NOT_FOUND"):
            agent.prep_blocks(None, rows, "DRAM")
    finally:
        agent.close()


def _transfer(p: Proc, d: Proc, p_addr: NixlAddress, d_addr: NixlAddress, n: int) -> Any:
    """One transfer ``t<n>`` of P's blocks 1-2 into D's 10-11, stepped until both ends
    reported it; returns (D's failed receives, P's stats)."""
    d.step(StepMeta(recvs=[RecvSpec(f"d{n}", f"t{n}", p_addr, 0, [10, 11], 8)]))
    p.step(StepMeta(sends=[SendSpec(f"p{n}", f"t{n}", d_addr, 0, [1, 2], 8, True)]), True)
    p.call("finish", f"p{n}")
    failed: set[str] = set()
    sent: set[str] = set()
    received: set[str] = set()

    def both_done() -> bool:
        # Reported in different steps: P reports once D's ACK came, after D's report.
        sent.update(p.step()[0])
        _, recvd, bad = d.step()
        received.update(recvd)
        failed.update(bad)
        return f"p{n}" in sent and f"d{n}" in received

    until(both_done, 20)  # the handshake timeout (5 s) would have failed it before
    return failed, p.call("stats")


def test_decode_restarted_under_the_same_engine_id_is_linked_again() -> None:
    """D's worker restarts under the same engine id (so the same agent name): P drops its
    link to the old incarnation (its agent's remote, its prepared list) as soon as the new
    one says HELLO, and the next transfer lands, instead of D failing every request on a
    handshake P never answers."""
    p, d, p_addr, d_addr = _started_pair({}, {})
    try:
        failed, _ = _transfer(p, d, p_addr, d_addr, 1)
        assert failed == set()
        d.close()
        d = Proc(d_addr, 0.0, {}, {})  # the same engine id and port: the same agent name
        failed, stats = _transfer(p, d, p_addr, d_addr, 2)
        assert failed == set()
        assert torch.equal(p.call("blocks", [1, 2]), d.call("blocks", [10, 11]))
        # The old incarnation's metadata was removed once, and nothing failed on P's side.
        assert p.call("removed") == ["pdr-it-decode-tp0"]
        assert stats["failures"] == {}
    finally:
        p.close()
        d.close()
