"""The access log (router/access_log.py) as an observer: one line per request, when it ends
at the relay or is refused at the intake. Subscribed only when the log is on."""

from __future__ import annotations

from collections.abc import Callable

from router.access_log import AccessLog, AccessRecord
from router.errors import Outcome
from router.lifecycle import Observer
from router.request_end import RequestEnd

__all__ = ["AccessLines"]

# As nginx logs it: the client left before any answer was sent.
_CLIENT_GONE = 499


class AccessLines(Observer):
    """``clock``: the request path's (a request's duration ends when it is announced)."""

    def __init__(self, log: AccessLog, clock: Callable[[], float]) -> None:
        self._log, self._clock = log, clock

    def intake_refused(self, end: RequestEnd) -> None:
        self._log.write(record(end, self._clock() - end.started_at))

    def request_ended(self, end: RequestEnd) -> None:
        self._log.write(record(end, self._clock() - end.started_at))


def record(end: RequestEnd, duration: float) -> AccessRecord:
    """The access line of a request's end that took ``duration`` seconds."""
    gone = end.outcome is Outcome.DISCONNECT
    return AccessRecord(
        method=end.method,
        path=end.path,
        status=end.status or (_CLIENT_GONE if gone else 0),
        model=end.model or "-",
        mode=end.mode or "-",
        outcome=end.outcome.value,
        duration_ms=duration * 1000,
        request_id=end.request_id,
        client_id=end.client_id,
        decision=end.decision,
        prefill=end.prefill,
        decode=end.decode,
        ttft_ms=None if end.ttft is None else end.ttft * 1000,
        priority_class=end.priority_class,
        migrations=end.migrations,
    )
