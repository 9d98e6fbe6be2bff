"""Router errors: each a class that knows its status, body and outcome; rendered once.

::

    RouterError                  status  type / code                              outcome
    ├── InternalError            500     internal_error                           internal_error
    ├── HttpError                4xx     invalid_request_error / not_found, 405   client_error
    ├── InvalidRequest           400     BadRequestError / 400 (as vLLM)          client_error
    │   ├── InvalidBody          400     Bad Request / 400, param body[.<field>]  client_error
    │   ├── BodyTooLarge         413     BadRequestError / 413                    client_error
    │   └── BoundExceeded        400     BadRequestError / 400 (vLLM's message)   client_error
    ├── Unauthorized             401     authentication_error / invalid_api_key   client_error
    ├── RequestTimeout           408     invalid_request_error / request_timeout  client_error
    ├── ModelNotFound            404     NotFoundError / 404, param model (vLLM)  client_error
    ├── RateLimited              429     rate_limit_error / rate_limit_exceeded,  rate_limited
    │                                    concurrency_limit_exceeded (1)
    ├── QueueFull                429     rate_limit_error / queue_full (1)        no_capacity
    │   └── FairShareExceeded    429     rate_limit_error / queue_share_exceeded  rate_limited
    ├── NoCapacity               503     service_unavailable / no_capacity (1)    no_capacity
    │   ├── NoHealthyEngine      503     service_unavailable / no_healthy_<role>  no_capacity
    │   │                                (or no_compatible_pair)
    │   └── ShuttingDown         503     service_unavailable / shutting_down      shutdown
    ├── TotalTimeout             504     timeout / total_timeout                  timeout
    └── UpstreamError            502     upstream_error / <kind>                  upstream_error
        ├── AdapterLoadFailed    502     upstream_error / adapter_load_failed     upstream_error
        ├── UpstreamTimeout      504     timeout / <role>_timeout                 timeout
        └── UpstreamStatus       4xx     the engine's status and body as is       client_error
                                 503     a paused engine's, as is (load)          no_capacity
                                 502     for the engine's other 5xx               upstream_error

    (1) with Retry-After, as are FairShareExceeded, NoHealthyEngine and ShuttingDown.

:func:`render` is the one renderer (status, headers, body) of every error response.
Upstream errors carry the role (``prefill``/``decode``), the engine they came from
(``engine``: its key, ``<url>`` or ``<url>#dp<r>``) and their :class:`Fault` (what they say
about the engine), so the dispatcher can retry elsewhere and feed outlier detection. Their
messages never name the engine: clients see the role, operators find the URL in the log line.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import orjson

__all__ = [
    "AdapterLoadFailed",
    "BodyTooLarge",
    "BoundExceeded",
    "DeadlineExceeded",
    "DeadlineUnattainable",
    "DisconnectPhase",
    "FairShareExceeded",
    "Fault",
    "HttpError",
    "InternalError",
    "InvalidBody",
    "InvalidRequest",
    "KeyResult",
    "MigrationCause",
    "ModelNotFound",
    "NoCapacity",
    "NoHealthyEngine",
    "Outcome",
    "QueueFull",
    "RateLimited",
    "RequestTimeout",
    "RouteChoice",
    "RouterError",
    "ShuttingDown",
    "TotalTimeout",
    "Unauthorized",
    "UpstreamError",
    "UpstreamStatus",
    "UpstreamTimeout",
    "engine_paused",
    "error_body",
    "render",
    "sse_error_event",
]


class Outcome(enum.StrEnum):
    """How a request ended: the ``outcome`` label of ``pdrouter_requests_total``."""

    SUCCESS = "success"
    CLIENT_ERROR = "client_error"
    UPSTREAM_ERROR = "upstream_error"
    TIMEOUT = "timeout"
    NO_CAPACITY = "no_capacity"
    RATE_LIMITED = "rate_limited"  # over its key's limits: the client's doing, not capacity
    DISCONNECT = "client_disconnect"
    SHUTDOWN = "shutdown"  # cut off by the router's own shutdown past its grace period
    INTERNAL_ERROR = "internal_error"  # a bug in the router


class DisconnectPhase(enum.StrEnum):
    """When the client left (a ``DISCONNECT`` outcome): the ``phase`` label of
    ``pdrouter_client_disconnects_total``."""

    BEFORE_FIRST_BYTE = "before_first_byte"
    STREAMING = "streaming"


class MigrationCause(enum.StrEnum):
    """Why a migratable stream was cut (router/pd/cut.py): the ``cause`` label of
    ``pdrouter_migrations_total``."""

    DISCONNECT = "disconnect"  # D's stream broke or ended before [DONE]
    ERROR_EVENT = "error_event"  # D sent an SSE error event
    STALL = "stall"  # nothing from D for migration.stall_timeout
    EJECTED = "ejected"  # D left rotation (breaker open, health checks failed)


class RouteChoice(enum.StrEnum):
    """How the adaptive rule serves a request the mode would split (router/pd/adaptive.py):
    the ``choice`` label of ``pdrouter_route_choice_total``."""

    PD = "pd"
    DECODE_ALONE = "decode_alone"
    PREFILL_ALONE = "prefill_alone"


class KeyResult(enum.StrEnum):
    """What became of a key's request: the ``result`` label of ``pdrouter_key_requests_total``."""

    ADMITTED = "admitted"
    RATE_LIMITED = "rate_limited"
    CONCURRENCY_LIMITED = "concurrency_limited"
    QUEUE_SHARE_EXCEEDED = "queue_share_exceeded"


