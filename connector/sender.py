"""P side of a worker rank: WRITE each layer's new blocks into the blocks D registered, then DONE.

Per transfer id: each step's ``SendSpec`` names the blocks the forward computes; ``save_layer``
queues them per layer, each entry with a ``readiness.Mark`` that is ready once the device has
written the layer (in ``step`` mode, ``per_layer`` False, one mark recorded by ``end_step`` for
the whole forward). An entry is posted as one WRITE per layer (each carrying a ``W`` notice) once
its mark is ready and D's ``REG`` and the link's layout are known; until then it waits in the
queue, and every later hook (``save_layer``, ``end_step``, ``pump``, REG, a settled link) polls
it without blocking. A step whose layers were not all saved (a CUDA graph replay runs no hook)
queues the missing ones behind the ``end_step`` mark, so every layer of every step is written.
Once the final step has ended, REG is known and the queue is empty, ``DONE`` tells D how many
WRITEs to count. A send is reported finished once vLLM has finished its request, nothing of it is
queued, no WRITE from its blocks is still in flight and D has acknowledged it (``ACK``: D saw
every ``W`` and the ``DONE``); vLLM frees the blocks then. The wait for ``ACK`` is what keeps P
stepping until D has everything: NIXL sends a notice (a WRITE's ``W``, ``DONE``) only while its
sender progresses, i.e. calls into NIXL, and P's engine stops calling once it reports the send;
a notice still queued then would reach D only with P's next request. A send still without
``ACK`` ``write_timeout_s`` after its last WRITE completed fails (``ack_timeout``).

P gives up with ``FAIL`` to D on its request's abort or error, on the registration timeout and
on a WRITE error or timeout; after D's ``ABORT`` it just stops writing. For ``memory_s`` it
remembers tids it holds no send for: an early REG (used when the send starts), an ABORT (the send
starts failed), and a tid it gave up on (a REG arriving later is answered ``FAIL`` at once).

A request's send is one ``_Send`` per D worker it writes (``tp_map``): one, the D worker at
this worker's place, where P and D run the same TP size; with unequal sizes each D worker the
map names, each with its own REG, WRITEs of its run of heads (``part``) and DONE. The request
is reported finished once all of them are settled and drained; a worker the map gives nothing
to write (MLA with P's TP larger: another P worker holds the same latent) reports it finished
once vLLM has.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from connector.address import NixlAddress
from connector.context import WorkerContext
from connector.metadata import Kind, SendSpec, encode
from connector.peers import Link, LinkState
from connector.readiness import Mark
from connector.tp_map import TpMapError, byte_part

__all__ = ["Sender"]

# Under "vllm." so the lines land in the engine log with vLLM's format and level.
log = logging.getLogger(f"vllm.{__name__}")


@dataclass(slots=True)
class _Queued:
    """One layer's blocks of one step, not posted yet."""

    layer: int
    first: int  # logical index of ids[0]
    ids: list[int]
    mark: Mark | None  # ready once the device wrote them; None: the step's end mark, to come


@dataclass(slots=True)
class _Send:
    req_id: str
    tid: str
    link: str
    started: float
    part: tuple[int, int, int] | None = None  # bytes of each block written (tp_map.byte_part)
    peer_tp: int = 0  # the D engine's TP size the map assumed; 0: the same as ours
    queued: list[_Queued] = field(default_factory=list)
    step: tuple[int, list[int]] | None = None  # this step's (first logical block, local ids)
    saved: set[int] = field(default_factory=set)  # layers of this step seen by save_layer
    step_final: bool = False
    num_tokens: int = 0
    reg: tuple[int, list[int]] | None = None  # D's (start block, block ids)
    handles: list[tuple[object, float]] = field(default_factory=list)  # (WRITE, posted at)
    writes: int = 0
    final_at: float | None = None
    done_sent: bool = False
    failed: bool = False
    first_post: float | None = None
    last_done: float | None = None
    done_at: float | None = None  # when DONE was queued
    acked: bool = False  # D acknowledged the whole send (ACK)
    nudged_at: float | None = None  # when DONE was last sent again (Sender._nudge)


