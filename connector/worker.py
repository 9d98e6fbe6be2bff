"""Worker-side half: one NIXL agent per worker rank; P pushes layer by layer, D receives.

Message flow for one transfer id ``tid`` (both legs dispatched at once by the router)::

    D scheduler allocates blocks -> D worker: REG(tid, start, blocks) -----------------> P worker
    P forward, layer l done (save_kv_layer) -> WRITE l (+ notice W) -------------------> D memory
        (layers saved before REG arrives are queued and written when it does)
    P prompt complete and every WRITE posted -> DONE(tid, writes) --------------------> D worker
    D has seen ``writes`` W notices -> finished_recving -> D scheduler decodes

Failures: P abort/error/timeout -> FAIL(tid) -> D reports the receive finished *and failed*, so
vLLM ends the request with an error and frees its blocks. D abort/timeout -> ABORT(tid) -> P stops
writing and releases its blocks once in-flight WRITEs drain. A peer that never answers is caught
by the handshake, registration, receive and write timeouts.

All methods run on the worker's model-runner thread; nothing here is thread-safe by design.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from connector.layout import CacheLayout, block_runs, write_descs
from connector.metadata import (
    Compat,
    Message,
    PeerAddr,
    RecvSpec,
    SendSpec,
    StepMeta,
    decode,
    encode,
)
from connector.peers import Link, LinkState, PeerTable
from connector.stats import WorkerStats
from connector.transport import NixlAgent

__all__ = ["Timeouts", "WorkerSide"]

# Under "vllm." so the lines land in the engine log with vLLM's format and level.
log = logging.getLogger(f"vllm.{__name__}")


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds; set through ``kv_connector_extra_config`` (see connector.py)."""

    handshake_s: float = 5.0  # metadata exchange + HELLO with a peer rank
    reg_s: float = 30.0  # P: prompt computed, still no REG from D
    recv_s: float = 120.0  # D: blocks registered, transfer not complete
    write_s: float = 30.0  # P: a WRITE still in progress
    memory_s: float = 300.0  # how long an early REG or ABORT for an unknown tid is kept
    idle_wait_s: float = 0.002  # see WorkerSide._idle_wait; 0 turns it off


@dataclass(slots=True)
class _Send:
    req_id: str
    tid: str
    link: str
    started: float
    queued: list[tuple[int, int, list[int]]] = field(default_factory=list)  # layer, first, ids
    step: tuple[int, list[int]] | None = None  # this step's (first logical block, local ids)
    step_final: bool = False
    num_tokens: int = 0
    reg: tuple[int, list[int]] | None = None  # D's (start block, block ids)
    handles: list[tuple[object, float]] = field(default_factory=list)
    writes: int = 0
    final_at: float | None = None
    done_sent: bool = False
    failed: bool = False
    first_post: float | None = None
    last_done: float | None = None


@dataclass(slots=True)
class _Recv:
    spec: RecvSpec
    link: str
    started: float
    reg_sent: bool = False
    writes_seen: int = 0
    expected: int | None = None
    failed: bool = False
    finished: bool = False


