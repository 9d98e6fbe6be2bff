"""Side calls to an engine, beside a request's legs (router/pd/legs.py): a prompt's token ids
from an engine's ``/tokenize`` (kept turns in pull mode, router/pd/kept_turns.py; cache-aware
routing, router/kvindex/route.py) and D's ``/metrics`` page (its block size, for kept turns).
A side call's failure costs the optimisation, never the request: each answers None then, and
no breaker or engine counter hears of it (a leg's failure is judged; a side call's is not)."""

from __future__ import annotations

from typing import Any

import orjson

from router.engines.instance import Instance
from router.errors import UpstreamError
from router.upstream import UpstreamClient

__all__ = ["SideCalls"]


class SideCalls:
    def __init__(self, upstream: UpstreamClient, connect_timeout: float) -> None:
        self._upstream = upstream
        self._connect = connect_timeout

    async def tokenize(self, inst: Instance, query: dict[str, Any]) -> list[int] | None:
        """The token ids ``inst``'s ``/tokenize`` gives for ``query``; None on any failure
        (a side call: its failure costs the optimisation, never the request)."""
        limit = self._connect + 5.0
        try:
            async with self._upstream.within(inst, limit):
                answer = await self._upstream.call(
                    inst, "/tokenize", query, "tokenize", read_timeout=limit
                )
        except UpstreamError:
            return None
        tokens = _json(answer.content).get("tokens") if answer.status == 200 else None
        ok = isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)
        return tokens if ok else None

    async def metrics_text(self, inst: Instance) -> str | None:
        """``inst``'s ``/metrics`` page; None on any failure."""
        try:
            status, body = await self._upstream.get(inst, "/metrics", self._connect)
        except UpstreamError:
            return None
        return body.decode("utf-8", "replace") if status == 200 else None


def _json(content: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(content)
    except orjson.JSONDecodeError:
        return {}
    return doc if isinstance(doc, dict) else {}
