"""D's ``usage``, as an aggregated engine would report it.

In the push modes D takes the prompt's KV from the transfer, and vLLM 0.32 counts KV that came
from a connector as prefix-cache hits: D's ``prompt_tokens_details.cached_tokens`` is then about
``prompt_tokens``. An aggregated engine reports its own prefix-cache hits, and in P/D those are
P's. Pull needs nothing: P's ``kv_transfer_params`` carry its count
(``remote_prefill_cached_tokens``) and vLLM's D reports that.

D writes ``prompt_tokens_details`` only when started with ``--enable-prompt-tokens-details``; the
usage of a stream is in its last events (or in every event with ``continuous_usage_stats``). The
Responses API names it ``input_tokens_details`` (a stream's usage is in ``response.completed``);
the key inside is ``cached_tokens`` in both. The rewrite touches only bytes holding the key, so
the stream is still relayed as read.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["MARKER", "Patch", "prompt_cached_tokens", "with_cached_tokens"]

MARKER = b'"cached_tokens":'
_CACHED = re.compile(rb'"cached_tokens":\s*(\d+|null)')

Patch = Callable[[bytes], Awaitable[bytes]]


def with_cached_tokens(chunk: bytes, cached: int) -> bytes:
    """``chunk`` with every ``cached_tokens`` value set to ``cached``."""
    return _CACHED.sub(b'"cached_tokens":%d' % cached, chunk)


def prompt_cached_tokens(doc: dict[str, Any]) -> int | None:
    """The prefix-cache hits a non-streamed answer reports (completions and chat:
    ``usage.prompt_tokens_details``; Responses API: ``usage.input_tokens_details``); None
    when it reports none."""
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else None
