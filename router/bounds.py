"""Bounds checked before any work: refused in vLLM's words before a slot or a generate call.

Checked in vLLM 0.32's order, each refusal a 400 ``BadRequestError`` carrying the message
vLLM gives for the same request (:class:`~router.errors.BoundExceeded`):

* ``prompts``: a completions request with more prompts than ``limits.max_prompts``;
* ``n``: ``n`` over ``limits.max_n``;
* ``max_tokens``: the output tokens asked for (``max_tokens``, ``max_completion_tokens``
  or ``max_output_tokens``) over the model's context or ``limits.max_tokens``; a request
  that asks for none is given ``limits.max_tokens`` when it is set;
* ``context``: a prompt longer than the model's context (``max_model_len``).

The context length is the model's ``max_model_len`` from the config, else what an engine
of the model reports in ``GET /v1/models`` (read at start, again every
``REFRESH_S``, and on a request while unknown, at most once per ``retry_s``). While it is
unknown only the first three are checked; the engines still check the rest.

Counting a prompt's tokens costs nothing for token-id prompts. A text prompt is first
bounded by its UTF-8 size: a byte-level BPE tokenizer (Llama 3, Qwen, SmolLM2, GPT) never
makes more tokens than bytes, and :data:`TEMPLATE_TOKENS` per message plus
:data:`SPECIAL_TOKENS` cover the chat template and special tokens. Only a prompt whose
bound exceeds the context is counted by an engine's ``/tokenize``
(``limits.tokenize_long_prompts``); a prompt with parts other than text (images, audio)
is left to the engine, whose count of them the router cannot bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from router.client_request import ClientRequest, Endpoint
from router.config import LimitsConfig
from router.errors import BoundExceeded, RouterError
from router.passthrough import PassThrough
from router.pd import kv_params as kp
from router.registry import ModelPool

__all__ = ["REFRESH_S", "SPECIAL_TOKENS", "TEMPLATE_TOKENS", "Bounds", "text_token_bound"]

log = logging.getLogger("pd_router.bounds")

REFRESH_S = 60.0  # how often a known context length is read again
SPECIAL_TOKENS = 64  # BOS/EOS and a template's fixed preamble (a date line, a system prompt)
TEMPLATE_TOKENS = 16  # a chat template's role header and end marks, per message

_TEXT_PARTS = ("text", "input_text", "output_text")

# Fields of a chat request that change what its template renders, passed to /tokenize.
_CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "add_special_tokens",
)


@dataclass(slots=True)
class _Learned:
    value: int | None = None
    tried_at: float | None = None


def _message_bound(msg: Any) -> int | None:
    """Bytes of a message's JSON (at least those of every text it carries, tool calls
    included) plus its template tokens; None if it has parts other than text."""
    if not isinstance(msg, dict):
        return None
    content = msg.get("content")
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict) or part.get("type", "text") not in _TEXT_PARTS:
                return None
    return len(orjson.dumps(msg)) + TEMPLATE_TOKENS


def _messages_bound(messages: Iterable[Any], tools: Any = None) -> int | None:
    total = SPECIAL_TOKENS + (len(orjson.dumps(tools)) if tools else 0)
    for msg in messages:
        bound = _message_bound(msg)
        if bound is None:
            return None
        total += bound
    return total


def _prompts(prompt: Any) -> list[Any]:
    """A completions ``prompt`` as a list of prompts (each a string or token ids)."""
    several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    return list(prompt) if several else [prompt]


def text_token_bound(creq: ClientRequest) -> list[int | None]:
    """Per prompt of ``creq``: an upper bound of its tokens, the token count itself for
    token ids, or None where the router cannot bound it (parts other than text)."""
    body = creq.body
    if creq.endpoint is Endpoint.MESSAGES:
        return [None]  # Anthropic's blocks and system prompt: the engines check
    if creq.endpoint is Endpoint.CHAT:
        return [_messages_bound(body.get("messages") or [], body.get("tools"))]
    if creq.endpoint is Endpoint.RESPONSES:
        given = body.get("input")
        if isinstance(given, str):
            return [len(given.encode()) + SPECIAL_TOKENS + TEMPLATE_TOKENS]
        return [_messages_bound(given if isinstance(given, list) else [None], body.get("tools"))]
    out: list[int | None] = []
    for p in _prompts(body.get("prompt")):
        out.append(len(p.encode()) + SPECIAL_TOKENS if isinstance(p, str) else len(p))
    return out


def _surely_fits(creq: ClientRequest, context: int) -> bool:
    """Whether the cheapest bound (four bytes per character, every message's template,
    no tools) already fits: most requests, at the cost of a few additions."""
    if creq.prompt_is_tokens or "tools" in creq.body or creq.endpoint is not Endpoint.COMPLETIONS:
        return False
    return 4 * creq.prompt_chars + SPECIAL_TOKENS * creq.num_prompts <= context


class Bounds:
    def __init__(
        self,
        limits: LimitsConfig,
        passthrough: PassThrough,
        timeout: float,
        retry_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``timeout``: for each engine call (``/v1/models``, ``/tokenize``); ``retry_s``:
        how soon an unknown context length may be asked for again."""
        self._limits = limits
        self._passthrough = passthrough
        self._timeout = timeout
        self._retry_s = retry_s
        self._clock = clock
        self._learned: dict[str, _Learned] = {}

    # -- the context length ------------------------------------------------------------

    def known_context(self, pool: ModelPool) -> int | None:
        if pool.config.max_model_len is not None:
            return pool.config.max_model_len
        learned = self._learned.get(pool.name)
        return learned.value if learned is not None else None

    async def refresh(self, pool: ModelPool) -> int | None:
        """Read the model's ``max_model_len`` from one of its engines; keeps the last
        value known when the engine does not say."""
        learned = self._learned.setdefault(pool.name, _Learned())
        learned.tried_at = self._clock()
        try:
            _, content, _ = await self._passthrough.call(
                pool, "/v1/models", None, "-", self._timeout
            )
            value = _max_model_len(orjson.loads(content), pool.name)
        except (RouterError, ValueError, OSError) as exc:  # best effort: the engines check
            log.info("event=context_unknown model=%s reason=%r", pool.name, str(exc))
            return learned.value
        if value is not None and value != learned.value:
            log.info("event=context_length model=%s max_model_len=%d", pool.name, value)
            learned.value = value
        return learned.value

    async def refresh_all(self, pools: Iterable[ModelPool]) -> None:
        """Read the context length of every model that does not configure its own."""
        wanted = [p for p in pools if p.config.max_model_len is None]
        await asyncio.gather(*(self.refresh(p) for p in wanted))

    async def run(self, pools: Callable[[], Iterable[ModelPool]]) -> None:
        """Read them again every ``REFRESH_S`` (an engine restarted with another
        ``--max-model-len``); cancel to stop."""
        while True:
            await asyncio.sleep(REFRESH_S)
            await self.refresh_all(pools())

    async def _context(self, pool: ModelPool) -> int | None:
        known = self.known_context(pool)
        if known is not None:
            return known
        learned = self._learned.get(pool.name)
        tried = learned.tried_at if learned is not None else None
        if tried is not None and self._clock() - tried < self._retry_s:
            return None
        return await self.refresh(pool)

    # -- the checks --------------------------------------------------------------------

    async def check(self, pool: ModelPool, creq: ClientRequest) -> ClientRequest:
        """``creq``, with ``limits.max_tokens`` filled in if it asked for no output limit;
        raises :class:`BoundExceeded` (vLLM's status and message)."""
        limits = self._limits
        if creq.num_prompts > limits.max_prompts:
            raise BoundExceeded(
                "prompts",
                f"prompt list length {creq.num_prompts} exceeds the maximum allowed count "
                f"of {limits.max_prompts}.",
                "prompt",
            )
        if creq.n > limits.max_n:
            raise BoundExceeded("n", f"n must be at most {limits.max_n}, got {creq.n}.")
        context = await self._context(pool)
        creq = self._check_output(creq, context)
        if context is not None:
            await self._check_prompt(pool, creq, context)
        return creq

    def _check_output(self, creq: ClientRequest, context: int | None) -> ClientRequest:
        field, asked, cap = creq.max_output_field, creq.max_output, self._limits.max_tokens
        if asked is None:
            if cap is None:
                return creq
            # What vLLM's --generation-config max_new_tokens does: the default output limit.
            body = {**creq.body, field: cap}
            return replace(creq, body=body, max_output=cap)
        if context is not None and asked > context:
            raise BoundExceeded(
                "max_tokens",
                f"{field}={asked} cannot be greater than max_model_len={context}. "
                "Please request fewer output tokens.",
                field,
            )
        if cap is not None and asked > cap:
            raise BoundExceeded(
                "max_tokens",
                f"{field}={asked} cannot be greater than limits.max_tokens={cap}. "
                "Please request fewer output tokens.",
                field,
            )
        return creq

    async def _check_prompt(self, pool: ModelPool, creq: ClientRequest, context: int) -> None:
        if _surely_fits(creq, context):
            return
        for index, bound in enumerate(text_token_bound(creq)):
            if bound is None or bound <= context:
                continue
            if creq.prompt_is_tokens:
                raise _too_long(context, bound)  # token ids: the bound is the count
            if not self._limits.tokenize_long_prompts:
                continue
            count = await self._count(pool, creq, index)
            if count is not None and count > context:
                # vLLM tokenizes a text prompt up to one token past the context: it can
                # only say "at least" that many.
                raise _too_long(context, context + 1)

    async def _count(self, pool: ModelPool, creq: ClientRequest, index: int) -> int | None:
        """The engine's token count of prompt ``index`` (None if it cannot say)."""
        body = _tokenize_body(pool.name, creq, index)
        if body is None:
            return None
        request_id = kp.new_dispatch_ids().request_id
        try:
            status, content, _ = await self._passthrough.call(
                pool, "/tokenize", body, request_id, self._timeout
            )
            doc = orjson.loads(content) if status == 200 else None
        except (RouterError, ValueError, OSError) as exc:  # best effort: the engines check
            log.info("event=tokenize_failed model=%s reason=%r", pool.name, str(exc))
            return None
        count = doc.get("count") if isinstance(doc, dict) else None
        return count if isinstance(count, int) else None


