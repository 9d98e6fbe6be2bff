"""One opened decode stream (:class:`DecodeLeg`) and P's result (:class:`PrefillResult`).

The leg owns D's body from its first bytes on: the rest is read through :meth:`forward`,
which detects the answer's end and judges it (its ``verdict``); :meth:`close` closes the
upstream connection (how vLLM learns to abort). ``router/pd/legs.py`` opens it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from router.asgi_types import BodyWriter
from router.engines.instance import Instance
from router.errors import Fault, UpstreamError
from router.pd.scrub import StreamScrub
from router.pd.sse import ENGINE_ERROR_EVENT, ends_answer
from router.pd.usage import MARKER, Patch
from router.upstream import UpstreamStream

__all__ = ["DecodeLeg", "PrefillResult", "Send", "Sink"]


@dataclass(slots=True)
class PrefillResult:
    kv_params: dict[str, Any] | None
    finished_at: float
    # P's prefix-cache hits from its usage (None: P reported no prompt_tokens_details).
    cached_tokens: int | None = None
    # The prompt's token ids, where P was asked for them (``return_token_ids``): a streamed
    # turn's kept KV (router/pd/kept_turns.py).
    prompt_ids: list[int] | None = None


Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]  # the client's ASGI send
# Where a leg's bytes go, chunk by chunk: the relay's (which makes them the client's ASGI
# messages), a merge's queue. It returns the awaitable of its send, not a coroutine of its
# own: a call per chunk, no frame resumed per chunk beyond the send's.
Sink = Callable[[bytes], Awaitable[None]]


class DecodeLeg:
    """D's response, open: status and first bytes in hand, the rest still to read.

    The leg owns D's connection and its body: :meth:`forward` reads the rest, maps
    its errors and detects its end; :meth:`close` closes the connection (vLLM
    aborts the request there). ``verdict`` is what the end says about D, for outlier
    detection: ``Fault.BLAMELESS`` (nothing known against D) until the end is read, then
    None (a clean end), ``Fault.ANSWER`` (D's own error event after its 200) or the fault of the
    error that broke the stream. ``rest`` is None when ``first`` is the whole body
    (non-streaming responses, whose verdict is None at once).

    :meth:`forward` hands the rest of a streamed body to a :data:`Sink` chunk by chunk as read
    (bytes, never the client's ASGI messages: the relay makes those), and leaves its last
    bytes in ``tail`` once D's end is read: they hold D's terminal ``[DONE]`` event, where a
    client stops reading (not D's HTTP end, which may come in a read of its own), and ``head``,
    bytes not yet sent that come first (D's first bytes, when they already end the answer:
    :func:`ends_answer`). Whatever the reader records at the end goes in before it sends
    ``tail``. ``patch`` rewrites the chunks that hold usage's ``cached_tokens``
    (router/pd/usage.py). It raises :class:`UpstreamError` if D's stream breaks before
    ``[DONE]`` (``verdict`` then holds its fault).

    A streamed leg's bytes, ``first`` included, are D's with every ``kv_transfer_params``
    value null (router/pd/scrub.py): no engine coordinates reach the client. A whole body is
    scrubbed where it is handed to the client (:meth:`Dispatch.first_bytes`), after a kept
    turn has read D's params from it.
    """

    __slots__ = (
        "_clock",
        "_closed",
        "_counted",
        "_last_at",
        "_prev",
        "_scrub",
        "chunks",
        "ended_at",
        "first",
        "first_at",
        "instance",
        "on_params",
        "rest",
        "spliced",
        "stream",
        "tail",
        "verdict",
        "worst_gap",
    )

    def __init__(
        self,
        instance: Instance,
        stream: UpstreamStream,
        first: bytes,
        rest: AsyncIterator[bytes] | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.instance = instance
        self.stream = stream
        self._scrub = StreamScrub() if rest is not None else None
        self.first = first if self._scrub is None else self._scrub.feed(first)
        self.rest = rest
        self.verdict: Fault | None = Fault.BLAMELESS if rest is not None else None
        self.chunks = 1  # chunks read from D, the first included
        self.spliced = 0  # of which written to the client as they came (forward's splice)
        self.worst_gap = 0.0  # longest wait between two chunks, seconds
        # When the first bytes and the last read came (clock seconds; ended_at: None until
        # forward has read to the end): the stream's step time (router/engines/timings.py).
        self.first_at = clock()
        self.ended_at: float | None = None
        self._clock = clock
        self._last_at = self.first_at  # forward's: when the last chunk came
        self._prev = first  # forward's: the last bytes sent (where [DONE] may begin)
        self._closed = False
        self.tail = b""  # the last bytes for the client, once forward has read D's end
        # Called, once a stream ended cleanly, with the last params D put on it (the JSON
        # bytes the client got as null): a 0.33+ stream's kept turn (router/pd/kept_turns.py).
        self.on_params: Callable[[bytes], None] | None = None
        # A streaming leg whose first bytes are in is surely running at the engine
        # until its end is read; a complete (non-streaming) body is not.
        self._counted = rest is not None  # in instance.at_engine (router/engines/load.py)
        if self._counted:
            instance.stream_started()

    async def forward(
        self,
        more: Sink,
        patch: Patch | None = None,
        head: bytes = b"",
        writer: BodyWriter | None = None,
    ) -> None:
        """The rest of D's body to ``more`` as read, its last bytes left in ``tail``. With a
        ``writer`` (the client's response), token events are spliced while the client reads
        (:meth:`_spliced`): written as they arrive, with no read of the stream between."""
        assert self.rest is not None and self._scrub is not None, "a complete body has no rest"
        scrub, clock, stream = self._scrub.feed, self._clock, self.stream
        # D's [DONE] is held until D's end is read.
        held, last, error_event = head, b"", ENGINE_ERROR_EVENT in self.first
        self._prev, self._last_at = self.first, clock()
        splice = None if writer is None or held else self._spliced(writer, patch)
        if splice is not None and not stream.splice(splice):
            splice = None  # this stream cannot
        try:
            async for chunk in self.rest:
                self.chunks += 1
                error_event = error_event or chunk.find(ENGINE_ERROR_EVENT) >= 0
                t = clock()
                if t - self._last_at > self.worst_gap:  # not max(): a call per chunk
                    self.worst_gap = t - self._last_at
                self._last_at = t
                chunk = scrub(chunk)
                if patch is not None and MARKER in chunk:
                    chunk = await patch(chunk)
                if stream.ended:  # D's last bytes came with its end: one write
                    last = held + chunk + self._scrub.flush()
                    break
                if not chunk:  # held back by the scrub until a later read
                    continue
                # A token's event ends with "}": one test per token, no call.
                if held or (chunk.endswith(b"]\n\n") and ends_answer(self._prev, chunk)):
                    held += chunk
                    continue
                self._prev = chunk
                await more(chunk)
                if splice is not None:
                    stream.splice(splice)  # again: a chunk it refused ended it
            else:
                last = held + self._scrub.flush()
        except UpstreamError as exc:
            if not held:
                self.verdict = exc.fault
                raise
            last = held + self._scrub.flush()  # the answer was whole: only D's HTTP end broke
        finally:
            if splice is not None:
                stream.splice(None)
            self.ended_at = self._last_at
            self._mark_ended()
        self._read_to_end(last, error_event)

    def _spliced(self, writer: BodyWriter, patch: Patch | None) -> Callable[[bytes], bool]:
        """What takes D's chunks as they arrive (router/http1.py's splice) while the client
        reads: a read ending with a token's event (``}``: not the answer's end) with no error
        event and no usage to patch, whose bytes the scrub holds none of, is written to the
        client at once, as :meth:`forward` would have sent it; any other is refused (read)."""
        clock, scrub = self._clock, self._scrub
        assert scrub is not None

        def spliced(chunk: bytes) -> bool:
            if (
                not chunk.endswith(b"}\n\n")
                or chunk.find(ENGINE_ERROR_EVENT) >= 0
                or (patch is not None and chunk.find(MARKER) >= 0)
            ):
                return False
            # A chunk refused here is fed again by the reader: the scrub records the same.
            out = scrub.feed_whole(chunk)
            if out is None or not writer.offer(out):
                return False
            t = clock()
            if t - self._last_at > self.worst_gap:
                self.worst_gap = t - self._last_at
            self._last_at, self._prev = t, chunk
            self.chunks += 1
            self.spliced += 1
            return True

        return spliced

    def _read_to_end(self, last: bytes, error_event: bool) -> None:
        assert self._scrub is not None
        self.verdict = Fault.ANSWER if error_event else None
        params = self._scrub.last_value
        if self.on_params is not None and params is not None and self.verdict is None:
            self.on_params(params)
        self.tail = last

    def scrubbed(self, chunk: bytes) -> bytes:
        """A chunk of the rest, read by another reader than :meth:`forward` (a migrating
        relay, router/pd/migration.py), as the client may see it (router/pd/scrub.py)."""
        assert self._scrub is not None, "a complete body has no rest"
        return self._scrub.feed(chunk)

    def whole_scrubber(self) -> Callable[[bytes], bytes | None]:
        """What gives :meth:`scrubbed` of a read ending with a whole event while the scrub
        holds no bytes back, and None (nothing done) while it does (router/pd/scrub.py's
        ``feed_whole``, itself: a spliced token's frame fewer)."""
        assert self._scrub is not None, "a complete body has no rest"
        return self._scrub.feed_whole

    def read_ended(self, chunks: int, worst_gap: float, verdict: Fault | None) -> None:
        """That other reader is done with the stream: what :meth:`forward` records when it
        is, ``verdict`` included (a cut stream's fault, None for a clean end)."""
        self.chunks, self.worst_gap, self.ended_at = chunks, worst_gap, self._clock()
        self.verdict = verdict
        self._mark_ended()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def error_event(self) -> bool:
        """D ended its 200 stream with its own error event."""
        return self.verdict is Fault.ANSWER

    def _mark_ended(self) -> None:
        if self._counted:
            self._counted = False
            self.instance.stream_ended()

    async def close(self) -> None:
        """Close D's connection (vLLM aborts the request there); idempotent."""
        self._mark_ended()
        if self._closed:
            return
        self._closed = True
        self.stream.close()

    @property
    def status(self) -> int:
        return self.stream.status

    @property
    def content_type(self) -> str:
        content_type: str = self.stream.content_type
        return content_type
