"""How a migratable leg's stream is cut, and what watches for it (router/pd/migration.py).

:class:`Cut` says why (a ``MigrationCause``: disconnect, error_event, stall, ejected), the
error the client gets if the answer is not continued, and the fault D is judged by;
:class:`StallWatch` closes a stream waited on too long or whose engine was ejected;
:class:`SseEvents` splits a stream read in pieces into whole SSE events.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from router.errors import Fault, MigrationCause, UpstreamError, UpstreamTimeout
from router.pd.decode_leg import DecodeLeg

__all__ = ["Cut", "SseEvents", "StallWatch", "cut", "ended_early"]


@dataclass(slots=True)
class Cut:
    """Why and how a leg's stream was cut: the error the client gets if it is not continued,
    and the fault D is judged by."""

    cause: MigrationCause
    error: UpstreamError
    fault: Fault
    event: bytes | None = None  # D's own error event, relayed as is if not continued


def ended_early(leg: DecodeLeg, watch: StallWatch, count: int, worst: float) -> Cut:
    """D's stream ended before ``[DONE]``: closed by D, by the stall watch, or by the
    router because D was ejected (which says nothing more about D)."""
    inst = leg.instance
    if watch.ejected:
        leg.read_ended(count, worst, Fault.BLAMELESS)
        message = f"{inst.role} engine left rotation ({inst.why_out()}) mid-stream"
        role = str(inst.role)
        code = f"{role}_ejected"
        error = UpstreamError(message, role=role, engine=inst.key, code=code, fault=Fault.BLAMELESS)
        return Cut(MigrationCause.EJECTED, error, Fault.BLAMELESS)
    leg.read_ended(count, worst, Fault.ENGINE)
    if not watch.fired:
        return cut(MigrationCause.DISCONNECT, leg, Fault.ENGINE)
    error = UpstreamTimeout(
        f"{inst.role} engine sent nothing for {watch.seconds:g}s mid-stream",
        role=str(inst.role),
        engine=inst.key,
        code="decode_stalled",
    )
    return Cut(MigrationCause.STALL, error, Fault.ENGINE)


def cut(cause: MigrationCause, leg: DecodeLeg, fault: Fault, event: bytes | None = None) -> Cut:
    """The cut of ``leg`` by its engine (``DISCONNECT`` or ``ERROR_EVENT``)."""
    inst = leg.instance
    if cause is MigrationCause.ERROR_EVENT:
        message = f"{inst.role} engine sent an error event"
    else:
        message = f"{inst.role} engine closed its stream before the end"
    error = UpstreamError(message, role=str(inst.role), engine=inst.key, fault=fault)
    return Cut(cause, error, fault, event)


class SseEvents:
    """SSE events from a stream read in pieces (each without its ``\\n\\n``)."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = b""  # the start of an event not yet whole

    def feed(self, data: bytes) -> list[bytes]:
        *events, self.held = (self.held + data).split(b"\n\n")
        return [e for e in events if e]


class StallWatch:
    """Closes a leg's stream (its pending read then ends) once it has been waited on for
    ``seconds`` without a byte; ``fired`` says it did. The reader sets ``since`` when it starts
    waiting for D and None once a read returns (a slow client's time is not D's). One timer
    per stream, re-armed only when it fires."""

    __slots__ = ("_handle", "_leg", "_loop", "ejected", "fired", "seconds", "since")

    def __init__(self, leg: DecodeLeg, seconds: float, loop: asyncio.AbstractEventLoop) -> None:
        self._leg, self._loop, self.seconds = leg, loop, seconds
        self.since: float | None = None
        self.fired = False
        self.ejected = False  # closed because D was ejected (Instance.leaving)
        self._handle = loop.call_later(seconds, self._check)

    def eject(self) -> None:
        if not (self.fired or self.ejected):
            self.ejected = True
            self._leg.stream.close()

    def _check(self) -> None:
        now, since = self._loop.time(), self.since
        if since is not None and now - since >= self.seconds:
            self.fired = True
            self._leg.stream.close()
            return
        self._handle = self._loop.call_at(
            (now if since is None else since) + self.seconds, self._check
        )

    def cancel(self) -> None:
        self._handle.cancel()
