"""The legs of a conversation's turn with KV that flows back (router/pd/kv_return.py).

One :class:`Turns` per dispatcher. For a request that qualifies (pull or pipelined mode,
``kv_return`` on, a client session id, completions or chat, one choice).

Pipelined: P's params name the session's kept turn, if any (:meth:`Turns.offer`); D's ask D
to keep this one, which is recorded once D's answer has ended cleanly (:meth:`Turns.kept`).

Pull:

* before P: the session's kept turn, if any, is checked against the new prompt's token ids
  (P's ``/tokenize``) and becomes P's ``kv_transfer_params`` where it matches;
* on D's leg: ``return_token_ids`` is asked for when D's answer is not streamed, so that the
  turn D finishes can be kept (streamed answers carry no params in vLLM 0.32);
* after D: its params and token ids are recorded, and the body the client gets is D's
  without them, as an aggregated engine answers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from connector.address import NixlAddress
from router.client_request import ClientRequest, Endpoint
from router.config import Mode
from router.engines.instance import Instance
from router.engines.kv_return import Kept, Reuse
from router.metrics import Metrics
from router.pd.kv_return import kept_from_response, reuse_params
from router.pd.legs import DecodeLeg
from router.pd.side_calls import SideCalls
from router.registry import ModelPool

__all__ = ["TurnPlan", "Turns"]

log = logging.getLogger("pd_router.turns")

# What shapes the chat template's token ids, as vLLM's /tokenize takes it for chat.
_CHAT_TEMPLATE_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)
_BLOCK_SIZE_INFO = "vllm:cache_config_info"


@dataclass(slots=True)
class TurnPlan:
    """What one attempt does about kept turns: the P params to use (None: P's own), and
    whether D's answer is to be kept."""

    session: str
    keep: bool
    reuse: dict[str, Any] | None = None


class Turns:
    def __init__(self, side_calls: SideCalls, metrics: Metrics) -> None:
        self._side = side_calls
        self._metrics = metrics

    def plan(self, pool: ModelPool, creq: ClientRequest) -> TurnPlan | None:
        """None when the request does not qualify (see module doc)."""
        if not pool.config.kv_return.enabled or pool.mode not in (Mode.PULL, Mode.PIPELINED):
            return None
        if creq.session is None or creq.n != 1 or creq.num_prompts != 1:
            return None
        if creq.endpoint not in (Endpoint.COMPLETIONS, Endpoint.CHAT):
            return None
        # vLLM's D keeps no streamed turn (its params come with the body); ours keeps any.
        return TurnPlan(creq.session, keep=pool.mode is Mode.PIPELINED or not creq.stream)

    def offer(self, pool: ModelPool, turn: TurnPlan) -> dict[str, Any] | None:
        """Pipelined: the ``kv_reuse`` params that hand P the session's kept turn (taken:
        used at most once), if its D is still in rotation as the same engine."""
        taken = pool.kv_returns.take(turn.session)
        if taken is None:
            return None
        if isinstance(taken, Reuse):
            self._count(pool, taken)
            return None
        d = next((i for i in pool.decode if i.url == taken.decode_url), None)
        address = NixlAddress.from_params(taken.params)
        if d is None or d.healthy is False or d.nixl is None or d.nixl != address:
            self._count(pool, Reuse.UNAVAILABLE)  # gone, unhealthy or restarted
            return None
        self._count(pool, Reuse.OFFERED)
        return {"kv_reuse": dict(taken.params)}

    def kept(self, pool: ModelPool, turn: TurnPlan, transfer_id: str, d: Instance) -> None:
        """Pipelined: D answered the turn cleanly and keeps it (``kv_keep``) for the next."""
        if d.nixl is None:
            return
        params = {"transfer_id": transfer_id, **d.nixl.as_params()}
        pool.kv_returns.keep(pool.config.kv_return, turn.session, params, (), d.url)
        self._count(pool, Reuse.KEPT)

    async def prepare(
        self, pool: ModelPool, creq: ClientRequest, p: Instance, turn: TurnPlan
    ) -> None:
        """Take the session's kept turn and set ``turn.reuse`` where the new prompt on ``p``
        starts with (enough of) the tokens it holds."""
        taken = pool.kv_returns.take(turn.session)
        if taken is None:
            return
        if isinstance(taken, Reuse):
            self._count(pool, taken)
            return
        result, params = await self._check(pool, creq, p, taken)
        self._count(pool, result)
        turn.reuse = params

    async def _check(
        self, pool: ModelPool, creq: ClientRequest, p: Instance, kept: Kept
    ) -> tuple[Reuse, dict[str, Any] | None]:
        d = next((i for i in pool.decode if i.url == kept.decode_url), None)
        if d is None or d.healthy is False:
            return Reuse.UNAVAILABLE, None
        prompt_ids = await self._prompt_ids(p, creq)
        if prompt_ids is None:
            return Reuse.UNAVAILABLE, None
        if d.block_size is None:
            d.learn_block_size(await self._block_size(d))
        block_size = d.block_size
        return reuse_params(kept, prompt_ids, block_size, pool.config.kv_return.min_tokens)

    async def _prompt_ids(self, p: Instance, creq: ClientRequest) -> list[int] | None:
        body = creq.body
        if creq.endpoint is Endpoint.CHAT:
            query = {k: body[k] for k in _CHAT_TEMPLATE_FIELDS if k in body}
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt  # token ids already
            query = {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
        if "model" in body:
            query["model"] = body["model"]
        return await self._side.tokenize(p, query)

    async def _block_size(self, d: Instance) -> int | None:
        """D's KV block size, from ``vllm:cache_config_info`` on its ``/metrics``."""
        text = await self._side.metrics_text(d)
        if text is None:
            return None
        for family in text_string_to_metric_families(text):
            if family.name == _BLOCK_SIZE_INFO:
                for sample in family.samples:
                    value = sample.labels.get("block_size", "")
                    if value.isdigit() and int(value) > 0:
                        return int(value)
        return None

    def decode_body(self, turn: TurnPlan | None, body: dict[str, Any]) -> dict[str, Any]:
        """D's body, asking for the token ids a kept turn needs."""
        if turn is None or not turn.keep:
            return body
        return {**body, "return_token_ids": True}

    def keep(
        self, pool: ModelPool, creq: ClientRequest, turn: TurnPlan | None, leg: DecodeLeg
    ) -> None:
        """Record the turn D answered and give the client D's body without its params."""
        if turn is None or not turn.keep or leg.rest is not None or leg.status != 200:
            return
        found, leg.first = kept_from_response(leg.first, bool(creq.body.get("return_token_ids")))
        if found is not None:
            params, token_ids = found
            kept = pool.config.kv_return, turn.session, params, token_ids, leg.instance.url
            pool.kv_returns.keep(*kept)
            self._count(pool, Reuse.KEPT)

    def _count(self, pool: ModelPool, result: Reuse) -> None:
        self._metrics.kv_returns.labels(pool.name, result.value).inc()
        self._metrics.kv_returns_kept.labels(pool.name).set(len(pool.kv_returns))
