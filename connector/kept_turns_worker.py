"""Kept turns on the worker side: D's ``KeptTurnKeeper`` and P's ``KeptTurnAsker`` (see
``connector.kept_turns``).

Flow for one kept turn ``tid`` (the finished turn's transfer id)::

    D scheduler: request finished normally with keep_turn -> KeepSpec -> D worker keeps it
    next turn's P scheduler: ASK planned ------ ASK(tid) --------------------------> D worker
    D worker: the entry is taken (used once) <- HELD(tid, tokens, hashes) ---------- D worker
    P scheduler compares hashes, claims a prefix; PULL(tid, start, blocks) -------> D worker
    D worker, once the turn's readiness mark is ready: one WRITE per layer (+ W),
        DONE(tid, writes) ------------------------------------------------------> P receiver
    D's WRITEs complete -> finished_sending -> vLLM frees D's blocks

An entry that nobody asks for is dropped at ``keep_s``; one asked for but never pulled (P
declined with an empty PULL, or vanished) at ``pull_s`` after the ASK. Every way out reports
the request's blocks free exactly once. An ASK can arrive before the turn's ``KeepSpec``: the
client has the answer once its last bytes go out, and vLLM hands the worker a finished
request's plan a step or two later (one more with asynchronous scheduling); such an ASK waits
up to ``early_ask_s`` for it, while a request to be kept under that id is still running
(``expect``, from the scheduler when it admits the request); an ASK for an id no running
request will keep is refused at once, so a router that names a keep id without knowing
whether it was kept (``router/pd/kept_turns.py``) costs P one round trip, not ``early_ask_s``.

The id of a kept turn (``tid``) is the router's keep id (one per conversation: each kept turn
replaces the conversation's previous one on this D) or the turn's transfer id. A turn kept
under an id already held retires the older entry: one nobody asked for is freed at once; one
being read finishes under a private name. ASK, PULL and ABORT always address the current
entry, and a PULL or an ABORT only from the P that asked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from connector.address import NixlAddress
from connector.context import WorkerContext
from connector.kept_turns import KeptTurnAnswer
from connector.metadata import KeepSpec, Kind, encode
from connector.peers import Link, LinkState
from connector.readiness import Mark

__all__ = ["KeptTurnAsker", "KeptTurnKeeper", "unequal_tp"]

# Under "vllm." so the lines land in the engine log with vLLM's format and level.
log = logging.getLogger(f"vllm.{__name__}")


def unequal_tp(p_tp: int, d_tp: int) -> str:
    """Why a kept turn cannot be read between P at ``p_tp`` and D at ``d_tp`` workers ("" if
    it can; 0: not known yet). A kept turn is pulled worker by worker, each P worker from the
    D worker at its own place, whole blocks: unequal sizes would need the head map
    (``tp_map``) in reverse, which kept turns do not do. P declines at once and computes the
    turn, instead of waiting for a D worker that does not exist."""
    if not p_tp or not d_tp or p_tp == d_tp:
        return ""
    return (
        f"kept turns need P and D at the same tensor-parallel size (P {p_tp}, D {d_tp}):"
        " P computes the turn"
    )


@dataclass(slots=True)
class _Kept:
    spec: KeepSpec
    ready: Mark  # the device has finished every forward that may write these blocks
    expires_at: float
    asked_at: float | None = None
    link: str | None = None  # the P that pulls
    pull: tuple[int, list[int]] | None = None  # P's (first logical block, block ids)
    written: bool = False
    handles: list[tuple[object, float]] = field(default_factory=list)
    done: bool = False  # nothing more will be written: free once the handles drain
    asker: str | None = None  # the P whose ASK took the entry


class KeptTurnKeeper:
    """D: the finished turns this rank keeps, by tid; their only owner."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._kept: dict[str, _Kept] = {}
        self._early: dict[str, tuple[str, float]] = {}  # tid -> (P agent, asked at)
        self._expected: dict[str, int] = {}  # tid -> running requests to be kept under it

    @property
    def busy(self) -> bool:
        """True while a P is being served (an ASK answered, WRITEs in flight)."""
        return any(
            (k.asked_at is not None and not k.done) or k.handles for k in self._kept.values()
        )

    def knows(self, tid: str) -> bool:
        return tid in self._kept

    def keep(self, spec: KeepSpec, ready: Mark) -> None:
        """The scheduler kept a finished turn's blocks; ``ready``, recorded when the spec is
        bound, follows every forward that can still write them. With asynchronous scheduling
        vLLM schedules step N+1 before it sees step N's token end the request, and counts
        N+1's token as computed, so N+1, still running on the device, writes KV that the turn
        holds; it was launched before the step that carries this spec, hence before the mark."""
        self._retire(spec.tid)
        self._kept[spec.tid] = _Kept(spec, ready, self._ctx.clock() + self._ctx.t.keep_s)
        self._count_down(spec.tid)
        self._ctx.stats.kept()
        early = self._early.pop(spec.tid, None)
        if early is not None:
            self.on_ask(early[0], spec.tid)

    def expect(self, tid: str) -> None:
        """A running request will be kept under ``tid`` if it finishes normally."""
        self._expected[tid] = self._expected.get(tid, 0) + 1

    def unexpect(self, tid: str) -> None:
        """A request to be kept under ``tid`` finished without being kept: an ASK waiting
        for it is refused once no other is running."""
        if self._count_down(tid):
            return
        early = self._early.pop(tid, None)
        if early is not None:
            self.on_ask(early[0], tid)

    def on_ask(self, peer: str, tid: str) -> None:
        """P asks what ``tid`` holds: HELD (taking the entry), a wait for a turn still
        running (see module doc), or FAIL."""
        link = self._ctx.peers.get(peer)
        reason = unequal_tp(link.peer_tp if link is not None else 0, self._ctx.tp.size)
        if reason:  # the entry is not taken: a P of this engine's size may still read it
            self._ctx.notice(peer, encode(Kind.FAIL, tid, reason=reason))
            return
        kept = self._kept.get(tid)
        now = self._ctx.clock()
        if kept is None or kept.asked_at is not None or kept.done or now >= kept.expires_at:
            if tid in self._expected:
                self._early[tid] = (peer, now)  # its KeepSpec may be a step behind
            else:
                self._ctx.notice(peer, encode(Kind.FAIL, tid, reason="no kept turn for this tid"))
            return
        kept.asked_at, kept.asker = now, peer
        spec = kept.spec
        self._ctx.notice(peer, encode(Kind.HELD, tid, tokens=spec.num_tokens, hashes=spec.hashes))

    def on_pull(self, peer: str, tid: str, body: dict[str, Any]) -> None:
        """P's PULL: write the kept blocks it names (none: it declined them)."""
        kept = self._kept.get(tid)
        if kept is None or kept.done or kept.pull is not None or kept.asker != peer:
            self._ctx.notice(peer, encode(Kind.FAIL, tid, reason="no kept turn for this tid"))
            return
        blocks = [int(b) for b in body.get("blocks") or ()]
        if not blocks:
            kept.done = True
            return
        kept.link, kept.pull = peer, (int(body.get("start", 0)), blocks)
        self._write(kept)

    def on_abort(self, peer: str, tid: str) -> None:
        """P gave up (its request aborted): write nothing more."""
        kept = self._kept.get(tid)
        if kept is not None and kept.asker == peer:
            kept.done = True

    def on_peer_restarted(self, peer: str) -> None:
        """P ``peer`` restarted: a pull it asked for is never written (its blocks are gone);
        the kept turn is freed once its WRITEs in flight drain."""
        for kept in self._kept.values():
            if kept.link == peer and kept.asked_at is not None:
                kept.done = True
        for tid in [t for t, (p, _) in self._early.items() if p == peer]:
            del self._early[tid]

    def on_link_settled(self, link: Link) -> None:
        for kept in list(self._kept.values()):
            if kept.link == link.name and not kept.written and not kept.done:
                self._write(kept)

    def collect(self) -> set[str]:
        """Request ids whose blocks can be freed now (reported once); forgets them."""
        now = self._ctx.clock()
        pull_s = self._ctx.t.pull_s
        for tid, (peer, at) in list(self._early.items()):
            if now - at > self._ctx.t.early_ask_s:
                del self._early[tid]
                self._ctx.notice(peer, encode(Kind.FAIL, tid, reason="no kept turn for this tid"))
        free: set[str] = set()
        for tid, kept in list(self._kept.items()):
            if kept.pull is not None and not kept.written and not kept.done:
                self._write(kept)  # pulled while its mark was not ready yet
            self._check_handles(kept, now)
            if kept.asked_at is None and now >= kept.expires_at:
                kept.done = True
                self._ctx.stats.kept_expired()
            elif kept.pull is None and kept.asked_at is not None and now - kept.asked_at > pull_s:
                kept.done = True  # asked, never pulled: P vanished
            if kept.done and not kept.handles:
                free.add(kept.spec.req_id)
                del self._kept[tid]
        return free

    def shutdown(self) -> None:
        for kept in self._kept.values():
            if kept.link is not None and not kept.done:
                self._ctx.notice(
                    kept.link, encode(Kind.FAIL, kept.spec.tid, reason="D shutting down")
                )
            kept.done = True

    # -- internals ------------------------------------------------------------------------------

    def _count_down(self, tid: str) -> bool:
        """One request to be kept under ``tid`` fewer; True if others still run."""
        left = self._expected.get(tid, 0) - 1
        if left > 0:
            self._expected[tid] = left
            return True
        self._expected.pop(tid, None)
        return False

    def _retire(self, tid: str) -> None:
        """A newer turn is kept under ``tid``: the older one is freed (nobody asked for it)
        or finishes being read under a private name."""
        old = self._kept.pop(tid, None)
        if old is None:
            return
        if old.asked_at is None:
            old.done = True
        self._kept[f"{tid}\x00{old.spec.req_id}"] = old

    def _write(self, kept: _Kept) -> None:
        """One WRITE per layer of the pulled blocks, then DONE; or FAIL."""
        assert kept.link is not None and kept.pull is not None
        link = self._ctx.peers.get(kept.link)
        layout = self._ctx.layout
        if link is None or layout is None or link.state is not LinkState.READY:
            if link is None or link.settled:
                self._fail(kept, "no link to the pulling P")
            return  # on_link_settled retries
        if link.layout is None:
            self._fail(kept, "P sent no KV layout")
            return
        if not kept.ready.ready():
            return  # collect retries, without blocking
        kept.written = True
        start, dst = kept.pull
        src = kept.spec.block_ids[start : start + len(dst)]
        dst = dst[: len(src)]
        now = self._ctx.clock()
        writer = self._ctx.writer  # descriptor lists prepared once: only indices per WRITE
        notif = encode(Kind.W, kept.spec.tid)
        for layer in range(len(layout.layers)):
            try:
                handle = writer.write(link.name, link.layout, layer, src, dst, notif)
            except Exception as exc:
                self._fail(kept, f"posting WRITE failed: {exc}")
                return
            kept.handles.append((handle, now))
            self._ctx.stats.wrote(writer.bytes_of(len(src)))
        self._ctx.notice(link.name, encode(Kind.DONE, kept.spec.tid, writes=len(kept.handles)))
        kept.done = True

    def _fail(self, kept: _Kept, reason: str) -> None:
        log.warning("pd-connector: kept turn %s not sent: %s", kept.spec.tid, reason)
        self._ctx.stats.failure("write_error")
        if kept.link is not None:
            self._ctx.notice(kept.link, encode(Kind.FAIL, kept.spec.tid, reason=reason))
        kept.done = True

    def _check_handles(self, kept: _Kept, now: float) -> None:
        pending: list[tuple[object, float]] = []
        for handle, posted in kept.handles:
            state = self._ctx.xfer_state(handle)
            if state == "PROC" and now - posted <= self._ctx.t.write_s:
                pending.append((handle, posted))
                continue
            self._ctx.release(handle)
            if state != "DONE" and kept.link is not None:  # P still counts W notices
                self._ctx.notice(kept.link, encode(Kind.FAIL, kept.spec.tid, reason="WRITE failed"))
        kept.handles = pending


