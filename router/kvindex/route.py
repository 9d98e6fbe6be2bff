"""Cache-aware choice of P and of D: the prompt tokens an engine would still compute (or
receive), plus its load.

:class:`CacheScorer` makes one :class:`CacheRoute` per request of a model with ``kv_events``
on, from the request's token ids (``router/kvindex/tokens.py``). The route is the request's
:data:`~router.engines.choice.Chooser`: given one role's candidates ``C`` (``n`` of them), it

1. leaves the choice to the pool's usual rule (session affinity, else the policy) when any
   candidate's index is unknown (no events yet, a gap no replay could fill): unknown is never
   read as empty;
2. else keeps the candidates within the load bound of ``sessions.load_factor``, ``load + 1 <=
   ceil(load_factor x (total load + 1) / n)`` (the least loaded one always is), and picks the
   one of least cost::

       cost = (prompt tokens - predicted cached tokens) + load_cost_tokens x load

   ties broken by rendezvous order of (session, or the prompt's start; URL), so that every
   router replica, seeing the same engines, picks the same one.

The predicted cached tokens of an engine are what its prefix cache would match, as vLLM
matches: whole blocks from the first on, held by the engine (``EngineIndex.matched``), at most
``(prompt tokens - 1) // block size`` of them (vLLM computes at least the last prompt token,
in whole blocks). Load is this replica's own count, or with several replicas what the engines
report (``router/engines/reported.py``).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from router.client_request import ClientRequest
from router.engines.adapters import requested_adapter
from router.engines.instance import Instance, Role, candidates
from router.kvindex.blocks import ROOT, TOKEN_BYTES, adapter_root, block_key, pack
from router.kvindex.engine import EngineIndex
from router.kvindex.index import KvIndex
from router.kvindex.tokens import tokenize_query
from router.registry import ModelPool

__all__ = ["CacheRoute", "CacheScorer", "Result", "Tokenize"]

Tokenize = Callable[[Instance, dict[str, Any]], Awaitable[list[int] | None]]
_TIE_TOKENS = 64  # a request without a session breaks ties by its first tokens


class Result(enum.StrEnum):
    """How one role's engine was chosen (``result`` label of ``pdrouter_cache_routes``)."""

    CACHED = "cached"  # every candidate known; the chosen one holds part of the prompt
    COLD = "cold"  # every candidate known; none holds any of it: chosen by load
    UNKNOWN = "unknown"  # a candidate's index is unknown: the pool's usual rule chose
    NO_TOKENS = "no_tokens"  # the prompt's token ids could not be had: the usual rule chose


def _rank(tie: str, url: str) -> bytes:
    return hashlib.blake2b(f"{tie}\0{url}".encode(), digest_size=8).digest()