class WorkerSide:
    """Worker-role logic for one rank. Owns the NIXL agent it gets from ``agent_factory``."""

    def __init__(
        self,
        agent: NixlAgent,
        *,
        engine_id: str,
        tp_rank: int,
        host: str,
        port: int,
        compat_fields: dict[str, Any],
        timeouts: Timeouts = Timeouts(),
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._agent = agent
        self._sleep = sleep
        self._forward_seen = False
        self._engine_id, self._rank, self._host, self._port = engine_id, tp_rank, host, port
        self._compat_fields = compat_fields
        self._t = timeouts
        self._clock = clock
        self.stats = WorkerStats()
        self._layout: CacheLayout | None = None
        self._layer_idx: dict[str, int] = {}
        self._peers: PeerTable | None = None
        self._sends: dict[str, _Send] = {}
        self._sends_by_tid: dict[str, _Send] = {}
        self._recvs: dict[str, _Recv] = {}
        self._recvs_by_tid: dict[str, _Recv] = {}
        self._early_regs: dict[str, tuple[str, dict[str, Any], float]] = {}
        self._aborted_tids: dict[str, float] = {}
        self._failed_tids: dict[str, float] = {}  # P: tids given up on, answered at once
        self._notices: list[tuple[str, bytes, float]] = []  # (agent, message, give-up time)
        self._finished_reqs: set[str] = set()

    # -- setup ---------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any], num_blocks: int, mem_type: str) -> None:
        """Called once, before any request: register the whole cache and build our HELLO."""
        names = sorted(kv_caches, key=_layer_key)
        self._layer_idx = {name: i for i, name in enumerate(names)}
        layout = CacheLayout.from_tensors([kv_caches[n] for n in names], num_blocks, mem_type)
        self._agent.register(layout.regions(), mem_type)
        self._layout = layout
        compat = Compat(
            num_layers=len(names),
            block_bytes=layout.block_bytes,
            dtype=str(kv_caches[names[0]].dtype),
            **self._compat_fields,
        )
        hello = {
            "compat": _asdict(compat),
            "layout": layout.to_wire(),
            "engine_id": self._engine_id,
            "host": self._host,
            "port": self._port,
        }
        self._peers = PeerTable(
            self._agent, self._rank, hello, compat, self._t.handshake_s, self._clock
        )
        log.info(
            "pd-connector: rank %d registered %d layers x %d blocks (%d B/block) as %s",
            self._rank,
            len(names),
            num_blocks,
            layout.block_bytes,
            self._agent.name,
        )

    @property
    def peers(self) -> PeerTable:
        assert self._peers is not None, "register_kv_caches must run first"
        return self._peers

    # -- per-step hooks ------------------------------------------------------------------------

    def bind(self, step: StepMeta) -> None:
        """Before the forward: apply the scheduler's plan for this step."""
        for recv in step.recvs:
            self._start_recv(recv)
        for send in step.sends:
            self._plan_send(send)
        for req_id, (tid, peer) in step.fail_sends.items():
            self._on_prefill_failed(req_id, tid, peer)
        for req_id, (tid, peer) in step.abort_recvs.items():
            self._on_decode_aborted(req_id, tid, peer)
        self._poll()

    def save_layer(self, layer_name: str) -> None:
        """After each attention layer: queue (and if possible post) that layer's new blocks."""
        self._forward_seen = True
        idx = self._layer_idx.get(layer_name)
        if idx is None:
            return
        stepping = [s for s in self._sends.values() if s.step is not None and not s.failed]
        if not stepping:
            return
        if any(s.reg is None for s in stepping):
            self._drain_notifs()  # D's REG may have arrived during the forward
        for send in stepping:
            assert send.step is not None
            if send.step[1]:
                send.queued.append((idx, send.step[0], send.step[1]))
            self._flush(send)

    def end_step(self) -> None:
        """After the forward (``wait_for_save``): close this step's plan."""
        now = self._clock()
        for send in self._sends.values():
            if send.step_final and send.final_at is None:
                send.final_at = now
            send.step, send.step_final = None, False
            self._maybe_done(send)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """Once per step: (finished sending, finished receiving, failed receiving).

        A send is reported only after vLLM has finished the request (its id was passed here,
        now or before) and no WRITE from its blocks is in flight. Every receive the scheduler
        handed us is reported exactly once, successful or not.
        """
        # Only our sends matter; keeping every finished id would grow without bound.
        self._finished_reqs |= finished_req_ids & self._sends.keys()
        self._poll()
        if not self._forward_seen:
            self._idle_wait()
        self._forward_seen = False
        return self._collect_sends(), *self._collect_recvs()

    def _idle_wait(self) -> None:
        """On a step without a forward, wait up to ``idle_wait_s`` for the peer.

        vLLM steps an engine back to back while a request waits for remote KV (D) or while the
        connector holds blocks for a peer (P); each empty step costs a scheduler pass and a
        worker round trip, so both processes spin a core. On hosts where P and D share cores,
        that spinning starves the other engine's forward. Pausing here returns as soon as a
        notification arrives, so it adds no latency to a transfer that makes progress.
        """
        if self._t.idle_wait_s <= 0 or not (self._recvs or self._sends):
            return
        slices = max(1, int(self._t.idle_wait_s / 0.0001))
        for _ in range(slices):
            self._sleep(0.0001)
            for send in self._sends.values():
                if send.handles:  # completed WRITEs release their notices to D when checked
                    self._check_handles(send, self._clock())
            if self._drain_notifs():
                return

    def shutdown(self) -> None:
        for send in list(self._sends.values()):
            self._fail_send(send, "prefill_abort", "P worker shutting down")
        for recv in list(self._recvs.values()):
            self._fail_recv(recv, "decode_abort", "D worker shutting down", notify=True)
        self._flush_notices()
        self._agent.close()

    # -- P side --------------------------------------------------------------------------------

    def _plan_send(self, spec: SendSpec) -> None:
        send = self._sends.get(spec.req_id)
        if send is None:
            link = self.peers.ensure(spec.peer)
            send = _Send(spec.req_id, spec.tid, link.name, self._clock())
            self._sends[spec.req_id] = send
            self._sends_by_tid[spec.tid] = send
            self._adopt_early(send)
        elif spec.first_block == 0:
            # Resumed after preemption: queued layers may name blocks vLLM has since freed and
            # reused. Everything is planned again from block 0.
            send.queued.clear()
        send.step = (spec.first_block, spec.block_ids)
        send.step_final = spec.final
        send.num_tokens = spec.num_tokens

    def _adopt_early(self, send: _Send) -> None:
        if self._aborted_tids.pop(send.tid, None) is not None:
            self._fail_send(send, "decode_abort", "D aborted before P started", notify=False)
        early = self._early_regs.pop(send.tid, None)
        if early is not None:
            self._on_reg(early[0], send.tid, early[1])

    def _on_reg(self, sender: str, tid: str, body: dict[str, Any]) -> None:
        send = self._sends_by_tid.get(tid)
        if send is None and tid in self._failed_tids:
            self._notice(sender, encode("FAIL", tid, reason="prefill already failed"))
            return
        if send is None:
            self._early_regs[tid] = (sender, body, self._clock())
            return
        send.link = sender
        send.reg = (int(body["start"]), [int(b) for b in body["blocks"]])
        self._flush(send)
        self._maybe_done(send)

    def _flush(self, send: _Send) -> None:
        """Post every queued layer write, if D's blocks and layout are known."""
        if send.failed:
            send.queued.clear()
            return
        link = self.peers.get(send.link)
        if send.reg is None or link is None or link.state is not LinkState.READY:
            return
        if link.layout is None:
            self._fail_send(send, "refused", f"peer {link.name} sent no KV layout")
            return
        by_layer: dict[int, tuple[list[int], list[int]]] = {}
        start, remote = send.reg
        for layer, first, ids in send.queued:
            src, dst = by_layer.setdefault(layer, ([], []))
            for i, local_id in enumerate(ids):
                j = first + i - start
                if 0 <= j < len(remote):  # blocks before `start` are cached on D already
                    src.append(local_id)
                    dst.append(remote[j])
        send.queued.clear()
        for layer, (src, dst) in sorted(by_layer.items()):
            if src:
                self._post(send, link, layer, src, dst)

    def _post(self, send: _Send, link: Link, layer: int, src: list[int], dst: list[int]) -> None:
        assert self._layout is not None and link.layout is not None
        local, remote = write_descs(self._layout, link.layout, layer, block_runs(src, dst))
        try:
            handle = self._agent.post_write(
                link.name, local, remote, self._layout.mem_type, encode("W", send.tid)
            )
        except Exception as exc:
            self._fail_send(send, "write_error", f"posting WRITE failed: {exc}")
            return
        now = self._clock()
        send.first_post = send.first_post or now
        send.handles.append((handle, now))
        send.writes += 1
        self.stats.wrote(sum(d[1] for d in local))

    def _maybe_done(self, send: _Send) -> None:
        if (
            send.failed
            or send.done_sent
            or send.final_at is None
            or send.reg is None
            or send.queued
        ):
            return
        send.done_sent = True
        log.debug(
            "pd-connector: DONE %s after %d writes, %.1f ms after the plan",
            send.tid,
            send.writes,
            1000 * (self._clock() - send.started),
        )
        self._notice(
            send.link, encode("DONE", send.tid, writes=send.writes, tokens=send.num_tokens)
        )

    def _on_prefill_failed(self, req_id: str, tid: str, peer: PeerAddr) -> None:
        send = self._sends.get(req_id)
        if send is not None:
            self._fail_send(send, "prefill_abort", "prefill request aborted or failed")
            return
        link = self.peers.ensure(peer)  # never scheduled here: notify D all the same
        self.stats.failure("prefill_abort")
        self._failed_tids[tid] = self._clock()
        self._notice(link.name, encode("FAIL", tid, reason="prefill request aborted or failed"))

    def _fail_send(self, send: _Send, kind: str, reason: str, notify: bool = True) -> None:
        if send.failed:
            return
        send.failed = True
        send.queued.clear()
        self.stats.failure(kind)
        log.warning("pd-connector: send %s (tid %s) failed: %s", send.req_id, send.tid, reason)
        if notify:  # also after DONE: D still waits for the W of the failed WRITE
            self._notice(send.link, encode("FAIL", send.tid, reason=reason))

    def _collect_sends(self) -> set[str]:
        done: set[str] = set()
        now = self._clock()
        for send in list(self._sends.values()):
            self._check_handles(send, now)
            self._check_send_timeouts(send, now)
            settled = send.failed or send.done_sent
            if send.req_id in self._finished_reqs and settled and not send.handles:
                done.add(send.req_id)
                self._drop_send(send)
        return done

    def _check_handles(self, send: _Send, now: float) -> None:
        pending: list[tuple[object, float]] = []
        for handle, posted in send.handles:
            state = self._xfer_state(handle)
            if state == "PROC" and now - posted <= self._t.write_s:
                pending.append((handle, posted))
                continue
            self._release(handle)
            if state == "PROC":
                self._fail_send(send, "write_timeout", "WRITE did not complete in time")
            elif state == "ERR":
                self._fail_send(send, "write_error", "WRITE failed")
            else:
                send.last_done = now
        send.handles = pending
        if send.done_sent and not pending and send.first_post is not None and not send.failed:
            self.stats.sent(send.writes, (send.last_done or now) - send.first_post)
            send.first_post = None  # count once

    def _check_send_timeouts(self, send: _Send, now: float) -> None:
        if (
            not send.failed
            and send.reg is None
            and send.final_at is not None
            and now - send.final_at > self._t.reg_s
        ):
            self._fail_send(send, "reg_timeout", f"no registration from D in {self._t.reg_s}s")

    def _drop_send(self, send: _Send) -> None:
        if send.failed:
            self._failed_tids[send.tid] = self._clock()
        self._sends.pop(send.req_id, None)
        self._sends_by_tid.pop(send.tid, None)
        self._finished_reqs.discard(send.req_id)

    # -- D side --------------------------------------------------------------------------------

    def _start_recv(self, spec: RecvSpec) -> None:
        link = self.peers.ensure(spec.peer)
        recv = _Recv(spec, link.name, self._clock())
        self._recvs[spec.req_id] = recv
        self._recvs_by_tid[spec.tid] = recv
        self._try_register(recv)

    def _try_register(self, recv: _Recv) -> None:
        link = self.peers.get(recv.link)
        if recv.reg_sent or recv.finished or link is None:
            return
        if link.state is LinkState.READY:
            spec = recv.spec
            self._notice(
                link.name, encode("REG", spec.tid, start=spec.start_block, blocks=spec.block_ids)
            )
            recv.reg_sent = True
            log.debug(
                "pd-connector: REG %s sent %.1f ms after the receive began",
                spec.tid,
                1000 * (self._clock() - recv.started),
            )
        elif link.settled:
            kind = "refused" if link.state is LinkState.REFUSED else "handshake"
            self._fail_recv(recv, kind, link.reason, notify=False)

    def _on_write_notice(self, tid: str) -> None:
        recv = self._recvs_by_tid.get(tid)
        if recv is not None:
            recv.writes_seen += 1
            self._maybe_complete(recv)

    def _on_done(self, tid: str, body: dict[str, Any]) -> None:
        recv = self._recvs_by_tid.get(tid)
        if recv is not None:
            recv.expected = int(body.get("writes", 0))
            self._maybe_complete(recv)

    def _maybe_complete(self, recv: _Recv) -> None:
        if recv.finished or recv.expected is None or recv.writes_seen < recv.expected:
            return
        recv.finished = True
        log.debug(
            "pd-connector: receive %s complete after %.1f ms (%d writes)",
            recv.spec.tid,
            1000 * (self._clock() - recv.started),
            recv.writes_seen,
        )
        if self._layout is not None:
            nblocks = len(recv.spec.block_ids)
            segs = len(self._layout.layers[0].segments) if self._layout.layers else 0
            self.stats.received(
                nblocks * self._layout.block_bytes * segs * len(self._layout.layers)
            )

    def _fail_recv(self, recv: _Recv, kind: str, reason: str, notify: bool) -> None:
        if recv.finished:
            return
        recv.finished = recv.failed = True
        self.stats.failure(kind)
        log.warning(
            "pd-connector: receive %s (tid %s) failed: %s", recv.spec.req_id, recv.spec.tid, reason
        )
        if notify:
            self._notice(recv.link, encode("ABORT", recv.spec.tid, reason=reason))

    def _on_decode_aborted(self, req_id: str, tid: str, peer: PeerAddr) -> None:
        recv = self._recvs.get(req_id)
        if recv is None:
            self._notice(self.peers.ensure(peer).name, encode("ABORT", tid, reason="aborted"))
            return
        if not recv.finished:
            self._fail_recv(recv, "decode_abort", "decode request aborted", notify=True)
        recv.failed = False  # an abort is not a load failure: vLLM has already ended it

    def _collect_recvs(self) -> tuple[set[str], set[str]]:
        finished: set[str] = set()
        failed: set[str] = set()
        now = self._clock()
        for recv in list(self._recvs.values()):
            if not recv.finished and now - recv.started > self._t.recv_s:
                self._fail_recv(
                    recv, "recv_timeout", f"no KV from P in {self._t.recv_s}s", notify=True
                )
            if recv.finished:
                finished.add(recv.spec.req_id)
                if recv.failed:
                    failed.add(recv.spec.req_id)
                self._recvs.pop(recv.spec.req_id, None)
                self._recvs_by_tid.pop(recv.spec.tid, None)
        return finished, failed

    # -- messages and links --------------------------------------------------------------------

    def _poll(self) -> None:
        for link in self.peers.poll():
            self._on_link_settled(link)
        self._drain_notifs()
        self._flush_notices()
        self._expire_memory()

    def _drain_notifs(self) -> bool:
        """Handle new notifications; True if there were any."""
        try:
            notifs = self._agent.get_notifs()
        except Exception as exc:
            log.warning("pd-connector: reading notifications failed: %s", exc)
            return False
        for sender, raws in notifs.items():
            for raw in raws:
                msg = decode(raw)
                if msg is not None:
                    self._dispatch(sender, msg)
        return bool(notifs)

    def _dispatch(self, sender: str, msg: Message) -> None:
        if msg.kind in ("HELLO", "REFUSE", "VERSION"):
            link = self.peers.on_message(sender, msg)
            if link is not None:
                self._on_link_settled(link)
        elif msg.kind == "W":
            self._on_write_notice(msg.tid)
        elif msg.kind == "REG":
            self._on_reg(sender, msg.tid, msg.body)
        elif msg.kind == "DONE":
            self._on_done(msg.tid, msg.body)
        elif msg.kind == "FAIL":
            self._on_peer_fail(msg.tid, str(msg.body.get("reason", "")))
        elif msg.kind == "ABORT":
            self._on_peer_abort(msg.tid)

    def _on_peer_fail(self, tid: str, reason: str) -> None:
        recv = self._recvs_by_tid.get(tid)
        if recv is not None:
            self._fail_recv(recv, "peer_fail", f"P failed the transfer: {reason}", notify=False)

    def _on_peer_abort(self, tid: str) -> None:
        send = self._sends_by_tid.get(tid)
        if send is None:
            self._aborted_tids[tid] = self._clock()
            self._early_regs.pop(tid, None)
        else:
            self._fail_send(send, "decode_abort", "D aborted the transfer", notify=False)

    def _on_link_settled(self, link: Link) -> None:
        if link.state is LinkState.READY:
            self.stats.handshake(link.handshake_s)
        for recv in list(self._recvs.values()):
            if recv.link == link.name:
                self._try_register(recv)
        for send in list(self._sends.values()):
            if send.link != link.name:
                continue
            if link.state is LinkState.READY:
                self._flush(send)
                self._maybe_done(send)
            else:
                kind = "refused" if link.state is LinkState.REFUSED else "handshake"
                self._fail_send(send, kind, link.reason, notify=False)

    def _notice(self, agent: str, raw: bytes) -> None:
        """Send now if the peer is reachable, else keep trying until the handshake timeout."""
        if self.peers.can_notify(agent) and self._send_notif(agent, raw):
            return
        self._notices.append((agent, raw, self._clock() + self._t.handshake_s))

    def _flush_notices(self) -> None:
        keep: list[tuple[str, bytes, float]] = []
        now = self._clock()
        for agent, raw, give_up in self._notices:
            if self.peers.can_notify(agent) and self._send_notif(agent, raw):
                continue
            if now < give_up:
                keep.append((agent, raw, give_up))
            else:
                log.warning("pd-connector: dropped notice to unreachable %s", agent)
        self._notices = keep

    def _send_notif(self, agent: str, raw: bytes) -> bool:
        try:
            self._agent.send_notif(agent, raw)
            return True
        except Exception as exc:
            log.warning("pd-connector: notification to %s failed: %s", agent, exc)
            return False

    def _expire_memory(self) -> None:
        cutoff = self._clock() - self._t.memory_s
        for tid in [t for t, (_, _, at) in self._early_regs.items() if at < cutoff]:
            sender = self._early_regs.pop(tid)[0]
            self._notice(sender, encode("FAIL", tid, reason="no prefill request for this tid"))
        for memory in (self._aborted_tids, self._failed_tids):
            for tid in [t for t, at in memory.items() if at < cutoff]:
                del memory[tid]

    def _xfer_state(self, handle: object) -> str:
        try:
            return self._agent.xfer_state(handle)
        except Exception:
            return "ERR"

    def _release(self, handle: object) -> None:
        try:
            self._agent.release(handle)
        except Exception as exc:  # releasing a stuck WRITE may fail; nothing else to do
            log.debug("pd-connector: release failed: %s", exc)


def _layer_key(name: str) -> tuple[int, str]:
    """Order layers by their first number (``model.layers.12.self_attn.attn`` -> 12)."""
    m = re.search(r"\d+", name)
    return (int(m.group()) if m else -1, name)


def _asdict(compat: Compat) -> dict[str, Any]:
    return dataclasses.asdict(compat)