def _too_long(context: int, tokens: int) -> BoundExceeded:
    """vLLM 0.32's refusal of a prompt of ``tokens`` tokens (renderers/params.py), which says
    "at least" for one past the context: what its truncating tokenizer stops at."""
    qualifier = "at least " if tokens == context + 1 else ""
    return BoundExceeded(
        "context",
        f"This model's maximum context length is {context} tokens. However, your prompt "
        f"contains {qualifier}{tokens} input tokens, which exceeds this limit even without "
        "any output tokens. Please reduce the length of the input prompt.",
        "input_tokens",
    )


def _tokenize_body(model: str, creq: ClientRequest, index: int) -> dict[str, Any] | None:
    body = creq.body
    if creq.endpoint is Endpoint.CHAT:
        out = {"model": model, "messages": body["messages"]}
        out.update({k: body[k] for k in _CHAT_FIELDS if k in body})
        return out
    if creq.endpoint is Endpoint.RESPONSES:
        given = body.get("input")
        messages = [{"role": "user", "content": given}] if isinstance(given, str) else given
        return {"model": model, "messages": messages}
    text = _prompts(body.get("prompt"))[index]
    if not isinstance(text, str):
        return None
    out = {"model": model, "prompt": text}
    if "add_special_tokens" in body:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


def _max_model_len(doc: Any, model: str) -> int | None:
    """``max_model_len`` of ``model`` in a ``/v1/models`` answer (else of its first card)."""
    cards = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(cards, list):
        return None
    cards = [c for c in cards if isinstance(c, dict)]
    named = [c for c in cards if c.get("id") == model] or cards[:1]
    value = named[0].get("max_model_len") if named else None
    return value if isinstance(value, int) and value > 0 else None