class KeptTurnAsker:
    """P: the questions this rank asked kept turns' D, by tid; their only owner. Rank 0 asks
    (every rank's D holds the same turn); each rank pulls its own KV shard."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._asks: dict[str, _Ask] = {}
        self._answers: dict[str, KeptTurnAnswer] = {}

    def knows(self, tid: str) -> bool:
        return tid in self._asks

    @property
    def busy(self) -> bool:
        return bool(self._asks)

    def ask(self, req_id: str, tid: str, peer: NixlAddress) -> None:
        if self._ctx.rank != 0:
            return
        if tid in self._asks:
            # Another request of this P reads the turn (one conversation, two requests at
            # once): D serves one reader; this one computes everything.
            self._answers[req_id] = None
            return
        link = self._ctx.peers.ensure(peer)
        self._asks[tid] = _Ask(req_id, link.name, self._ctx.clock())
        self._try_ask(tid)

    def on_held(self, tid: str, body: dict[str, Any]) -> None:
        ask = self._asks.pop(tid, None)
        if ask is None:
            return
        hashes = body.get("hashes")
        tokens = body.get("tokens")
        answer: KeptTurnAnswer = None
        if isinstance(tokens, int) and isinstance(hashes, list):
            answer = (tokens, [str(h) for h in hashes])
        self._answers[ask.req_id] = answer

    def on_fail(self, tid: str, reason: str) -> None:
        """D refused, or no answer can come: the request computes everything."""
        ask = self._asks.pop(tid, None)
        if ask is not None:
            log.info("pd-connector: kept turn %s not read: %s", tid, reason)
            self._ctx.stats.kept_missed()
            self._answers[ask.req_id] = None

    def on_peer_restarted(self, peer: str) -> None:
        """D ``peer`` restarted: an ASK it got is never answered (its kept turns are gone)."""
        for tid, ask in list(self._asks.items()):
            if ask.link == peer and ask.sent:
                self.on_fail(tid, f"D worker {peer} restarted")

    def on_link_settled(self, link: Link) -> None:
        for tid, ask in list(self._asks.items()):
            if ask.link == link.name:
                self._try_ask(tid)

    def take_answers(self) -> dict[str, KeptTurnAnswer]:
        """D's answers since the last call, by request id; questions unanswered for
        ``pull_s`` are answered None (the scheduler has long stopped waiting)."""
        cutoff = self._ctx.clock() - self._ctx.t.pull_s
        for tid in [t for t, a in self._asks.items() if a.started < cutoff]:
            self.on_fail(tid, "no answer from D in time")
        answers, self._answers = self._answers, {}
        return answers

    def _try_ask(self, tid: str) -> None:
        ask = self._asks[tid]
        link = self._ctx.peers.get(ask.link)
        if ask.sent or link is None:
            return
        if link.state is LinkState.READY:
            reason = unequal_tp(self._ctx.tp.size, link.peer_tp)
            if reason:  # declined before asking: D's entry stays for a P of its size
                self.on_fail(tid, reason)
                return
            self._ctx.notice(ask.link, encode(Kind.ASK, tid))
            ask.sent = True
        elif link.settled:
            self.on_fail(tid, f"no link to D ({link.state.value})")


@dataclass(slots=True)
class _Ask:
    req_id: str
    link: str
    started: float
    sent: bool = False
