"""The access log (router/access_log.py) as an observer: one line per request, when it ends
at the relay or is refused at the intake. Subscribed only when the log is on."""

from __future__ import annotations

from router.access_log import AccessLog, AccessRecord
from router.errors import Outcome
from router.lifecycle import Observer
from router.request_end import RequestEnd

__all__ = ["AccessLines"]

# As nginx logs it: the client left before any answer was sent.
_CLIENT_GONE = 499


class AccessLines(Observer):
    def __init__(self, log: AccessLog) -> None:
        self._log = log

    def refused(self, end: RequestEnd) -> None:
        self._log.write(record(end))

    def request_ended(self, end: RequestEnd) -> None:
        self._log.write(record(end))


def record(end: RequestEnd) -> AccessRecord:
    """The access line of a request's end."""
    gone = end.outcome is Outcome.DISCONNECT
    return AccessRecord(
        method=end.method,
        path=end.path,
        status=end.status or (_CLIENT_GONE if gone else 0),
        model=end.model or "-",
        mode=end.mode or "-",
        outcome=end.outcome.value,
        duration_ms=end.duration * 1000,
        request_id=end.request_id,
        client_id=end.client_id,
        decision=end.decision,
        prefill=end.prefill,
        decode=end.decode,
        ttft_ms=None if end.ttft is None else end.ttft * 1000,
        priority_class=end.priority_class,
        migrations=end.migrations,
    )