class CacheRoute:
    """One request's cache-aware choice (see module doc). Calling it is the choice; what it
    predicted for each role is kept in ``predicted`` and ``results``."""

    def __init__(
        self,
        tokens: Sequence[int],
        tie: str,
        view: Callable[[str], EngineIndex | None],
        load: Callable[[Instance], int],
        load_factor: float,
        load_cost: int,
        root: int = ROOT,
    ) -> None:
        """``root``: what the prompt's first block chains to (a LoRA adapter's request:
        its adapter's root, ``router/kvindex/blocks.py``)."""
        self.tokens = tokens
        self._root = root
        self._packed = memoryview(pack(tokens))
        self._tie = tie
        self._view = view
        self._load = load
        self._factor = load_factor
        self._cost = load_cost
        self._keys: dict[int, list[int]] = {}
        self.predicted: dict[Role, int] = {}
        self.results: dict[Role, Result] = {}

    def __call__(self, role: Role, cands: Sequence[Instance]) -> Instance | None:
        views = [self._view(c.key) for c in cands]
        known = [v for v in views if v is not None and v.known]
        if len(known) != len(cands):
            self.results[role] = Result.UNKNOWN
            return None
        loads = [self._load(c) for c in cands]
        cap = math.ceil(self._factor * (sum(loads) + 1) / len(cands))
        best: tuple[int, bytes] | None = None
        chosen: tuple[Instance, int] | None = None
        for inst, index, load in zip(cands, known, loads, strict=True):
            if load + 1 > cap:
                continue
            cached = self.cached_tokens(index)
            key = (-(len(self.tokens) - cached + self._cost * load), _rank(self._tie, inst.key))
            if best is None or key > best:
                best, chosen = key, (inst, cached)
        assert chosen is not None  # the least loaded candidate is within the bound
        self.predicted[role] = chosen[1]
        self.results[role] = Result.CACHED if chosen[1] else Result.COLD
        return chosen[0]

    def cached_tokens(self, index: EngineIndex) -> int:
        """Prompt tokens ``index``'s engine would find in its prefix cache (module doc).
        The prompt's block keys are made as far as some engine matches, no further."""
        size = index.block_size
        if size is None:
            return 0
        keys = self._keys.setdefault(size, [])
        step = size * TOKEN_BYTES
        limit = (len(self.tokens) - 1) // size
        found = 0
        while found < limit:
            if found == len(keys):
                parent = keys[-1] if keys else self._root
                keys.append(block_key(parent, self._packed[found * step : (found + 1) * step]))
            if not index.holds(keys[found]):
                break
            found += 1
        return found * size

    def holder(self, instances: Sequence[Instance], min_tokens: int) -> Instance | None:
        """The engine among ``instances`` whose known index predicts the most cached prompt
        tokens, at least ``min_tokens``; None if none does."""
        best: tuple[int, bytes] | None = None
        found = None
        for inst in instances:
            index = self._view(inst.key)
            if index is None or not index.known:
                continue
            cached = self.cached_tokens(index)
            key = (cached, _rank(self._tie, inst.key))
            if cached >= min_tokens and (best is None or key > best):
                best, found = key, inst
        return found


class CacheScorer:
    """Makes each request's :class:`CacheRoute`; injected into the dispatcher."""

    def __init__(self, index: KvIndex, load: Callable[[Instance], int], tokenize: Tokenize) -> None:
        """``load``: an engine's load (this replica's count, or the engines' reports);
        ``tokenize``: an engine's ``/tokenize`` answer for a query, None on failure."""
        self.index = index
        self._load = load
        self._tokenize = tokenize

    async def route(self, pool: ModelPool, creq: ClientRequest) -> CacheRoute | None:
        """The request's route; None when ``pool`` has ``kv_events`` off or the prompt's token
        ids cannot be had within ``tokenize_timeout`` (the request is routed as without)."""
        events = pool.config.kv_events
        if not events.enabled:
            return None
        tokens = await self._tokens(pool, creq, events.tokenize_timeout)
        if not tokens:
            return None
        tie = creq.session or str(block_key(ROOT, pack(tokens[:_TIE_TOKENS])))
        factor = pool.config.sessions.load_factor
        root = adapter_root(requested_adapter(pool.name, creq.body))
        cost = events.load_cost_tokens
        return CacheRoute(tokens, tie, self.index.view, self._load, factor, cost, root)

    async def _tokens(
        self, pool: ModelPool, creq: ClientRequest, timeout: float
    ) -> list[int] | None:
        query = tokenize_query(creq)
        if query is None or isinstance(query, list):
            return query
        # P's API server first: D's streams every token of every request. An adapter's
        # query names the adapter: only an engine that holds it answers.
        adapter = requested_adapter(pool.name, creq.body)
        usable = _holding(candidates(pool.prefill), adapter) or _holding(
            candidates(pool.decode), adapter
        )
        if not usable:
            return None
        engine = min(usable, key=lambda i: i.load)
        try:
            async with asyncio.timeout(timeout):
                return await self._tokenize(engine, query)
        except TimeoutError:
            return None


def _holding(instances: list[Instance], adapter: str | None) -> list[Instance]:
    return instances if adapter is None else [i for i in instances if adapter in i.adapters]
