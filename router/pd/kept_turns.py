"""Kept turns in the dispatch: D keeps a conversation's turn, its next P reads it
(router/pd/kept_turn_params.py).

One :class:`KeptTurns` per dispatcher. For a request that qualifies (pull or pipelined mode,
``kept_turns`` on, a client session id, completions or chat, one choice, no prompt ids of
the client's in ``kv_transfer_params``).

Pipelined, with no table in the router: D's params ask D to keep this turn under the
conversation's keep id (:func:`keep_id`, derived from the model, the API key's name and the
session), replacing the conversation's previous kept turn on that D; P's params name the keep
id and the D that holds the conversation (:meth:`KeptTurns.offer`): the D whose KV events show the
longest prefix of this prompt (``router/kvindex``), else this turn's own D (session affinity
places a conversation's turns alike on every replica). Any router replica can therefore offer
the last kept turn; P's connector checks hashes of the token ids before it reads anything, and
a D that keeps nothing under the id refuses at once (``connector/kept_turns_worker.py``).

Pull:

* before P: the session's kept turn, if any, is checked against the new prompt's token ids
  (P's ``/tokenize``) and becomes P's ``kv_transfer_params`` where it matches;
* on D's leg: ``return_token_ids`` is asked for when D's answer is not streamed, so that the
  turn D finishes can be kept; a streamed turn is kept where D runs vLLM 0.33+ (which ends a
  stream with its params; 0.32 does not), with the prompt's ids asked of P's leg;
* after D: its params and token ids are recorded (a stream's once it ended cleanly), and the
  body the client gets is D's without them, as an aggregated engine answers.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from router.client_request import ClientRequest, Endpoint, client_prompt_ids
from router.config import Mode
from router.engines.adapters import requested_adapter
from router.engines.facts import parse_block_size
from router.engines.instance import Instance
from router.engines.kept_turns import KeptTurn, KeptTurnResult
from router.engines.vllm_versions import streams_params
from router.kvindex.route import CacheRoute
from router.kvindex.tokens import tokenize_query
from router.lifecycle import Lifecycle
from router.pd.decode_leg import DecodeLeg
from router.pd.kept_turn_params import kept_from_response, kept_from_stream, reuse_params
from router.pd.side_calls import SideCalls
from router.registry import ModelPool

__all__ = ["KeptTurns", "TurnPlan", "keep_id"]

log = logging.getLogger("pd_router.kept_turns")


def keep_id(model: str, tenant: str, session: str) -> str:
    """A conversation's keep id in pipelined mode: the same on every router replica, and
    different for another API key using the same session id."""
    digest = hashlib.blake2b(f"{model}\0{tenant}\0{session}".encode(), digest_size=16)
    return f"keep-{digest.hexdigest()}"


@dataclass(slots=True)
class TurnPlan:
    """What one attempt does about kept turns: the P params to use (None: P's own), and
    whether D's answer is to be kept. Pipelined: the conversation's keep id, and the D that
    holds its last kept turn."""

    session: str
    keep: bool
    # Pull: D streams the turn (vLLM 0.33+ puts D's params on the stream's last chunk; the
    # prompt's ids come from P, asked for them).
    streamed: bool = False
    reuse: dict[str, Any] | None = None
    keep_id: str | None = None
    holder: Instance | None = None


def _first_turn(creq: ClientRequest) -> bool:
    """A chat request with no reply in its history: nothing of it can be kept anywhere."""
    messages = creq.body.get("messages")
    if creq.endpoint is not Endpoint.CHAT or not isinstance(messages, list):
        return False
    return not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)


class KeptTurns:
    def __init__(self, side_calls: SideCalls, lifecycle: Lifecycle) -> None:
        self._side = side_calls
        self._events = lifecycle

    def plan(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        cache: CacheRoute | None = None,
        decode: Instance | None = None,
    ) -> TurnPlan | None:
        """None when the request does not qualify (see module doc). Pipelined: ``cache`` (the
        request's cache-aware route, if any) finds the D that holds the conversation, else
        ``decode``, this turn's own D."""
        if not pool.config.kept_turns.enabled or pool.mode not in (Mode.PULL, Mode.PIPELINED):
            return None
        if creq.session is None or creq.n != 1 or creq.num_prompts != 1:
            return None
        if creq.endpoint not in (Endpoint.COMPLETIONS, Endpoint.CHAT):
            return None
        if client_prompt_ids(creq.body) is not None:
            return None  # the engines may run ids the router cannot check against a kept turn
        if requested_adapter(pool.name, creq.body) is not None:
            # A kept turn is checked by token ids only, not by the adapter that computed it:
            # a conversation that switches adapters would read KV of the wrong weights.
            return None
        if pool.mode is not Mode.PIPELINED:
            # A streamed turn is kept where D ends its streams with its params (vLLM 0.33+).
            if not creq.stream:
                return TurnPlan(creq.session, keep=True)
            streams = decode is not None and streams_params(decode.facts.version)
            return TurnPlan(creq.session, keep=streams, streamed=streams)
        min_tokens = pool.config.kept_turns.min_tokens
        holder = cache.holder(pool.decode, min_tokens) if cache is not None else None
        return TurnPlan(
            creq.session,
            keep=True,
            keep_id=keep_id(pool.name, creq.api_key_name, creq.session),
            holder=None if _first_turn(creq) else holder or decode,
        )

    def keep_value(self, turn: TurnPlan) -> str | bool:
        """D's ``keep_turn``: the conversation's keep id (pipelined)."""
        return turn.keep_id if turn.keep_id is not None else True

    def offer(
        self, pool: ModelPool, turn: TurnPlan, prefill: Instance | None = None
    ) -> dict[str, Any] | None:
        """Pipelined: the ``read_kept_turn`` params that name the conversation's kept turn and the D
        that holds it (module doc), if that D is in rotation with a known NIXL address and
        runs ``prefill``'s tensor-parallel size (the connector reads a kept turn only
        between equal sizes; ``unequal_tp`` is counted and P computes the turn)."""
        d = turn.holder
        if turn.keep_id is None or d is None:
            return None
        if d.healthy is False or d.nixl is None:
            self._count(pool, KeptTurnResult.UNAVAILABLE)
            return None
        p_nixl = prefill.nixl if prefill is not None else None
        if p_nixl is not None and p_nixl.tp_size != d.nixl.tp_size:
            self._count(pool, KeptTurnResult.UNEQUAL_TP)
            return None
        self._count(pool, KeptTurnResult.OFFERED)
        return {"read_kept_turn": {"transfer_id": turn.keep_id, **d.nixl.as_params()}}

    def kept(self, pool: ModelPool, turn: TurnPlan, transfer_id: str, d: Instance) -> None:
        """Pipelined: D answered the turn cleanly and keeps it (``keep_turn``) for the next;
        nothing is recorded here (the keep id names it)."""
        self._count(pool, KeptTurnResult.KEPT)

    async def prepare(
        self, pool: ModelPool, creq: ClientRequest, p: Instance, turn: TurnPlan
    ) -> None:
        """Take the session's kept turn and set ``turn.reuse`` where the new prompt on ``p``
        starts with (enough of) the tokens it holds."""
        taken = pool.kept_turns.take(turn.session)
        if taken is None:
            return
        if isinstance(taken, KeptTurnResult):
            self._count(pool, taken)
            return
        result, params = await self._check(pool, creq, p, taken)
        self._count(pool, result)
        turn.reuse = params

    async def _check(
        self, pool: ModelPool, creq: ClientRequest, p: Instance, kept: KeptTurn
    ) -> tuple[KeptTurnResult, dict[str, Any] | None]:
        d = next((i for i in pool.decode if i.key == kept.decode_key), None)
        if d is None or d.healthy is False:
            return KeptTurnResult.UNAVAILABLE, None
        prompt_ids = await self._prompt_ids(p, creq)
        if prompt_ids is None:
            return KeptTurnResult.UNAVAILABLE, None
        if d.block_size is None:
            d.learn_block_size(await self._block_size(d))
        block_size = d.block_size
        return reuse_params(kept, prompt_ids, block_size, pool.config.kept_turns.min_tokens)

    async def _prompt_ids(self, p: Instance, creq: ClientRequest) -> list[int] | None:
        query = tokenize_query(creq)
        if query is None or isinstance(query, list):
            return query
        return await self._side.tokenize(p, query)

    async def _block_size(self, d: Instance) -> int | None:
        """D's KV block size, from ``vllm:cache_config_info`` on its ``/metrics`` (the health
        monitor reads it too; this covers a D asked before its first check)."""
        text = await self._side.metrics_text(d)
        return None if text is None else parse_block_size(text)

    def decode_body(self, turn: TurnPlan | None, body: dict[str, Any]) -> dict[str, Any]:
        """D's body, asking for the token ids a kept turn needs (a whole answer's; a
        streamed turn takes the prompt's from P)."""
        if turn is None or not turn.keep or turn.streamed:
            return body
        return {**body, "return_token_ids": True}

    def keep(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        turn: TurnPlan | None,
        leg: DecodeLeg,
        prompt_ids: list[int] | None = None,
    ) -> None:
        """Record the turn D answered and give the client D's body without its params; a
        streamed turn is recorded when its stream ends cleanly, from D's params on its last
        chunk and ``prompt_ids`` (P's)."""
        if turn is None or not turn.keep or leg.status != 200:
            return
        if leg.rest is not None:
            if turn.streamed and prompt_ids:
                url = leg.instance.key
                leg.on_params = lambda raw: self._keep_stream(pool, turn, raw, prompt_ids, url)
            return
        found, leg.first = kept_from_response(leg.first, bool(creq.body.get("return_token_ids")))
        if found is not None:
            params, token_ids = found
            kept = pool.config.kept_turns, turn.session, params, token_ids, leg.instance.key
            pool.kept_turns.keep(*kept)
            self._count(pool, KeptTurnResult.KEPT)

    def _keep_stream(
        self, pool: ModelPool, turn: TurnPlan, raw: bytes, prompt_ids: list[int], url: str
    ) -> None:
        found = kept_from_stream(raw, prompt_ids)
        if found is not None:
            pool.kept_turns.keep(pool.config.kept_turns, turn.session, *found, url)
            self._count(pool, KeptTurnResult.KEPT)

    def _count(self, pool: ModelPool, result: KeptTurnResult) -> None:
        self._events.kept_turn(pool.name, result, len(pool.kept_turns))
