"""The ``ext_proc`` service (envoy.service.ext_proc.v3): one gRPC stream per HTTP request.

The gateway's filter sends the request's headers and body, the response's headers, body and
trailers (deploy/inference-pool/envoy.yaml, the tests' Envoy): the request body BUFFERED (one
message) or FULL_DUPLEX_STREAMED (chunks, which the picker hands back once it has placed the
request, as Gateway API implementations configure the filter), the response body STREAMED or
FULL_DUPLEX_STREAMED. Per stream (:class:`Exchange`):

- at the request body's end, the request is read as the router's intake reads it (key, rate,
  body, model, session, priority, bounds) and :meth:`~router.pd.dispatch.Dispatcher.pick`
  reserves its decode slot first, then chooses P, among the endpoints of the gateway's subset
  hint if it sends one; the answer names the destination (``x-gateway-destination-endpoint``,
  header and ``envoy.lb`` metadata) and what the sidecar's legs need (``x-pd-decision``,
  ``x-pd-prefill-endpoint``: P's engine key, ``<url>#dp<r>`` for a data-parallel rank); with
  data-parallel engines, ``X-data-parallel-rank`` pins the rank the slot is on (the sidecar
  runs D's leg there; P serving alone is vLLM itself, which honours it); a refusal is an
  immediate response with the router's status, headers and OpenAI error body;
- the slot is given back at the response's end (its body's ``end_of_stream``, or its
  trailers) or when the stream ends any other way (the client reset, the engine failed,
  the gateway gave up): the ``finally`` of :meth:`ExtProc.Process`.

The destination is one endpoint, not a fallback list: the slot is reserved on that D
alone, and another D would be served without one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from router.carrier import DP_RANK_HEADER
from router.chat_batch import parse_chat_batch
from router.client_request import (
    ClientRequest,
    Endpoint,
    parse_client_request,
    parse_invocation,
    with_session,
)
from router.context import AppContext
from router.engines.instance import Instance, candidates
from router.errors import BodyTooLarge, InternalError, InvalidRequest, RouterError
from router.intake import (
    INVOCATIONS,
    PICKED_DECISION,
    PICKED_PREFILL,
    charge,
    check_batch,
    check_bounds,
    hold,
    identify,
    key_class,
    pool_for,
)
from router.pd.dispatch import Pick
from router.picker.destinations import Destinations
from router.priority import with_priority
from router.registry import ModelPool

__all__ = ["DESTINATION", "Exchange", "ExtProc"]

log = logging.getLogger("pd_router.picker")

DESTINATION = "x-gateway-destination-endpoint"  # the extension's header and metadata key
_LB_NAMESPACE = "envoy.lb"  # the extension's dynamic metadata namespace
_SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # the gateway's subset of the pool, if it sends one
_SUBSET = "x-gateway-destination-endpoint-subset"
# What a client may not set: the picker's own answers to the gateway and the sidecar (and the
# data-parallel rank, which pins the engine the picker reserved: vLLM and the sidecar obey it).
_OURS = (DESTINATION, PICKED_DECISION, PICKED_PREFILL, DP_RANK_HEADER)
_ENDPOINTS = {e.value: e for e in Endpoint}
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


class Exchange:
    """One request's stream: what the picker learnt and holds. The one owner of the slot
    it reserves; :meth:`close` gives everything back (idempotent)."""

    def __init__(
        self,
        ctx: AppContext,
        destinations: Destinations,
        on_pick: Callable[[Pick], None] | None = None,
    ) -> None:
        self._ctx = ctx
        self._destinations = destinations
        self._on_pick = on_pick
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._placed = False
        self._subset: frozenset[str] | None = None  # the gateway's endpoints to pick from
        self._duplex = (False, False)  # FULL_DUPLEX_STREAMED: the request's, the response's
        self._held: tuple[ModelPool, Pick] | None = None
        self._done: Callable[[], None] | None = None  # the key's concurrency, given back
        self.destination: str | None = None

    async def answer(self, req: Any) -> list[Any]:
        """The answers to one message of the gateway's: one each in the BUFFERED mode; in
        FULL_DUPLEX_STREAMED, none until the request's body has ended, then the headers'
        and the body's (which this service hands back, as that mode wants)."""
        if req.HasField("protocol_config"):  # the first message says the filter's modes
            cfg = req.protocol_config
            self._duplex = (
                cfg.request_body_mode == _FULL_DUPLEX,
                cfg.response_body_mode == _FULL_DUPLEX,
            )
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            self._headers = _raw_headers(req.request_headers.headers)
            self._subset = _subset(req.metadata_context)
            if req.request_headers.end_of_stream:  # no body: nothing to place by
                return [ep.ProcessingResponse(request_headers=self._without_body())]
            if self._duplex[0]:
                return []  # answered once the body is in
            return [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]
        if kind == "request_body":
            return await self._request_body(req.request_body)
        if kind == "request_trailers":
            placed = [] if self._placed else await self._placed_answers(end_of_stream=False)
            return [*placed, ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_body":
            return [self._response_body(req.response_body)]
        if kind == "response_trailers":
            self.close()
        return [_continue(kind)]

    def close(self) -> None:
        """Give back the slot and the key's concurrency (idempotent)."""
        held, self._held = self._held, None
        if held is not None:
            pool, pick = held
            self._ctx.dispatcher.unpick(pool, pick)
        done, self._done = self._done, None
        if done is not None:
            done()

    async def _request_body(self, body: Any) -> list[Any]:
        limit = self._ctx.config.admission.max_body_bytes
        self._size += len(body.body)
        if self._size > limit:
            self._placed = True
            refused = BodyTooLarge(f"request body exceeds {limit} bytes")
            return [ep.ProcessingResponse(immediate_response=_refusal(refused))]
        self._body.append(body.body)
        if body.end_of_stream:
            return await self._placed_answers(end_of_stream=True)
        if self._duplex[0]:
            return []
        # STREAMED: the gateway has sent the headers upstream already; too late to place.
        self._placed = True
        log.error(
            "event=picker_mode reason=%r",
            "request body mode must be BUFFERED or FULL_DUPLEX_STREAMED",
        )
        return [ep.ProcessingResponse(immediate_response=_refusal(InternalError()))]

    async def _placed_answers(self, end_of_stream: bool) -> list[Any]:
        """Place the request by its whole body; the answers that say where it goes."""
        self._placed = True
        raw = b"".join(self._body)
        self._body = []
        placed = await self._place(raw)
        if not isinstance(placed, ep.CommonResponse):
            return [placed]
        metadata = _lb_metadata(self.destination or "")
        if not self._duplex[0]:
            return [
                ep.ProcessingResponse(
                    request_body=ep.BodyResponse(response=placed), dynamic_metadata=metadata
                )
            ]
        placed.clear_route_cache = True  # the route may read the headers set here
        streamed = ep.StreamedBodyResponse(body=raw, end_of_stream=end_of_stream)
        body = ep.CommonResponse(body_mutation=ep.BodyMutation(streamed_response=streamed))
        return [
            ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(response=placed), dynamic_metadata=metadata
            ),
            ep.ProcessingResponse(request_body=ep.BodyResponse(response=body)),
        ]

    def _response_body(self, body: Any) -> Any:
        """Go on (handing the chunk back in FULL_DUPLEX_STREAMED); at its end, release."""
        if body.end_of_stream:
            self.close()
        if not self._duplex[1]:
            return _continue("response_body")
        streamed = ep.StreamedBodyResponse(body=body.body, end_of_stream=body.end_of_stream)
        common = ep.CommonResponse(body_mutation=ep.BodyMutation(streamed_response=streamed))
        return ep.ProcessingResponse(response_body=ep.BodyResponse(response=common))

    def _without_body(self) -> Any:
        """A request without a body (a GET): to a D's sidecar, which serves the router's
        other routes; no slot held."""
        self._placed = True
        for pool in self._ctx.registry.pools():
            ds = candidates(pool.decode)
            if ds:
                self.destination = self._destinations.of(ds[0])
                return ep.HeadersResponse(response=_routed(self.destination, {}))
        return ep.HeadersResponse(response=_routed(None, {}))

    async def _place(self, raw: bytes) -> Any:
        """The header mutation that routes the request (a ``CommonResponse``), or the
        ``ProcessingResponse`` that refuses it."""
        ctx = self._ctx
        pool: ModelPool | None = None
        try:
            creq = self._read(raw)
            pool = pool_for(ctx, creq.model)
            creq = await self._complete(pool, creq)
            self._done = hold(ctx, creq.api_key_name)
            pick = await ctx.dispatcher.pick(pool, creq, self._reachable())
        except RouterError as exc:
            self.close()
            model, mode = (pool.name, pool.mode.value) if pool is not None else ("", "")
            ctx.metrics.observe_request(model, mode, exc.outcome)
            return ep.ProcessingResponse(immediate_response=_refusal(exc))
        except Exception:
            self.close()
            log.exception("event=picker_failed")
            return ep.ProcessingResponse(immediate_response=_refusal(InternalError()))
        self._held = (pool, pick)
        if self._on_pick is not None:
            self._on_pick(pick)
        engine = pick.decode if pick.decode is not None else pick.prefill
        assert engine is not None  # a pick names D, or P when P serves alone
        self.destination = self._destinations.of(engine)
        legs = {PICKED_DECISION: pick.decision.value}
        if pick.decode is not None and pick.prefill is not None:
            legs[PICKED_PREFILL] = pick.prefill.key  # its URL, and its rank if data-parallel
        if engine.rank is not None:  # D's sidecar (or P alone, vLLM itself) runs that rank
            legs[DP_RANK_HEADER] = str(engine.rank)
        return _routed(self.destination, legs)

    def _reachable(self) -> Callable[[Instance], bool] | None:
        """The engines whose destination is in the gateway's subset, if it gave one."""
        subset, of = self._subset, self._destinations.of
        return None if subset is None else (lambda inst: of(inst) in subset)

    def _read(self, raw: bytes) -> ClientRequest:
        """The request as the intake reads it: key (identified, charged), size, body."""
        ctx = self._ctx
        key = identify(ctx, {"headers": self._headers})
        charge(ctx, key)
        limit = ctx.config.admission.max_body_bytes
        if len(raw) > limit:
            raise BodyTooLarge(f"request body exceeds {limit} bytes")
        path = _header(self._headers, b":path").split("?", 1)[0]
        if path == INVOCATIONS:
            return parse_invocation(raw, key)
        endpoint = _ENDPOINTS.get(path)
        if endpoint is None:
            raise InvalidRequest(f"{path}: not a generate route the picker places")
        if endpoint is Endpoint.CHAT_BATCH:
            return parse_chat_batch(raw, key)
        return parse_client_request(raw, endpoint, key)

    async def _complete(self, pool: ModelPool, creq: ClientRequest) -> ClientRequest:
        """Session, priority and bounds, as the intake gives and checks them."""
        ctx = self._ctx
        creq = with_session(creq, self._headers, pool.config.sessions)
        creq = with_priority(
            creq,
            self._headers,
            ctx.config.admission,
            pool.config.engine_priority_scheduling,
            ctx.clock(),
            key_class(ctx, creq.api_key_name),
        )
        if creq.endpoint is Endpoint.CHAT_BATCH:
            await check_batch(ctx, pool, creq)
            return creq
        return await check_bounds(ctx, pool, creq)


