"""The two upstream legs of a dispatch: a prefill call and an opened decode stream.

Each function owns the upstream connection it opens: on any exception,
cancellation included, the connection is closed before the exception leaves
(closing is how vLLM learns to abort). Outcomes are judged by the dispatcher.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson

from router.config import TimeoutConfig
from router.engines.instance import Instance, Role
from router.errors import UpstreamError, UpstreamStatus, engine_paused
from router.lifecycle import Lifecycle
from router.pd.decode_leg import DecodeLeg, PrefillResult
from router.pd.sse import ENGINE_ERROR_EVENT
from router.pd.usage import prompt_cached_tokens, prompt_token_ids
from router.upstream import UpstreamClient, UpstreamStream

__all__ = ["LegRunner"]

_MAX_ERROR_BODY = 64 * 1024


class LegRunner:
    def __init__(
        self,
        upstream: UpstreamClient,
        timeouts: TimeoutConfig,
        lifecycle: Lifecycle,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._upstream = upstream
        self.timeouts = self._timeouts = timeouts
        self._events = lifecycle
        self._clock = clock

    async def prefill(
        self,
        model: str,
        inst: Instance,
        path: str,
        body: dict[str, Any],
        request_id: str,
        *,
        require_params: bool,
        traceparent: str | None = None,
    ) -> PrefillResult:
        """Run the P leg to completion; its one generated token is discarded.

        With ``require_params``, a response without ``kv_transfer_params`` is an
        error (counted), never a silent recompute on D.
        """
        with inst.running_leg():  # the breaker's half-open trial, if it is one
            content = await self._prefill_call(inst, path, body, request_id, traceparent)
        doc = _json(content)
        params = _kv_params(doc)
        if require_params and params is None:
            self._events.kv_params_missing(model, inst.url, inst.rank_label)
            raise UpstreamError(
                "prefill engine returned no kv_transfer_params "
                "(is it running a NIXL connector with kv_role kv_producer?)",
                role=Role.PREFILL,
                engine=inst.key,
                code="kv_transfer_params_missing",
            )
        return PrefillResult(
            params, self._clock(), prompt_cached_tokens(doc), prompt_token_ids(doc)
        )

    async def _prefill_call(
        self,
        inst: Instance,
        path: str,
        body: dict[str, Any],
        request_id: str,
        traceparent: str | None,
    ) -> bytes:
        limit = self._timeouts.prefill
        async with self._upstream.within(inst, limit, "prefill_timeout", watched=True):
            answer = await self._upstream.call(
                inst, path, body, request_id, read_timeout=limit, traceparent=traceparent
            )
        if answer.status != 200:
            raise UpstreamStatus(answer.status, answer.content, role=Role.PREFILL, engine=inst.key)
        return answer.content

    async def open_decode(
        self,
        inst: Instance,
        path: str,
        body: dict[str, Any],
        request_id: str,
        stream: bool,
        traceparent: str | None = None,
        computes_prompt: bool = False,
    ) -> DecodeLeg:
        """Send the D leg and wait for its first bytes (the whole body if not streaming).

        Streaming responses must show their first byte within ``decode_first_byte``;
        non-streaming ones complete within ``total``. A leg that ``computes_prompt`` (D
        alone) counts in ``inst.prefilling`` until then.
        """
        limit = self._timeouts.decode_first_byte if stream else self._timeouts.total
        code = "decode_first_byte_timeout" if stream else "decode_timeout"
        with inst.computing_prompt(computes_prompt):
            async with self._upstream.within(inst, limit, code, watched=True):
                opened = await self._upstream.open(
                    inst,
                    path,
                    body,
                    request_id,
                    read_timeout=None if stream else limit,
                    traceparent=traceparent,
                )
                try:
                    return await self._first_bytes(inst, opened, stream)
                except BaseException:
                    opened.close()
                    raise

    async def _first_bytes(self, inst: Instance, opened: UpstreamStream, stream: bool) -> DecodeLeg:
        """D's leg once its first bytes are read: a streaming body's first read, else the
        whole body; an error status raises :class:`UpstreamStatus` with its body."""
        if opened.status >= 400 or not stream:
            content = await _read_bounded(opened)
            if opened.status >= 400:
                raise UpstreamStatus(opened.status, content, role=inst.role, engine=inst.key)
            return DecodeLeg(inst, opened, content, None, self._clock)
        rest = opened.chunks().__aiter__()
        first = await anext(rest, b"")
        if first.startswith(ENGINE_ERROR_EVENT):
            paused = _paused_event(first)
            if paused is not None:  # nothing sent yet: load, tried on another engine
                raise UpstreamStatus(503, paused, role=inst.role, engine=inst.key, paused=True)
        return DecodeLeg(inst, opened, first, rest, self._clock)


async def _read_bounded(stream: UpstreamStream) -> bytes:
    return (await stream.read_all())[: _MAX_ERROR_BODY if stream.status >= 400 else None]


def _paused_event(first: bytes) -> bytes | None:
    """The error of a stream that a paused engine (vLLM 0.33+) answered with its error event
    at once (its 200 sent before the request reached the paused engine core), or None."""
    event = first[len(b"data: ") :].split(b"\n\n", 1)[0]
    return event if engine_paused(event, streamed=True) else None


def _json(content: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(content)
    except orjson.JSONDecodeError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _kv_params(doc: dict[str, Any]) -> dict[str, Any] | None:
    params = doc.get("kv_transfer_params")
    return params if isinstance(params, dict) and params else None
