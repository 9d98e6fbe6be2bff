"""How a migrating leg's stream is read (:class:`LegReading`), its ordinary token events
written to the client as they arrive (router/pd/migration.py reads the rest)."""

from __future__ import annotations

from collections.abc import Callable

from router.asgi_types import BodyWriter
from router.pd.cut import SseEvents, StallWatch
from router.pd.decode_leg import DecodeLeg
from router.pd.progress import Progress
from router.pd.usage import MARKER

__all__ = ["LegReading"]


class LegReading:
    """One migrating leg read: its chunks (``count``, D's first bytes included), the longest
    wait for D (``worst``, seconds), when the last chunk came (``last_at``, the loop's
    clock); and :meth:`take`, the sink of the stream's splice (router/http1.py) while the
    client reads (``writer``, None: every chunk is read)."""

    __slots__ = (
        "_events",
        "_patched",
        "_progress",
        "_scrub_whole",
        "_time",
        "_watch",
        "count",
        "last_at",
        "spliced",
        "worst",
        "writer",
    )

    def __init__(
        self,
        leg: DecodeLeg,
        events: SseEvents,
        progress: Progress,
        watch: StallWatch,
        time: Callable[[], float],
        patched: bool,
    ) -> None:
        """``patched``: the answer's usage is patched (router/pd/usage.py): a chunk holding
        it is read."""
        self._events, self._progress = events, progress
        self._scrub_whole = leg.whole_scrubber()
        self._watch, self._time, self._patched = watch, time, patched
        self.writer: BodyWriter | None = None
        self.count, self.worst, self.spliced = 1, 0.0, 0
        self.last_at = time()

    def waiting(self) -> None:
        """The reader waits for D from now (the stall watch's time too)."""
        self.last_at = self._watch.since = self._time()

    def read(self) -> None:
        """The reader has a chunk (or D's end)."""
        self._watch.since = None
        t = self._time()
        self.count += 1
        if t - self.last_at > self.worst:
            self.worst = t - self.last_at
        self.last_at = t

    def take(self, raw: bytes) -> bool:
        """Write ``raw`` to the client now if it is one ordinary token event (as the reader
        would have sent it: scrubbed, ids made null, recorded by :class:`Progress`) and the
        client reads; else False, nothing done (the reader reads it)."""
        writer = self.writer
        if (
            writer is None
            or self._events.held
            or not raw.endswith(b"}\n\n")
            or (self._patched and raw.find(MARKER) >= 0)
            or not writer.ready()
        ):
            return False
        out = self._scrub_whole(raw)
        client = None if out is None else self._progress.relayed(out)
        if client is None:
            return False  # the scrub's work, done again by the reader, is the same
        t = self._time()
        if t - self.last_at > self.worst:
            self.worst = t - self.last_at
        self.last_at = self._watch.since = t
        self.count += 1
        self.spliced += 1
        writer.write(client)
        return True
