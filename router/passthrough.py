"""Endpoints of ``vllm serve`` that need no P/D: forwarded as they are to one engine.

``/tokenize`` and ``/detokenize`` name a model: any engine serving it answers as the
model's one server would (P and D run the same model and tokenizer). ``/version`` and
``/tokenizer_info`` name none: the first model's engine answers (``vllm serve`` answers
``/tokenizer_info`` only with ``--enable-tokenizer-info-endpoint``, else 404). The
engine's status and body reach the client unchanged, its 4xx included; an engine that
cannot be reached is a 502, no engine in rotation a 503 ``no_healthy_<role>``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi.responses import Response

from router.engines.adapters import requested_adapter
from router.engines.instance import Instance, Role, candidates, refusal
from router.errors import UpstreamError
from router.registry import ModelPool
from router.upstream import UpstreamClient

__all__ = ["GET_PATHS", "POST_PATHS", "PassThrough"]

POST_PATHS = ("/tokenize", "/detokenize")
GET_PATHS = ("/version", "/tokenizer_info")


class PassThrough:
    def __init__(
        self,
        upstream: UpstreamClient,
        timeout: float,
        probe_interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``timeout``: for the whole exchange with the engine."""
        self._upstream = upstream
        self._timeout = timeout
        self._probe_interval = probe_interval
        self._clock = clock

    def engine(self, pool: ModelPool, adapter: str | None = None) -> Instance:
        """The least busy engine of ``pool`` in rotation (decode engines first); for a LoRA
        ``adapter``'s call (``/tokenize`` naming it), one that holds it."""
        for role in (Role.DECODE, Role.PREFILL):
            usable = candidates(pool.of_role(role))
            if adapter is not None:
                usable = [i for i in usable if adapter in i.adapters]
            if usable:
                return min(usable, key=lambda i: i.load)
        raise refusal(Role.DECODE, pool.name, pool.decode, self._clock(), self._probe_interval)

    async def forward(
        self, pool: ModelPool, path: str, body: dict[str, Any] | None, request_id: str
    ) -> Response:
        """POST ``body`` to ``path`` on an engine of ``pool`` (GET when ``body`` is None)."""
        status, content, media_type = await self.call(pool, path, body, request_id)
        return Response(content, status_code=status, media_type=media_type)

    async def call(
        self,
        pool: ModelPool,
        path: str,
        body: dict[str, Any] | None,
        request_id: str,
        timeout: float | None = None,
    ) -> tuple[int, bytes, str]:
        """The engine's status, body and content type for ``path`` (GET when ``body`` is
        None), within ``timeout`` (default: the whole exchange's). Raises
        :class:`UpstreamError` for a 5xx or an engine that cannot be reached in time."""
        adapter = requested_adapter(pool.name, body) if body is not None else None
        inst = self.engine(pool, adapter)
        limit = self._timeout if timeout is None else timeout
        async with self._upstream.within(inst, limit):
            if body is None:
                status, content = await self._upstream.get(inst, path, limit)
                media_type = "application/json"
            else:
                answer = await self._upstream.call(inst, path, body, request_id, limit)
                status, content, media_type = answer.status, answer.content, answer.content_type
        if status >= 500:
            role = inst.role.value
            raise UpstreamError(f"{role} engine returned HTTP {status}", role=role, engine=inst.key)
        return status, content, media_type