class Fault(enum.Enum):
    """What a failed engine call says about the engine (see router/engines/breaker.py)."""

    BLAMELESS = "blameless"  # nothing against the engine: a 4xx, 408/429, a paused engine's 503,
    # the client left, a stream not read to its end (a leg's verdict until its end is read)
    REFUSED = "refused"  # no connection could be made: nothing listens there
    ENGINE = "engine"  # the engine failed: timeout, reset, dropped stream, 502/503/504
    ANSWER = "answer"  # the engine answered 5xx to this request (maybe to this one only)


def error_body(message: str, type_: str, code: str | int | None, param: str | None = None) -> bytes:
    """The OpenAI error envelope as JSON bytes."""
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def sse_error_event(message: str, type_: str, code: str | int | None) -> bytes:
    """The end of an already-started SSE stream that failed, as vLLM ends one: the
    error as one event, then ``data: [DONE]``."""
    return b"data: " + error_body(message, type_, code) + b"\n\ndata: [DONE]\n\n"


class RouterError(Exception):
    """Base of every error the router answers with; subclasses set the class fields."""

    status: int = 500
    type: str = "internal_error"
    code: str | int | None = "internal_error"
    outcome: Outcome = Outcome.INTERNAL_ERROR
    retry_after: float | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code)

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"retry-after": str(max(1, math.ceil(self.retry_after)))}


class InternalError(RouterError):
    """A bug in the router: the client sees no detail, the log has the traceback."""

    def __init__(self) -> None:
        super().__init__("internal router error")


class HttpError(RouterError):
    """A request the routes cannot take (unknown path, wrong method)."""

    type = "invalid_request_error"
    outcome = Outcome.CLIENT_ERROR

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = "not_found" if status == 404 else str(status)


class InvalidRequest(RouterError):
    """A body the router itself rejects; typed and coded as vLLM's own 400s, so that a client
    cannot tell whether the router or an engine refused it."""

    status = 400
    type = "BadRequestError"
    code = 400
    outcome = Outcome.CLIENT_ERROR

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


class InvalidBody(InvalidRequest):
    """A body that does not fit the endpoint's request model: not JSON, not an object, a
    field of the wrong type, a required field missing. vLLM 0.32 refuses these in FastAPI's
    request validation, before its own code runs, and answers them differently from its
    other 400s: ``"type": "Bad Request"`` and ``param`` the field's path under ``body``
    (``body``, ``body.max_tokens``, ``body.1`` for JSON broken at offset 1)."""

    type = "Bad Request"


class BodyTooLarge(InvalidRequest):
    status = 413
    code = 413


class BoundExceeded(InvalidRequest):
    """Over a bound checked before any work (``bound``: ``context``, ``max_tokens``,
    ``n``, ``prompts``), answered as vLLM answers it."""

    def __init__(self, bound: str, message: str, param: str | None = None) -> None:
        super().__init__(message, param)
        self.bound = bound


class Unauthorized(RouterError):
    """No usable key; ``reason`` (``missing``, ``scheme``, ``invalid``) is for the metric,
    never a hint of which keys exist."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"
    outcome = Outcome.CLIENT_ERROR

    def __init__(self, reason: str) -> None:
        super().__init__("missing or invalid API key (send Authorization: Bearer <key>)")
        self.reason = reason

    def headers(self) -> dict[str, str]:
        return {"www-authenticate": "Bearer"}


class RequestTimeout(RouterError):
    """The client did not send its request (body) in time; the connection is closed."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
    outcome = Outcome.CLIENT_ERROR

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request body did not arrive within {seconds:g}s")

    def headers(self) -> dict[str, str]:
        return {"connection": "close"}


