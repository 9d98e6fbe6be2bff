"""Request intake: a generate request from its head to the relay that will run it.

The key is identified and charged, the body read within its deadline and bounds, parsed,
its model's pool found and its bounds checked, all before any slot or engine call; a
request refused on the way is counted and logged here (every request is counted once,
here or by the relay). The helpers are shared with the other routes (router/routes.py).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response

from router.carrier import DP_RANK_HEADER
from router.chat_batch import merge_batch, parse_chat_batch
from router.chat_batch import split as split_batch
from router.client_request import (
    ClientRequest,
    Endpoint,
    parse_client_request,
    parse_invocation,
    with_session,
)
from router.context import AppContext
from router.disconnect import CONNECTION, Connection
from router.engines.adapters import requested_adapter
from router.errors import (
    BodyTooLarge,
    BoundExceeded,
    InvalidRequest,
    KeyResult,
    ModelNotFound,
    RateLimited,
    RequestTimeout,
    RouterError,
    Unauthorized,
)
from router.multi_prompt import MultiPrompt
from router.orca import requested_format
from router.pd.continuation import refusal
from router.pd.decision import Decision
from router.pd.migration import Migration
from router.priority import with_priority
from router.registry import ModelPool
from router.relay import Composer, LoadReport, RelayResponse, Scope
from router.request_end import RequestEnd

__all__ = [
    "INVOCATIONS",
    "KEY",
    "PICKED_DECISION",
    "PICKED_PREFILL",
    "charge",
    "check_batch",
    "check_bounds",
    "client_request_id",
    "handle",
    "hold",
    "identify",
    "key_class",
    "pool_for",
    "read_body",
    "with_pick",
]

INVOCATIONS = "/invocations"  # vLLM's SageMaker-style entry: chat or completions by the body
KEY = "pdrouter.key"  # scope key: the name of the request's API key, once identified
_MAX_CLIENT_ID = 128


def identify(ctx: AppContext, scope: Scope) -> str:
    """The name of the request's API key; raises (and counts) :class:`Unauthorized`."""
    try:
        return ctx.auth.identify(scope["headers"])
    except Unauthorized as exc:
        ctx.lifecycle.auth_failed(exc.reason)
        raise


def key_class(ctx: AppContext, key: str) -> str | None:
    """The priority class the API key named ``key`` gives its requests, if any (a scan:
    read only with classes configured, over the few named keys)."""
    if not ctx.config.admission.priority_classes:
        return None
    return next((k.priority_class for k in ctx.config.auth.keys if k.name == key), None)


def charge(ctx: AppContext, key: str) -> None:
    """Count one request against ``key``'s rate (refusals counted by key name)."""
    try:
        ctx.limiter.charge(key)
    except RateLimited:
        ctx.lifecycle.key_result(key, KeyResult.RATE_LIMITED)
        raise


def hold(ctx: AppContext, key: str) -> Callable[[], None]:
    """One request in flight for ``key``; returns what gives it back (idempotent)."""
    try:
        lease = ctx.limiter.acquire(key)
    except RateLimited:
        ctx.lifecycle.key_result(key, KeyResult.CONCURRENCY_LIMITED)
        raise
    ctx.lifecycle.key_result(key, KeyResult.ADMITTED)

    def give_back() -> None:
        if not lease.released:
            lease.release()
            ctx.lifecycle.key_released(key)

    return give_back


async def read_body(ctx: AppContext, request: Request) -> bytes:
    """The whole body within ``connections.body_timeout`` (else 408, the connection
    closed), at most ``admission.max_body_bytes`` (else 413)."""
    limit = ctx.config.admission.max_body_bytes
    conn: Connection | None = request.scope.get(CONNECTION)
    whole = None if conn is None else conn.whole_body(request.receive)
    if whole is not None:  # all of it came with the head: nothing to wait for
        if len(whole) > limit:
            raise BodyTooLarge(f"request body exceeds {limit} bytes")
        return whole
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    deadline = ctx.config.connections.body_timeout
    try:
        async with asyncio.timeout(deadline):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"request body exceeds {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        ctx.clients.timed_out("body", deadline, request.scope.get("client"))
        raise RequestTimeout(deadline) from None
    return b"".join(chunks)


