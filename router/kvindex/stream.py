"""One engine's KV event stream: a ZMQ SUB socket on its publisher, and its replay endpoint.

Contract of :class:`Stream`: :meth:`Stream.run` applies the engine's batches to its
:class:`~router.kvindex.engine.EngineIndex` in sequence order, each exactly once, and sets
``index.known`` only while the index holds the engine's whole history (every batch from the
engine's sequence number 0, or from its last ``AllBlocksCleared``). It never returns on its
own (cancel it to stop) and never raises: a failure is counted and retried.

How the stream is kept whole (``router/kvindex/wire.py`` for the frames):

* **Start.** The SUB socket connects first, then the replay endpoint is asked for everything
  from sequence 0. An empty answer means the engine has published nothing: its cache is empty
  and the index is known. An answer that starts at 0 is the whole history. An answer that
  starts later (the engine's replay buffer, ``buffer_steps``, no longer holds the start) leaves
  the index unknown, with what it could apply.
* **A gap** (a sequence number beyond the next expected: a ZMQ reconnect, a slow joiner, a
  full high-water mark): the replay endpoint is asked from the last applied sequence number.
  The answer's first batch must be the one last applied, byte for byte; the rest fills the gap.
* **A restart** (a sequence number already applied, with other content; or a replay whose first
  batch is not the one last applied): the engine began again with an empty cache; the index is
  cleared and rebuilt from the engine's sequence 0.
* **Verification.** Every ``verify_interval`` without a message the same replay check runs, so
  a restart whose messages were all missed is still found.
* A gap or a restart no replay can fill (no replay endpoint, the buffer overran, the endpoint
  does not answer within ``replay_timeout``) clears the index and leaves it unknown; later
  batches are still applied, and an ``AllBlocksCleared``, a batch 0 or a full replay (tried
  at each verification until one shows the buffer no longer starts at 0) makes it known
  again.

vLLM's replay endpoint is a ROUTER socket that answers one request with many messages, which
a REQ socket cannot receive: the request goes out on a DEALER socket, with the empty delimiter
frame a REQ socket would add.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass

import zmq
import zmq.asyncio

from router.kvindex.engine import EngineIndex
from router.kvindex.wire import END_SEQ, EventError, decode_batch, decode_seq, encode_seq

__all__ = ["Source", "Stream"]

log = logging.getLogger("pd_router.kv_events")

_RECENT = 1024  # digests of the last batches applied: duplicates from a replay are skipped
_QUEUED = 10_000  # batches the SUB socket may hold before the router reads them
_ERROR_PAUSE_S = 1.0


@dataclass(frozen=True, slots=True)
class Source:
    """Where one engine publishes and how the router follows it."""

    endpoint: str  # the publisher, e.g. tcp://10.0.0.7:5557
    replay: str | None  # its replay endpoint; None: none (gaps cannot be filled)
    topic: str = ""
    max_blocks: int = 262_144
    verify_interval: float = 10.0
    replay_timeout: float = 2.0


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=8).digest()


class Stream:
    """Follows one engine (see module doc); the only writer of its ``index``."""

    def __init__(
        self, url: str, source: Source, index: EngineIndex, ctx: zmq.asyncio.Context
    ) -> None:
        self.url = url
        self.source = source
        self.index = index
        self._ctx = ctx
        self._next = 0  # the sequence number expected next
        self._recent: OrderedDict[int, bytes] = OrderedDict()
        self._history_gone = False  # a full replay did not reach back to sequence 0

    @property
    def next_seq(self) -> int:
        """The engine's sequence number this stream expects next (all below are applied)."""
        return self._next

    async def run(self) -> None:
        """Follow the engine until cancelled."""
        while True:
            try:
                await self._follow()
            except (zmq.ZMQError, OSError) as exc:
                log.warning("event=kv_events_error engine=%s error=%r", self.url, str(exc))
                await asyncio.sleep(_ERROR_PAUSE_S)

    async def _follow(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            # Bounded: past this many queued batches ZMQ drops, and the gap costs a replay.
            sub.setsockopt(zmq.RCVHWM, _QUEUED)
            sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
            sub.connect(self.source.endpoint)
            await self._catch_up(gap=False)
            timeout_ms = int(self.source.verify_interval * 1000)
            while True:
                if await sub.poll(timeout_ms):
                    await self._on_message(await sub.recv_multipart())
                else:
                    await self._catch_up(gap=False)
        finally:
            sub.close(linger=0)

    async def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.index.stats.decode_errors += 1
            return
        try:
            seq = decode_seq(frames[1])
        except EventError:
            self.index.stats.decode_errors += 1
            return
        payload = frames[2]
        if seq < self._next and self._recent.get(seq) != _digest(payload):
            self._restarted()
        if seq > self._next:
            self.index.stats.gaps += 1
            await self._catch_up(gap=True)
        if seq == self._next:
            self._apply(seq, payload)
        elif seq > self._next:  # no replay could fill the gap
            self._lost(seq)
            self._apply(seq, payload)

    async def _catch_up(self, gap: bool) -> None:
        """Verify the stream and fill what is missing from the replay endpoint (module doc)."""
        if self.source.replay is None:
            return
        if self._next > 0:
            last = self._next - 1
            items = await self._replay(last)
            if items is None:
                return
            if items and items[0][0] == last and _digest(items[0][1]) == self._recent.get(last):
                for seq, payload in items[1:]:
                    self._apply(seq, payload)
                if gap:
                    self.index.stats.gaps_filled += 1
                if self.index.known or self._history_gone:
                    return
                self._start_over()  # unknown: the engine's buffer may still hold it all
            else:
                self._restarted()
        elif not gap and (self.index.known or self._history_gone):
            return  # nothing published yet and known empty; or the start is gone for good
        await self._full_replay()

    async def _full_replay(self) -> None:
        items = await self._replay(0)
        if items is None:
            return
        if not items:
            self.index.known = True  # the engine has published nothing: its cache is empty
            return
        first = items[0][0]
        if first != 0:
            self._history_gone = True
            self._lost(first)
        for seq, payload in items:
            if seq == self._next:
                self._apply(seq, payload)

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every buffered batch from ``start`` on, in order; None if the endpoint did not
        answer (each message within ``replay_timeout``)."""
        assert self.source.replay is not None
        self.index.stats.replays += 1
        sock = self._ctx.socket(zmq.DEALER)
        items: list[tuple[int, bytes]] = []
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.source.replay)
            await sock.send_multipart([b"", encode_seq(start)])
            wait_ms = int(self.source.replay_timeout * 1000)
            while await sock.poll(wait_ms):
                frames = await sock.recv_multipart()
                if len(frames) != 4 or frames[0]:
                    self.index.stats.decode_errors += 1
                    continue
                seq = decode_seq(frames[2])
                if seq == END_SEQ:
                    return items
                items.append((seq, frames[3]))
        except EventError:
            self.index.stats.decode_errors += 1
        finally:
            sock.close(linger=0)
        log.warning("event=kv_replay_failed engine=%s start=%d", self.url, start)
        return None

    def _apply(self, seq: int, payload: bytes) -> None:
        index = self.index
        try:
            batch = decode_batch(payload)
        except EventError as exc:
            index.stats.decode_errors += 1
            log.warning(
                "event=kv_events_undecodable engine=%s seq=%d error=%r", self.url, seq, str(exc)
            )
            index.clear()
            index.known = False
        else:
            if seq == 0:  # the engine's first batch: everything from its start is here
                index.clear()
                index.known = True
            index.apply(batch)
        self._next = seq + 1
        self._recent[seq] = _digest(payload)
        while len(self._recent) > _RECENT:
            self._recent.popitem(last=False)

    def _restarted(self) -> None:
        """The engine began again: its cache is empty, its sequence numbers start at 0."""
        log.warning("event=kv_events_restart engine=%s", self.url)
        self.index.stats.restarts += 1
        self._start_over()
        self._history_gone = False

    def _start_over(self) -> None:
        """Forget everything applied: the next batch wanted is the engine's first."""
        self.index.clear()
        self.index.known = False
        self._next = 0
        self._recent.clear()

    def _lost(self, resume_at: int) -> None:
        """Batches before ``resume_at`` cannot be had: the index is no longer whole."""
        log.warning(
            "event=kv_events_gap_unfilled engine=%s missing_from=%d missing_to=%d",
            self.url,
            self._next,
            resume_at - 1,
        )
        self.index.stats.gaps_unfilled += 1
        self.index.clear()
        self.index.known = False
        self._next = resume_at
