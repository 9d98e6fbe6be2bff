"""D's ``usage``, as an aggregated engine would report it.

In the push modes D takes the prompt's KV from the transfer, and vLLM 0.32 counts KV that came
from a connector as prefix-cache hits: D's ``prompt_tokens_details.cached_tokens`` is then about
``prompt_tokens``. An aggregated engine reports its own prefix-cache hits, and in P/D those are
P's. Pull needs nothing: P's ``kv_transfer_params`` carry its count
(``remote_prefill_cached_tokens``) and vLLM's D reports that.

D writes ``prompt_tokens_details`` only when started with ``--enable-prompt-tokens-details``; the
usage of a stream is in its last events (or in every event with ``continuous_usage_stats``). The
Responses API names it ``input_tokens_details`` (a stream's usage is in ``response.completed``);
the key inside is ``cached_tokens`` in both. The Anthropic Messages API (vLLM runs it as a chat
completion) reports ``cache_read_input_tokens`` beside ``input_tokens``, the prompt's tokens
that were not read from the cache: both are rewritten, their sum kept. The rewrite touches only
bytes holding a key (:data:`MARKER`, which both keys hold), so the stream is still relayed as
read.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["MARKER", "Patch", "prompt_cached_tokens", "prompt_token_ids", "with_cached_tokens"]

MARKER = b'"cache'  # a prefix of both keys: a chunk without it holds no usage to rewrite
_CACHED = re.compile(rb'"cached_tokens":\s*(\d+|null)')
# Anthropic's usage as vLLM writes it: input, output, cache creation (if any), cache reads.
_ANTHROPIC = re.compile(
    rb'"input_tokens":\s*(\d+)(,\s*"output_tokens":\s*\d+'
    rb'(?:,\s*"cache_creation_input_tokens":\s*(?:\d+|null))?,\s*)'
    rb'"cache_read_input_tokens":\s*(\d+)'
)

Patch = Callable[[bytes], Awaitable[bytes]]


def with_cached_tokens(chunk: bytes, cached: int) -> bytes:
    """``chunk`` with every ``cached_tokens`` value set to ``cached`` (and every Anthropic
    ``cache_read_input_tokens``, its ``input_tokens`` taking the difference)."""

    def anthropic(m: re.Match[bytes]) -> bytes:
        prompt = int(m[1]) + int(m[3])
        fresh = max(0, prompt - cached)
        return b'"input_tokens":%d%s"cache_read_input_tokens":%d' % (fresh, m[2], prompt - fresh)

    chunk = _CACHED.sub(b'"cached_tokens":%d' % cached, chunk)
    return _ANTHROPIC.sub(anthropic, chunk) if b'"cache_read' in chunk else chunk


def prompt_cached_tokens(doc: dict[str, Any]) -> int | None:
    """The prefix-cache hits a non-streamed answer reports (completions and chat:
    ``usage.prompt_tokens_details``; Responses API: ``usage.input_tokens_details``; Messages
    API: ``usage.cache_read_input_tokens``); None when it reports none."""
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if cached is None:  # the Anthropic Messages API
        cached = usage.get("cache_read_input_tokens")
    return cached if isinstance(cached, int) else None


def prompt_token_ids(doc: Any) -> list[int] | None:
    """A non-streamed answer's prompt token ids (asked with ``return_token_ids``: a chat's at
    the top, a completion's on its choice), None if it has none."""
    if not isinstance(doc, dict):
        return None
    ids = doc.get("prompt_token_ids")
    choices = doc.get("choices")
    if ids is None and isinstance(choices, list) and choices and isinstance(choices[0], dict):
        ids = choices[0].get("prompt_token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        return None
    return ids