async def check_bounds(ctx: AppContext, pool: ModelPool, creq: ClientRequest) -> ClientRequest:
    try:
        return await ctx.bounds.check(pool, creq)
    except BoundExceeded as exc:
        ctx.lifecycle.bound_exceeded(pool.name, exc.bound)
        raise


async def check_batch(ctx: AppContext, pool: ModelPool, creq: ClientRequest) -> list[ClientRequest]:
    """A batch's conversations, each checked against the bounds (the batch's length against
    ``limits.max_prompts``, the router's own bound: vLLM has none)."""
    most = ctx.config.limits.max_prompts
    if creq.num_prompts > most:
        exc = BoundExceeded(
            "prompts",
            f"batch of {creq.num_prompts} conversations exceeds the maximum allowed count "
            f"of {most}.",
            "messages",
        )
        ctx.lifecycle.bound_exceeded(pool.name, exc.bound)
        raise exc
    return list(await asyncio.gather(*(check_bounds(ctx, pool, p) for p in split_batch(creq))))


def client_request_id(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The client's X-Request-Id, echoed back as vLLM does; only a short token of
    visible ASCII (it goes into log lines and a response header), else None."""
    for name, value in headers:
        if name == b"x-request-id":
            if 0 < len(value) <= _MAX_CLIENT_ID and all(0x21 <= c <= 0x7E for c in value):
                return value
            return None
    return None


async def handle(
    ctx: AppContext, request: Request, endpoint: Endpoint | None, client_id: bytes | None
) -> Response:
    """The relay for one generate request, or the :class:`RouterError` that refuses
    it (counted here: every request is counted once, here or by the relay). ``endpoint``
    None: ``/invocations``, whose body says which endpoint it is (chat, else completions)."""
    started = ctx.clock()
    pool: ModelPool | None = None
    try:
        key = identify(ctx, request.scope)
        charge(ctx, key)  # before the body: a flood is refused for the price of its head
        creq = _parse(await read_body(ctx, request), endpoint, key)
        pool = pool_for(ctx, creq.model)
        _count_adapter(ctx, pool, creq)
        creq = with_session(creq, request.headers.raw, pool.config.sessions)
        creq = with_priority(
            creq,
            request.headers.raw,
            ctx.config.admission,
            pool.config.engine_priority_scheduling,
            started,
            key_class(ctx, key),
        )
        if ctx.sidecar:
            creq = with_pick(creq, request.headers.raw)
        # Before any slot or generate call; a batch's conversations each on its own.
        parts = await check_batch(ctx, pool, creq) if endpoint is Endpoint.CHAT_BATCH else []
        if not parts:
            creq = await check_bounds(ctx, pool, creq)
        done = hold(ctx, key)
    except RouterError as exc:
        ctx.lifecycle.intake_refused(_refused(ctx, request, endpoint, exc, pool, started))
        raise
    composer = _composer(ctx, pool, creq, parts, client_id)
    # The ORCA header reports one D's load: not asked of several prompts' engines.
    report = None if isinstance(composer, MultiPrompt) else _load_report(ctx, request, creq)
    return RelayResponse(ctx.relaying, pool, creq, started, client_id, done, report, composer)


def _parse(raw: bytes, endpoint: Endpoint | None, key: str) -> ClientRequest:
    """The body as its endpoint reads it (``None``: ``/invocations``, chat or completions)."""
    if endpoint is None:
        return parse_invocation(raw, key)
    if endpoint is Endpoint.CHAT_BATCH:
        return parse_chat_batch(raw, key)
    return parse_client_request(raw, endpoint, key)


def _composer(
    ctx: AppContext,
    pool: ModelPool,
    creq: ClientRequest,
    parts: list[ClientRequest],
    client_id: bytes | None,
) -> Composer | None:
    """What answers instead of one dispatch's D: a batch's conversations (one dispatch
    each, in every mode), several prompts in a disaggregated mode (router/multi_prompt.py),
    a stream that may continue elsewhere if D fails mid-stream (router/pd/migration.py)."""
    client = client_id.decode("latin-1") if client_id else "-"
    if parts:
        return MultiPrompt(ctx.dispatcher, pool, parts, client, merge_batch)
    if creq.num_prompts > 1 and pool.mode.uses_prefill:
        return MultiPrompt.of_prompts(ctx.dispatcher, pool, creq, client)
    migration = ctx.config.migration
    if not migration.enabled:
        return None
    if refusal(creq, pool.config.kept_turns.enabled, migration.non_streamed) is not None:
        return None
    return Migration(ctx.dispatcher, pool, creq, client, migration)


# An endpoint picker's choice, as it names it to a ``pd-router sidecar`` (router/picker).
PICKED_DECISION = "x-pd-decision"
PICKED_PREFILL = "x-pd-prefill-endpoint"


def with_pick(creq: ClientRequest, headers: Iterable[tuple[bytes, bytes]]) -> ClientRequest:
    """``creq`` with the endpoint picker's decision, P and D's data-parallel rank
    (``X-data-parallel-rank``, as vLLM reads it), as its headers name them (a sidecar's
    requests come from the gateway, which the picker told); unchanged without them. A
    decision the router does not know, one that needs a P without one named, or a rank that
    is not a whole number: 400."""
    wanted = (b"x-pd-", DP_RANK_HEADER.encode())
    found = {name: value.decode("latin-1") for name, value in headers if name.startswith(wanted)}
    decision = found.get(PICKED_DECISION.encode())
    if decision is None:
        return creq
    prefill = found.get(PICKED_PREFILL.encode()) or None
    try:
        known = Decision(decision)
    except ValueError:
        raise InvalidRequest(f"{PICKED_DECISION}: unknown decision {decision!r}") from None
    if known.uses_prefill and prefill is None:
        raise InvalidRequest(f"{PICKED_DECISION} {decision} needs {PICKED_PREFILL}")
    raw_rank = found.get(DP_RANK_HEADER.encode())
    rank = None
    if raw_rank is not None:
        if not raw_rank.strip().isdigit():
            raise InvalidRequest(f"{DP_RANK_HEADER}: not a data-parallel rank: {raw_rank!r}")
        rank = int(raw_rank)
    return replace(creq, picked_decision=decision, picked_prefill=prefill, picked_rank=rank)


def _load_report(ctx: AppContext, request: Request, creq: ClientRequest) -> LoadReport | None:
    """The ORCA header's reader where vLLM sends one: a non-streamed chat completion or
    completion that asks for it (``endpoint-load-metrics-format``)."""
    if creq.stream or creq.endpoint not in (Endpoint.CHAT, Endpoint.COMPLETIONS):
        return None
    fmt = requested_format(request.headers.raw)
    return None if fmt is None else functools.partial(ctx.load_reports.header, fmt=fmt)


def _refused(
    ctx: AppContext,
    request: Request,
    endpoint: Endpoint | None,
    exc: RouterError,
    pool: ModelPool | None,
    started: float,
) -> RequestEnd:
    """A refused request's end (``model``/``mode`` empty where its model is not known)."""
    client_id = request.headers.get("x-request-id", "-")
    model, mode = (pool.name, pool.mode.value) if pool is not None else ("", "")
    return RequestEnd(
        method=request.method,
        path=INVOCATIONS if endpoint is None else endpoint.value,
        model=model,
        mode=mode,
        started_at=started,
        client_id=client_id if client_request_id(request.headers.raw) else "-",
        status=exc.status,
        outcome=exc.outcome,
    )


def _count_adapter(ctx: AppContext, pool: ModelPool, creq: ClientRequest) -> None:
    """Count a LoRA adapter's request by adapter (a bounded label set)."""
    adapter = requested_adapter(pool.name, creq.body)
    if adapter is not None:
        ctx.lifecycle.adapter_requested(pool.name, adapter, pool.config.lora.max_adapter_labels)


def pool_for(ctx: AppContext, model: str | None) -> ModelPool:
    """The pool serving ``model``: the model of that name, else the one whose engines hold
    a LoRA adapter of that name (``ModelPool.serves_adapter``: a P and a D that hold it,
    or a D alone in aggregated mode); without a model, the only one (as vLLM serves its one
    model to requests that name none). Neither: vLLM's 404 for an unknown model."""
    if model is not None:
        pool = ctx.registry.get(model) or ctx.registry.adapter_pool(model)
        if pool is None:
            raise ModelNotFound(model, sorted(p.name for p in ctx.registry.pools()))
        return pool
    pools = list(ctx.registry.pools())
    if len(pools) != 1:
        names = ", ".join(sorted(p.name for p in pools))
        raise InvalidRequest(f"model: Field required (this router serves {names})", "model")
    return pools[0]