class ExtProc(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The gRPC service: one :class:`Exchange` per stream, closed however the stream ends.
    ``on_pick``: told each placement (tests, to see which D and P were chosen)."""

    def __init__(
        self,
        ctx: AppContext,
        destinations: Destinations,
        on_pick: Callable[[Pick], None] | None = None,
    ) -> None:
        self._ctx = ctx
        self._destinations = destinations
        self._on_pick = on_pick
        self.open = 0  # streams now open

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        exchange = Exchange(self._ctx, self._destinations, self._on_pick)
        self.open += 1
        try:
            async for req in requests:
                for answer in await exchange.answer(req):
                    yield answer
        finally:
            self.open -= 1
            exchange.close()


def _subset(metadata: Any) -> frozenset[str] | None:
    """The endpoints the gateway lets this request go to (the extension's subset hint:
    ``envoy.lb.subset_hint``, ``x-gateway-destination-endpoint-subset``), if it names any;
    the picker then picks among them only (none eligible, or an empty list: 503)."""
    hint = metadata.filter_metadata.get(_SUBSET_NAMESPACE) if metadata is not None else None
    if hint is None or _SUBSET not in hint.fields:
        return None
    value = hint.fields[_SUBSET]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values)
    return frozenset(a.strip() for a in value.string_value.split(",") if a.strip())


def _raw_headers(header_map: Any) -> list[tuple[bytes, bytes]]:
    """The request's headers as ASGI's raw pairs (names lower-case, as HTTP/2 and Envoy
    give them)."""
    return [
        (h.key.lower().encode("latin-1"), h.raw_value or h.value.encode("latin-1"))
        for h in header_map.headers
    ]


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    return next((v.decode("latin-1") for n, v in headers if n == name), "")


def _routed(destination: str | None, legs: dict[str, str]) -> Any:
    """Headers set for the gateway and the sidecar; a client's own values of them removed."""
    values = dict(legs)
    if destination is not None:
        values[DESTINATION] = destination
    remove = [n for n in _OURS if n not in values]
    return ep.CommonResponse(header_mutation=_mutation(values, remove))


def _mutation(values: dict[str, str], remove: list[str]) -> Any:
    return ep.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1")),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for k, v in values.items()
        ],
        remove_headers=remove,
    )


def _lb_metadata(destination: str) -> Any:
    """The destination in the extension's dynamic metadata (``envoy.lb``)."""
    meta = struct_pb2.Struct()
    meta.update({_LB_NAMESPACE: {DESTINATION: destination}})
    return meta


def _refusal(exc: RouterError) -> Any:
    """The router's refusal as the gateway's immediate response: status, headers, body."""
    headers = {"content-type": "application/json", **exc.headers()}
    return ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=exc.status),
        headers=_mutation(headers, []),
        body=exc.body(),
        details=f"pd-router picker: {exc.code}",
    )


def _continue(kind: str | None) -> Any:
    """Go on unchanged, in the phase ``kind`` asked about."""
    if kind in ("request_trailers", "response_trailers"):
        return ep.ProcessingResponse(**{kind: ep.TrailersResponse()})
    if kind in ("request_headers", "response_headers"):
        return ep.ProcessingResponse(**{kind: ep.HeadersResponse()})
    return ep.ProcessingResponse(**{kind or "response_body": ep.BodyResponse()})