class Sender:
    """All P-side transfers of one rank, keyed by request id and by tid; their only owner.

    ``per_layer`` (settable until the first send) tells the caller which marks to pass: one per
    layer to ``save_layer``, so each layer's WRITE is posted once its mark is ready, overlapping
    the rest of the forward; or none there, so the step's layers are posted together once the
    mark given to ``end_step`` is (still one step, i.e. one prefill chunk, ahead of the next).
    Nothing is ever posted before its mark is ready, nor after the send failed.
    """

    def __init__(self, ctx: WorkerContext, per_layer: bool = True) -> None:
        self._ctx = ctx
        self.per_layer = per_layer
        self._sends: dict[tuple[str, str], _Send] = {}  # (req id, D agent) -> send
        self._by_tid: dict[tuple[str, str], _Send] = {}  # (tid, D agent) -> send
        self._reqs: dict[str, list[_Send]] = {}  # req id -> its sends, one per D worker
        self._nothing: set[str] = set()  # req ids this worker has nothing to write for
        self._early_regs: dict[tuple[str, str], tuple[dict[str, Any], float]] = {}
        self._aborted_tids: dict[tuple[str, str], float] = {}  # D aborted before P started
        self._failed_tids: dict[str, float] = {}  # given up on, answered at once
        self._finished_reqs: set[str] = set()  # finished by vLLM, not yet reported

    @property
    def busy(self) -> bool:
        """True while any send holds blocks (not yet reported finished)."""
        return bool(self._reqs or self._nothing)

    @property
    def stepping(self) -> bool:
        """True if this step's forward computes blocks of a live send (marks are worth
        recording)."""
        return any(s.step is not None and not s.failed for s in self._sends.values())

    def knows(self, tid: str) -> bool:
        """True once P holds a send or an early REG for ``tid``."""
        return any(t == tid for t, _ in self._by_tid) or any(t == tid for t, _ in self._early_regs)

    # -- the scheduler's plan -------------------------------------------------------------------

    def plan(self, spec: SendSpec) -> None:
        """Take this step's blocks of a send, starting the send on its first spec."""
        sends = self._reqs.get(spec.req_id)
        if sends is None:
            if spec.req_id in self._nothing:
                return
            sends = self._start(spec)
        elif spec.first_block == 0:
            # Resumed after preemption: queued layers may name blocks vLLM has since freed and
            # reused. Everything is planned again from block 0.
            for send in sends:
                send.queued.clear()
        for send in sends:
            send.step = (spec.first_block, spec.block_ids)
            send.step_final = spec.final
            send.num_tokens = spec.num_tokens

    def prefill_failed(self, req_id: str, tid: str, peer: NixlAddress) -> None:
        """P's request was aborted or failed: FAIL to D, even if no send was ever planned."""
        sends = self._reqs.get(req_id)
        if sends:
            for send in sends:
                self._fail(send, "prefill_abort", "prefill request aborted or failed")
            return
        if req_id in self._nothing:
            return
        self._ctx.stats.failure("prefill_abort")
        self._failed_tids[tid] = self._ctx.clock()
        try:
            names = [name for name, _, _ in self._targets(peer)]
        except TpMapError:
            names = []  # D's own map refuses the same sizes and ends its receive
        for name in names:  # never scheduled here: notify D all the same
            self._ctx.notice(
                name, encode(Kind.FAIL, tid, reason="prefill request aborted or failed")
            )

    # -- the forward ----------------------------------------------------------------------------

    def awaiting_reg(self) -> bool:
        """True if a live send still lacks D's REG (worth reading notifications mid-forward):
        one computed in this forward, or one whose prompt is done and waits for D."""
        return any(s.reg is None and not s.failed for s in self._sends.values())

    def save_layer(self, layer: int, mark: Mark | None) -> None:
        """``layer``'s kernels are launched; its KV exists once ``mark`` is ready (None: once
        ``end_step``'s mark is; the caller passes None in step mode). Queues this step's blocks
        of the layer, then posts whatever queued is ready."""
        for send in self._stepping():
            assert send.step is not None
            send.saved.add(layer)
            if send.step[1]:
                send.queued.append(_Queued(layer, *send.step, mark))
        self.pump()

    def end_step(self, mark: Mark | None) -> None:
        """The forward is launched (vLLM's ``wait_for_save``); ``mark``, recorded after it, is
        ready once the device finished it (None only if no send is ``stepping``).

        Closes this step's plan: entries waiting for the step's mark get it, and the layers no
        ``save_layer`` named (a CUDA graph replay runs no Python hook) are queued behind it, so
        DONE never counts short. Then posts what is ready; DONE where the prompt is complete.
        """
        now = self._ctx.clock()
        layers = len(self._ctx.layout.layers) if self._ctx.layout is not None else 0
        for send in self._sends.values():
            if send.step is not None and not send.failed:
                assert mark is not None, "a stepping send needs the step's mark"
                _close_step(send, send.step, mark, layers)
            if send.step_final and send.final_at is None:
                send.final_at = now
            send.step, send.step_final = None, False
            send.saved.clear()
        for send in list(self._sends.values()):
            if send.queued:
                self._flush(send)
            self._maybe_done(send)

    def pump(self) -> None:
        """Post the queued layers whose marks are ready (never waiting), DONE where now due.
        Called by every hook after the one that queued them."""
        for send in list(self._sends.values()):
            if send.queued:
                self._flush(send)
                self._maybe_done(send)

    # -- messages and links ---------------------------------------------------------------------

    def on_reg(self, peer: str, tid: str, body: dict[str, Any]) -> None:
        """D's REG from agent ``peer``: its blocks for ``tid``; kept if the send has not started."""
        send = self._by_tid.get((tid, peer))
        if send is None and tid in self._failed_tids:
            self._ctx.notice(peer, encode(Kind.FAIL, tid, reason="prefill already failed"))
            return
        if send is None:
            self._early_regs[(tid, peer)] = (body, self._ctx.clock())
            return
        send.reg = (int(body["start"]), [int(b) for b in body["blocks"]])
        self._flush(send)
        self._maybe_done(send)

    def on_ack(self, peer: str, tid: str) -> None:
        """D worker ``peer`` has every WRITE of ``tid`` and its DONE: the send may end."""
        send = self._by_tid.get((tid, peer))
        if send is not None:
            send.acked = True

    def on_abort(self, peer: str, tid: str) -> None:
        """D worker ``peer``'s ABORT: stop writing ``tid`` there (or start it failed, if it has
        not started)."""
        send = self._by_tid.get((tid, peer))
        if send is None:
            self._aborted_tids[(tid, peer)] = self._ctx.clock()
            self._early_regs.pop((tid, peer), None)
        else:
            self._fail(send, "decode_abort", "D aborted the transfer", notify=False)

    def on_peer_restarted(self, peer: str) -> None:
        """D worker ``peer`` restarted: sends that hold its old incarnation's REG end (those
        blocks are gone; writing them would land in the new one's memory), as does every REG
        or ABORT remembered from it; sends still waiting for a REG wait for the new one's."""
        for send in self._sends.values():
            if send.link == peer and send.reg is not None:
                self._fail(send, "peer_fail", f"D worker {peer} restarted", notify=False)
        for key in [k for k in self._early_regs if k[1] == peer]:
            del self._early_regs[key]
        for key in [k for k in self._aborted_tids if k[1] == peer]:
            del self._aborted_tids[key]

    def on_link_settled(self, link: Link) -> None:
        """Post what waited for ``link``; fail its sends if it will never be READY."""
        for send in list(self._sends.values()):
            if send.link != link.name:
                continue
            if link.state is LinkState.READY:
                self._flush(send)
                self._maybe_done(send)
            else:
                self._fail(send, link.failure_kind, link.reason, notify=False)

    # -- once per step --------------------------------------------------------------------------

    def note_finished(self, req_ids: set[str]) -> None:
        """vLLM finished these requests; only ours are kept (all ids would grow without bound)."""
        self._finished_reqs |= req_ids & (self._reqs.keys() | self._nothing)

    def check_writes(self) -> None:
        """Check in-flight WRITEs: a completed one releases its W notice to D when checked
        (NIXL sends the notice of a WRITE that did not complete within its post from the
        poster's check, never by itself). Called from every hook, layer hooks included."""
        for send in self._sends.values():
            if send.handles:
                self._check_handles(send, self._ctx.clock())

    def collect(self) -> set[str]:
        """Request ids whose send is settled, drained and finished by vLLM; forgets them."""
        done: set[str] = set()
        now = self._ctx.clock()
        for send in list(self._sends.values()):
            self._check_handles(send, now)
            self._check_reg_timeout(send, now)
            self._check_ack_timeout(send, now)
            self._nudge(send, now)
        for req_id, sends in list(self._reqs.items()):
            # DONE waits for an empty queue and a failure empties it: settled, nothing is queued.
            drained = all((s.failed or (s.done_sent and s.acked)) and not s.handles for s in sends)
            if req_id in self._finished_reqs and drained:
                done.add(req_id)
                for send in sends:
                    self._drop(send)
                del self._reqs[req_id]
                self._finished_reqs.discard(req_id)
        for req_id in self._nothing & self._finished_reqs:
            done.add(req_id)
            self._nothing.discard(req_id)
            self._finished_reqs.discard(req_id)
        return done

    def expire_memory(self) -> None:
        """Forget tids older than ``memory_s``; an unclaimed REG gets a FAIL so D stops waiting."""
        cutoff = self._ctx.clock() - self._ctx.t.memory_s
        for tid, peer in [k for k, (_, at) in self._early_regs.items() if at < cutoff]:
            del self._early_regs[(tid, peer)]
            self._ctx.notice(peer, encode(Kind.FAIL, tid, reason="no prefill request for this tid"))
        for key in [k for k, at in self._aborted_tids.items() if at < cutoff]:
            del self._aborted_tids[key]
        for tid in [t for t, at in self._failed_tids.items() if at < cutoff]:
            del self._failed_tids[tid]

    def shutdown(self) -> None:
        """Fail every send, so each D frees its blocks now."""
        for send in list(self._sends.values()):
            self._fail(send, "prefill_abort", "P worker shutting down")

    # -- internals ------------------------------------------------------------------------------

    def _start(self, spec: SendSpec) -> list[_Send]:
        """One send per D worker this worker writes (none: the request is only reported)."""
        try:
            targets = self._targets(spec.peer)
        except TpMapError as exc:
            log.error("pd-connector: send %s (tid %s): %s", spec.req_id, spec.tid, exc)
            self._ctx.stats.failure("refused")
            targets = []
        if not targets:
            self._nothing.add(spec.req_id)
            return []
        now = self._ctx.clock()
        sends = [
            _Send(spec.req_id, spec.tid, name, now, part, spec.peer.tp_size)
            for name, part, _ in targets
        ]
        self._reqs[spec.req_id] = sends
        for send in sends:
            self._sends[(send.req_id, send.link)] = send
            self._by_tid[(send.tid, send.link)] = send
            if self._aborted_tids.pop((send.tid, send.link), None) is not None:
                self._fail(send, "decode_abort", "D aborted before P started", notify=False)
            early = self._early_regs.pop((send.tid, send.link), None)
            if early is not None:
                self.on_reg(send.link, send.tid, early[0])
        return sends

    def _targets(self, peer: NixlAddress) -> list[tuple[str, tuple[int, int, int] | None, int]]:
        """(D agent, bytes of each block, D rank) for each D worker this worker writes:
        the one at our place where D's TP size is ours (``peer.tp_size`` 0: unnamed, ours);
        else those ``tp_map`` names. Raises ``TpMapError`` when the sizes do not map."""
        tp = self._ctx.tp
        if peer.tp_size in (0, tp.size):
            return [(self._ctx.peers.ensure(peer).name, None, tp.rank)]
        layout = self._ctx.layout
        block = layout.block_bytes if layout is not None else 0
        # MLA: the latent is written whole, one "head" the size of the block.
        head_bytes = block if tp.mla else layout.head_bytes if layout is not None else 0
        if not head_bytes:
            raise TpMapError(
                "this engine's KV cache layout has no head axis outermost in a block, so it"
                " cannot write the head slices unequal tensor-parallel sizes need"
                " (VLLM_KV_CACHE_LAYOUT=LBHNC or BLHNC)"
            )
        out: list[tuple[str, tuple[int, int, int] | None, int]] = []
        for s in tp.targets(peer.tp_size):
            d_block = head_bytes * (1 if tp.mla else tp.total_heads // peer.tp_size)
            link = self._ctx.peers.ensure(peer, s.d_rank, peer.tp_size)
            out.append((link.name, byte_part(s, head_bytes, block, d_block), s.d_rank))
        return out

    def _stepping(self) -> list[_Send]:
        return [s for s in self._sends.values() if s.step is not None and not s.failed]

    def _flush(self, send: _Send) -> None:
        """Post every queued layer whose mark is ready, if D's blocks and layout are known."""
        if send.failed:
            send.queued.clear()
            return
        link = self._ctx.peers.get(send.link)
        if send.reg is None or link is None or link.state is not LinkState.READY:
            return
        if link.layout is None:
            self._fail(send, "refused", f"peer {link.name} sent no KV layout")
            return
        expected = send.peer_tp or self._ctx.tp.size
        if link.peer_tp and link.peer_tp != expected:
            self._fail(
                send,
                "refused",
                f"{link.name} runs tensor-parallel size {link.peer_tp}, the request named"
                f" {expected}: set tp_size for both engines in the router's config",
            )
            return
        ready: list[_Queued] = []
        waiting: list[_Queued] = []
        for entry in send.queued:
            # Polled in queue order; a mark's ready() never blocks.
            (ready if entry.mark is not None and entry.mark.ready() else waiting).append(entry)
        if not ready:
            return
        send.queued = waiting
        for layer, (src, dst) in sorted(_pair_blocks(ready, *send.reg).items()):
            if send.failed:  # a failed post gave up on the send: nothing more is written
                return
            if src:
                self._post(send, link, layer, src, dst)

    def _post(self, send: _Send, link: Link, layer: int, src: list[int], dst: list[int]) -> None:
        assert link.layout is not None
        writer = self._ctx.writer  # descriptor lists prepared once: only indices per WRITE
        try:
            notif = encode(Kind.W, send.tid)
            handle = writer.write(link.name, link.layout, layer, src, dst, notif, send.part)
        except Exception as exc:
            self._fail(send, "write_error", f"posting WRITE failed: {exc}")
            return
        now = self._ctx.clock()
        send.first_post = send.first_post or now
        send.handles.append((handle, now))
        send.writes += 1
        self._ctx.stats.wrote(writer.bytes_of(len(src), send.part[2] if send.part else None))

    def _maybe_done(self, send: _Send) -> None:
        """DONE once the prompt is complete, D's blocks are known and every WRITE is posted."""
        if send.failed or send.done_sent or send.final_at is None or send.reg is None:
            return
        if send.queued:
            return
        send.done_sent = True
        send.done_at = self._ctx.clock()
        log.debug(
            "pd-connector: DONE %s after %d writes, %.1f ms after the plan",
            send.tid,
            send.writes,
            1000 * (self._ctx.clock() - send.started),
        )
        self._ctx.notice(send.link, _done(send))

    def _fail(self, send: _Send, kind: str, reason: str, notify: bool = True) -> None:
        """Give up on ``send`` once; ``kind`` is its ``stats.FAILURE_KINDS`` entry."""
        if send.failed:
            return
        send.failed = True
        send.queued.clear()
        self._ctx.stats.failure(kind)
        log.warning("pd-connector: send %s (tid %s) failed: %s", send.req_id, send.tid, reason)
        if notify:  # also after DONE: D still waits for the W of the failed WRITE
            self._ctx.notice(send.link, encode(Kind.FAIL, send.tid, reason=reason))

    def _check_handles(self, send: _Send, now: float) -> None:
        pending: list[tuple[object, float]] = []
        for handle, posted in send.handles:
            state = self._ctx.xfer_state(handle)
            if state == "PROC" and now - posted <= self._ctx.t.write_s:
                pending.append((handle, posted))
                continue
            self._ctx.release(handle)
            if state == "PROC":
                self._fail(send, "write_timeout", "WRITE did not complete in time")
            elif state == "ERR":
                self._fail(send, "write_error", "WRITE failed")
            else:
                send.last_done = now
        send.handles = pending
        if send.done_sent and not pending and send.first_post is not None and not send.failed:
            done = send.last_done or now
            final = send.final_at if send.final_at is not None else done  # set before DONE
            self._ctx.stats.sent(send.writes, done - send.first_post, max(0.0, done - final))
            send.first_post = None  # count once

    def _check_reg_timeout(self, send: _Send, now: float) -> None:
        if send.failed or send.reg is not None or send.final_at is None:
            return
        if now - send.final_at > self._ctx.t.reg_s:
            self._fail(send, "reg_timeout", f"no registration from D in {self._ctx.t.reg_s}s")

    def _check_ack_timeout(self, send: _Send, now: float) -> None:
        if send.failed or send.acked or not send.done_sent or send.handles:
            return
        since = max(send.done_at or now, send.last_done or 0.0)
        if now - since > self._ctx.t.write_s:
            self._fail(send, "ack_timeout", f"D acknowledged nothing in {self._ctx.t.write_s}s")

    def _nudge(self, send: _Send, now: float) -> None:
        """DONE again to a D that has not acknowledged it within ``nudge_s``, WRITEs still in
        flight or not: NIXL over TCP can hold what P sent last (a WRITE's bytes, a ``W``, the
        DONE) until the connection carries more, and D answers a DONE for a receive it already
        completed with its ACK again (which in turn carries out an ACK held on the way back).
        A repeated DONE changes nothing on D."""
        every = self._ctx.t.nudge_s
        if every <= 0 or send.failed or send.acked or not send.done_sent:
            return
        if now - (send.nudged_at or send.done_at or now) < every:
            return
        send.nudged_at = now
        self._ctx.stats.repeated()
        log.debug("pd-connector: DONE %s again to %s", send.tid, send.link)
        self._ctx.notice(send.link, _done(send))

    def _drop(self, send: _Send) -> None:
        if send.failed:
            self._failed_tids[send.tid] = self._ctx.clock()
        self._sends.pop((send.req_id, send.link), None)
        self._by_tid.pop((send.tid, send.link), None)


def _done(send: _Send) -> bytes:
    return encode(Kind.DONE, send.tid, writes=send.writes, tokens=send.num_tokens)


def _close_step(send: _Send, step: tuple[int, list[int]], mark: Mark, layers: int) -> None:
    """Put ``send``'s step behind the step's end ``mark``: its unmarked entries and the layers
    that were never saved this step."""
    first, ids = step
    if ids:
        missing = [layer for layer in range(layers) if layer not in send.saved]
        send.queued.extend(_Queued(layer, first, ids, None) for layer in missing)
    for entry in send.queued:
        if entry.mark is None:
            entry.mark = mark


def _pair_blocks(
    queued: list[_Queued], start: int, remote: list[int]
) -> dict[int, tuple[list[int], list[int]]]:
    """Per layer, (local ids, D's ids) for the queued blocks D registered.

    D's ``remote[j]`` is logical block ``start + j``; blocks before ``start`` are cached on D
    already and are not written.
    """
    by_layer: dict[int, tuple[list[int], list[int]]] = {}
    for entry in queued:
        layer, first, ids = entry.layer, entry.first, entry.ids
        src, dst = by_layer.setdefault(layer, ([], []))
        for i, local_id in enumerate(ids):
            j = first + i - start
            if 0 <= j < len(remote):
                src.append(local_id)
                dst.append(remote[j])
    return by_layer