class RateLimited(RouterError):
    """Over its API key's request rate or concurrency (``code`` says which)."""

    status = 429
    type = "rate_limit_error"
    outcome = Outcome.RATE_LIMITED

    def __init__(self, message: str, code: str, retry_after: float) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after


class ModelNotFound(RouterError):
    """An unknown model, answered in vLLM's words: its message, type, param and code."""

    status = 404
    type = "NotFoundError"
    code = 404
    outcome = Outcome.CLIENT_ERROR

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.")

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, "model")


class QueueFull(RouterError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"
    outcome = Outcome.NO_CAPACITY

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class FairShareExceeded(QueueFull):
    """The admission queue is full and this key holds more of it than any other: its
    newest waiter makes room for a key with fewer (longest queue drop)."""

    code = "queue_share_exceeded"
    outcome = Outcome.RATE_LIMITED


class DeadlineUnattainable(QueueFull):
    """The request's predicted TTFT (its wait for a decode slot, from its place in the
    queue and how long slots are held, plus the prompt's learned compute time) exceeds its
    deadline: refused at once, before any slot, prefill or decode is spent on it. A 429:
    the router is busier now than the deadline allows; ``Retry-After`` says when the
    queue ahead of it will have drained."""

    code = "deadline_unattainable"

    def __init__(
        self, model: str, deadline_ms: float, predicted_ms: float, ahead: int, retry_after: float
    ) -> None:
        super().__init__(
            f"the request's predicted time to first token of {predicted_ms:.0f} ms "
            f"({ahead} waiting before it for a decode slot for model {model!r}) exceeds its "
            f"TTFT deadline of {deadline_ms:g} ms",
            retry_after,
        )
        self.deadline_ms = deadline_ms
        self.predicted_ms = predicted_ms


class NoCapacity(RouterError):
    status = 503
    type = "service_unavailable"
    code = "no_capacity"
    outcome = Outcome.NO_CAPACITY

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DeadlineExceeded(NoCapacity):
    """The request's TTFT deadline passed while it waited for a decode slot: refused before
    any slot, prefill or decode is spent on it."""

    code = "deadline_exceeded"

    def __init__(self, model: str, deadline_ms: float, retry_after: float) -> None:
        super().__init__(
            f"the request's TTFT deadline of {deadline_ms:g} ms passed while it waited for "
            f"a decode slot for model {model!r}",
            retry_after,
        )
        self.deadline_ms = deadline_ms


class NoHealthyEngine(NoCapacity):
    """No instance of a role is in rotation: refused at once, never queued."""

    def __init__(
        self, role: str, model: str, retry_after: float, unpaired: str | None = None
    ) -> None:
        """``unpaired``: every engine of ``role`` is out because none of the other role can
        pair with it (router/engines/pairing.py); the reason, for the client and the log."""
        message = f"no healthy {role} engine for model {model!r}"
        if unpaired is not None:
            message = (
                f"no {role} engine for model {model!r} can pair with an engine of the other "
                f"role: {unpaired}"
            )
        super().__init__(message, retry_after)
        self.role = role
        self.code = f"no_healthy_{role}" if unpaired is None else "no_compatible_pair"


class ShuttingDown(NoCapacity):
    code = "shutting_down"
    outcome = Outcome.SHUTDOWN

    def __init__(self) -> None:
        super().__init__("the router is shutting down; retry the request", retry_after=1.0)


class TotalTimeout(RouterError):
    status = 504
    type = "timeout"
    code = "total_timeout"
    outcome = Outcome.TIMEOUT

    def __init__(self, seconds: float) -> None:
        super().__init__(f"request exceeded the router's total timeout of {seconds:g}s")


class UpstreamError(RouterError):
    """An engine could not be reached or broke the protocol."""

    status = 502
    type = "upstream_error"
    outcome = Outcome.UPSTREAM_ERROR

    def __init__(
        self,
        message: str,
        *,
        role: str,
        engine: str,
        code: str = "upstream_error",
        fault: Fault = Fault.ENGINE,
    ):
        super().__init__(message)
        self.role = role
        self.engine = engine
        self.code = code
        self.fault = fault
        self.request_id = "-"  # the router's id of the attempt, set by the dispatcher

    @property
    def retryable(self) -> bool:
        return True


class AdapterLoadFailed(UpstreamError):
    """A LoRA adapter the router was configured to load (``lora.modules``) could not be
    loaded on a chosen engine: its answer's message (the engine's words: a wrong path, runtime
    loading off), or its silence past ``lora.load_timeout``. Retried on another engine only
    where that may help (no answer, or a 5xx); an engine's 4xx would be the same elsewhere."""

    def __init__(self, adapter: str, role: str, engine: str, why: str, retryable: bool) -> None:
        super().__init__(
            f"loading LoRA adapter {adapter!r} on the {role} engine failed: {why}",
            role=role,
            engine=engine,
            code="adapter_load_failed",
            fault=Fault.ANSWER,
        )
        self.adapter = adapter
        self.why = why
        self._retryable = retryable

    def again(self) -> AdapterLoadFailed:
        """The same failure as a new exception, for another request that waited on the same
        load (each request's error carries its own attempt's id)."""
        return AdapterLoadFailed(self.adapter, self.role, self.engine, self.why, self.retryable)

    @property
    def retryable(self) -> bool:
        return self._retryable


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "timeout"
    outcome = Outcome.TIMEOUT


class UpstreamStatus(UpstreamError):
    """The engine answered with an error status; its body is passed through.

    A paused engine's 503 (:func:`engine_paused`: vLLM 0.33+ while paused, asleep or
    checkpointed) is load, as a 429 is: retried on another engine, nothing counted against
    the engine, and where no other engine can take it the client gets the engine's 503 as
    is (``no_capacity``). Every other 5xx is a fault, answered as a 502."""

    def __init__(
        self, status: int, content: bytes, *, role: str, engine: str, paused: bool | None = None
    ) -> None:
        """``paused``: whether the engine is paused (None: judged from ``content``)."""
        super().__init__(
            f"{role} engine returned HTTP {status}", role=role, engine=engine, code=str(status)
        )
        self.upstream_status = status
        self.content = content
        self.paused = status == 503 and (engine_paused(content) if paused is None else paused)
        # A client error (4xx) is the client's to see as is, and so is a paused engine's
        # 503; an engine failure is a 502.
        passed = status < 500 or self.paused
        self.status = status if passed else 502
        self.outcome = (
            Outcome.NO_CAPACITY
            if self.paused
            else Outcome.CLIENT_ERROR
            if status < 500
            else Outcome.UPSTREAM_ERROR
        )
        self.fault = Fault.BLAMELESS if self.paused else _fault_of_status(status)

    @property
    def retryable(self) -> bool:
        return self.upstream_status >= 500 or self.upstream_status in (408, 429)

    def body(self) -> bytes:
        if (self.upstream_status < 500 or self.paused) and _is_openai_error(self.content):
            return self.content
        text = self.content.decode("utf-8", "replace")[:500]
        return error_body(f"{self.message}: {text}", "upstream_error", self.upstream_status)


def render(
    exc: RouterError, request_id: bytes | None = None
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """``exc`` as a whole response: status, headers (``request_id``, the client's
    X-Request-Id, echoed) and the OpenAI error body."""
    headers = [(b"content-type", b"application/json")]
    headers += [(k.encode(), v.encode()) for k, v in exc.headers().items()]
    if request_id:
        headers.append((b"x-request-id", request_id))
    return exc.status, headers, exc.body()


def _fault_of_status(status: int) -> Fault:
    if status < 500:
        return Fault.BLAMELESS  # the request's fault, or load (408/429): retried, not counted
    if status in (502, 503, 504):
        return Fault.ENGINE  # gateway failures, as Envoy counts them
    return Fault.ANSWER


# The error type of vLLM's retryable request errors (``RetryableRequestError``): 0.33+ answers
# every new request so while generation is paused (``/pause``, ``/sleep``, and 0.34's
# ``/checkpoint/prepare`` until ``/checkpoint/restore``). Other 503s of vLLM's (a full queue, a
# faulted engine) are typed ``Service Unavailable``.
PAUSED_ERROR_TYPE = "ServiceUnavailableError"


def engine_paused(content: bytes, *, streamed: bool = False) -> bool:
    """Whether an engine's error body is vLLM's retryable ``ServiceUnavailableError``: the
    engine is paused, not failing (its 503 is load, not a fault). ``streamed``: ``content``
    is the JSON of a stream's error event, where vLLM types the same error
    ``InternalServerError`` with code 503 (no other error of a stream has that code)."""
    try:
        doc: Any = orjson.loads(content)
    except orjson.JSONDecodeError:
        return False
    error = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(error, dict):
        return False
    return error.get("type") == PAUSED_ERROR_TYPE or (streamed and error.get("code") == 503)


def _is_openai_error(content: bytes) -> bool:
    try:
        doc: Any = orjson.loads(content)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get("error"), dict)
