"""What one request's end says: the facts its observers (metrics, tracing, the access log)
read when it is over (:meth:`router.lifecycle.Lifecycle.request_ended`).

Built once per request, by the relay when it takes the request (and filled in as it goes:
the response's status, the first byte's time, the engines of its dispatch) or by the intake
when it refuses one; plain values, so that an observer needs nothing of the request path.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.errors import Outcome

__all__ = ["RequestEnd"]


@dataclass(slots=True)
class RequestEnd:
    """Times in clock seconds (its duration: the clock's reading when it is announced, less
    ``started_at``); ``model``/``mode`` empty for a request refused before its model was
    known (bad JSON, unknown model, no API key); ``-`` where not known (a request refused
    before its dispatch opened has no decision or engines). ``path``, ``mode`` and
    ``decision`` may be their StrEnums."""

    method: str
    path: str
    model: str
    mode: str
    started_at: float
    client_id: str = "-"
    priority_class: str = "-"
    status: int = 0  # of the response head sent, if any
    outcome: Outcome = Outcome.SUCCESS
    ttft: float | None = None
    request_id: str = "-"
    decision: str = "-"
    prefill: str = "-"
    decode: str = "-"
    migrations: int = 0  # continuations on another engine after D failed mid-stream
