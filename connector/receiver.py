"""D side of a worker rank: register blocks with P, count its WRITEs, report the receive.

Per transfer id: the scheduler's ``RecvSpec`` names the blocks P must fill; once the link to P is
READY, ``REG`` sends them. Every WRITE from P carries a ``W`` notice, delivered after its data;
``DONE`` says how many there are, so the receive is complete once that many ``W`` were seen;
``ACK`` then tells P it may free its blocks (see ``sender``: P keeps stepping until it does).
NIXL over TCP can hold a notice until the connection carries another, so each side repeats its
last notice while it waits (``Timeouts.nudge_s``): D its REG until the receive completes, P
its DONE until the ACK; D answers a DONE for a receive it completed lately with the ACK again.
Repeats are idempotent on both sides.

Every receive the scheduler hands over is reported exactly once, successful or failed: failed on
P's ``FAIL``, a refused or timed-out link, or the receive timeout (which also sends ``ABORT`` so P
stops writing). A request vLLM aborted while it waited is reported finished, not failed (vLLM has
already ended it), after an ``ABORT`` to P.

With P and D of unequal TP sizes a D worker hears every P worker ``tp_map`` names (several
when P's TP is larger): REG goes to each, and the receive is complete once each has sent DONE
and all their ``W`` notices have landed.

P pulling a kept turn (``RecvSpec.pull``) is a receive too, with ``PULL`` for ``REG`` and the
kept turn's D writing. A pull that fails is reported finished, with its blocks among the
load errors (``invalid_blocks``): vLLM computes from the first of them on (with
``kv_load_failure_policy: recompute``), so a lost kept turn costs only the time it saved.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from connector.address import NixlAddress
from connector.context import WorkerContext
from connector.metadata import Kind, RecvSpec, encode
from connector.peers import Link, LinkState
from connector.tp_map import TpMapError

__all__ = ["Receiver"]

# Receives completed lately whose DONE may come again (P repeats it until our ACK reaches it):
# enough for every receive completed within several nudge intervals on a busy D.
_ACKED_KEPT = 1024

# Under "vllm." so the lines land in the engine log with vLLM's format and level.
log = logging.getLogger(f"vllm.{__name__}")


@dataclass(slots=True)
class _Recv:
    spec: RecvSpec
    links: list[str]  # the P workers that write this worker's blocks (tp_map.sources)
    started: float
    peer_tp: int = 0  # P's TP size the map assumed; 0: the same as ours
    reg_sent: set[str] = field(default_factory=set)
    writes_seen: int = 0
    expected: int = 0  # the sum of the DONEs' counts
    done_from: set[str] = field(default_factory=set)
    failed: bool = False
    finished: bool = False
    nudged_at: float = 0.0  # when REG was last sent again (Receiver._nudge)

    @property
    def link(self) -> str:
        """The first source (the only one where P and D run the same TP size)."""
        return self.links[0]


class Receiver:
    """All D-side receives of one rank, keyed by request id and by tid; their only owner."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._recvs: dict[str, _Recv] = {}
        self._by_tid: dict[str, _Recv] = {}
        self._invalid: set[int] = set()  # blocks of failed pulls, not yet reported
        self._acked: OrderedDict[str, None] = OrderedDict()  # tids completed lately, oldest first

    @property
    def busy(self) -> bool:
        """True while any receive is not yet reported."""
        return bool(self._recvs)

    # -- the scheduler's plan -------------------------------------------------------------------

    def start(self, spec: RecvSpec) -> None:
        """Begin a receive: connect to P and register the blocks as soon as the link allows."""
        try:
            links, error = self._sources(spec), ""
        except TpMapError as exc:
            links, error = [spec.peer.engine_id], str(exc)
        recv = _Recv(spec, links, self._ctx.clock(), 0 if spec.pull else spec.peer.tp_size)
        self._recvs[spec.req_id] = recv
        self._by_tid[spec.tid] = recv
        if error:
            self._fail(recv, "refused", error, notify=False)
            return
        self._try_register(recv)

    def decode_aborted(self, req_id: str, tid: str, peer: NixlAddress) -> None:
        """vLLM aborted D's request: ABORT to P (even for a receive never started here)."""
        recv = self._recvs.get(req_id)
        if recv is None:
            try:
                names = self._sources(RecvSpec(req_id, tid, peer, 0, [], 0))
            except TpMapError:
                names = []  # P's own map refuses the same sizes
            for name in names:
                self._ctx.notice(name, encode(Kind.ABORT, tid, reason="aborted"))
            return
        if not recv.finished:
            self._fail(
                recv, "decode_abort", "decode request aborted", notify=True, load_error=False
            )
        recv.failed = False  # an abort is not a load failure: vLLM has already ended it

    # -- messages and links ---------------------------------------------------------------------

    def on_write(self, tid: str) -> None:
        """A ``W`` notice: one more WRITE of ``tid`` has landed."""
        recv = self._by_tid.get(tid)
        if recv is not None:
            recv.writes_seen += 1
            self._maybe_complete(recv)

    def on_done(self, peer: str, tid: str, body: dict[str, Any]) -> None:
        """P worker ``peer`` posted all its ``body["writes"]`` WRITEs of ``tid``."""
        recv = self._by_tid.get(tid)
        if recv is None and tid in self._acked:  # P repeats DONE: our ACK has not reached it
            self._ctx.stats.repeated()
            self._ctx.notice(peer, encode(Kind.ACK, tid))
            return
        if recv is not None and peer not in recv.done_from:
            recv.done_from.add(peer)
            recv.expected += int(body.get("writes", 0))
            self._maybe_complete(recv)

    def on_fail(self, tid: str, reason: str) -> None:
        """P gave up on ``tid``: the receive fails (P already knows, so no ABORT)."""
        recv = self._by_tid.get(tid)
        if recv is not None:
            self._fail(recv, "peer_fail", f"P failed the transfer: {reason}", notify=False)

    def on_peer_restarted(self, peer: str) -> None:
        """P worker ``peer`` restarted: receives (and pulls) it was asked for end, since the
        old incarnation will never write them; those not registered yet wait for the new one."""
        for recv in list(self._recvs.values()):
            if peer in recv.reg_sent:
                self._fail(recv, "peer_fail", f"P worker {peer} restarted", notify=False)

    def on_link_settled(self, link: Link) -> None:
        """Register (or fail) the receives that waited for ``link``."""
        for recv in list(self._recvs.values()):
            if link.name in recv.links:
                self._try_register(recv)

    # -- once per step --------------------------------------------------------------------------

    def collect(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids after applying the receive timeout; forgets them."""
        finished: set[str] = set()
        failed: set[str] = set()
        now = self._ctx.clock()
        t = self._ctx.t
        for recv in list(self._recvs.values()):
            limit = t.pull_s if recv.spec.pull else t.recv_s
            self._nudge(recv, now)
            if not recv.finished and now - recv.started > limit:
                self._fail(recv, "recv_timeout", f"no KV from the peer in {limit}s", notify=True)
            if recv.finished:
                finished.add(recv.spec.req_id)
                if recv.failed:
                    failed.add(recv.spec.req_id)
                self._recvs.pop(recv.spec.req_id, None)
                self._by_tid.pop(recv.spec.tid, None)
        return finished, failed

    def invalid_blocks(self) -> set[int]:
        """Blocks of pulls that failed since the last call (vLLM recomputes them)."""
        out, self._invalid = self._invalid, set()
        return out

    def shutdown(self) -> None:
        """Fail every receive and ABORT it, so each P stops writing and frees its blocks."""
        for recv in list(self._recvs.values()):
            self._fail(recv, "decode_abort", "D worker shutting down", notify=True)

    # -- internals ------------------------------------------------------------------------------

    def _sources(self, spec: RecvSpec) -> list[str]:
        """The agents of the P workers that write this worker for ``spec``: the one at our
        place where P's TP size is ours (``tp_size`` 0: unnamed, ours; and every pull), else
        those ``tp_map`` names. Raises ``TpMapError`` when the sizes do not map."""
        tp, peer = self._ctx.tp, spec.peer
        if spec.pull or peer.tp_size in (0, tp.size):
            return [self._ctx.peers.ensure(peer).name]
        return [
            self._ctx.peers.ensure(peer, r, peer.tp_size).name for r in tp.sources(peer.tp_size)
        ]

    def _try_register(self, recv: _Recv) -> None:
        for name in recv.links:
            link = self._ctx.peers.get(name)
            if name in recv.reg_sent or recv.finished or link is None:
                continue
            if link.state is LinkState.READY:
                expected = recv.peer_tp or self._ctx.tp.size
                if link.peer_tp and link.peer_tp != expected:
                    reason = (
                        f"{link.name} runs tensor-parallel size {link.peer_tp}, the request"
                        f" named {expected}: set tp_size for both engines in the router's config"
                    )
                    self._fail(recv, "refused", reason, notify=True)
                    return
                spec = recv.spec
                kind = Kind.PULL if spec.pull else Kind.REG
                self._ctx.notice(
                    link.name,
                    encode(kind, spec.tid, start=spec.start_block, blocks=spec.block_ids),
                )
                recv.reg_sent.add(name)
                log.debug(
                    "pd-connector: REG %s to %s sent %.1f ms after the receive began",
                    spec.tid,
                    name,
                    1000 * (self._ctx.clock() - recv.started),
                )
            elif link.settled:
                self._fail(recv, link.failure_kind, link.reason, notify=True)
                return

    def _maybe_complete(self, recv: _Recv) -> None:
        if recv.finished or len(recv.done_from) < len(recv.links):
            return
        if recv.writes_seen < recv.expected:
            return
        recv.finished = True
        if not recv.spec.pull:  # P holds its blocks (and keeps stepping) until this arrives
            for name in recv.links:
                self._ctx.notice(name, encode(Kind.ACK, recv.spec.tid))
            self._acked[recv.spec.tid] = None
            while len(self._acked) > _ACKED_KEPT:
                self._acked.popitem(last=False)
        log.debug(
            "pd-connector: receive %s complete after %.1f ms (%d writes)",
            recv.spec.tid,
            1000 * (self._ctx.clock() - recv.started),
            recv.writes_seen,
        )
        layout = self._ctx.layout
        if layout is not None:
            per_block = layout.block_bytes * len(layout.layers)
            self._ctx.stats.received(len(recv.spec.block_ids) * per_block)
        if recv.spec.pull:
            self._ctx.stats.pulled(recv.spec.num_tokens)

    def _nudge(self, recv: _Recv, now: float) -> None:
        """REG again to each P worker registered with, every ``nudge_s`` until the receive is
        complete: a REG, or what travels back for P's WRITEs, may be held on a connection until
        it carries more. P takes a repeated REG as the first (same blocks; nothing is written
        twice). Pulls are not repeated (a lost one is recomputed after ``pull_s``)."""
        every = self._ctx.t.nudge_s
        if every <= 0 or recv.finished or recv.spec.pull:
            return
        if now - max(recv.nudged_at, recv.started) < every:
            return
        recv.nudged_at = now
        spec = recv.spec
        for name in sorted(recv.reg_sent):
            log.debug("pd-connector: REG %s again to %s", spec.tid, name)
            self._ctx.stats.repeated()
            self._ctx.notice(
                name, encode(Kind.REG, spec.tid, start=spec.start_block, blocks=spec.block_ids)
            )

    def _fail(
        self, recv: _Recv, kind: str, reason: str, notify: bool, load_error: bool = True
    ) -> None:
        """End ``recv`` as failed once; ``notify`` sends ABORT so the peer stops writing. A
        failed pull is reported finished, its blocks as load errors (``load_error``)."""
        if recv.finished:
            return
        recv.finished = recv.failed = True
        if recv.spec.pull:
            recv.failed = False
            if load_error:
                self._invalid.update(recv.spec.block_ids)
        self._ctx.stats.failure(kind)
        log.warning(
            "pd-connector: receive %s (tid %s) failed: %s", recv.spec.req_id, recv.spec.tid, reason
        )
        if notify:
            for name in recv.links:  # not those that failed or refused: they are gone
                link = self._ctx.peers.get(name)
                if link is not None and link.state in (LinkState.READY, LinkState.CONNECTING):
                    self._ctx.notice(name, encode(Kind.ABORT, recv.spec.tid, reason=reason))
