"""What a request is routed by, before any instance is chosen: its routing key (a
conversation's stable start), and whether P is too busy for it (conditional disaggregation
on load)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.client_request import ClientRequest
from router.engines.instance import Instance, candidates
from router.engines.selection import Selection
from router.kvindex.route import CacheRoute
from router.registry import ModelPool

__all__ = ["Route", "prefill_busy", "routing_key"]

_PREFIX_KEY_CHARS = 256


def routing_key(creq: ClientRequest) -> str:
    """A conversation's stable start, at most ``_PREFIX_KEY_CHARS`` characters: for chat,
    the messages up to its first user message (the same at every turn while the history
    only grows); else the start of the Responses-API input or of the prompt."""
    body = creq.body
    messages = body.get("messages")
    if isinstance(messages, list):
        opening = []
        for message in messages:
            opening.append(str(message)[:_PREFIX_KEY_CHARS])
            if isinstance(message, dict) and message.get("role") == "user":
                break
        return "\x1f".join(opening)[:_PREFIX_KEY_CHARS]
    for field in ("input", "prompt"):
        if field in body:
            value = body[field]
            head = value[:_PREFIX_KEY_CHARS] if isinstance(value, (str, list)) else value
            return str(head)[:_PREFIX_KEY_CHARS]
    return ""


@dataclass(frozen=True, slots=True)
class Route:
    """What instance selection goes by: ``routing_key`` for the prefix-hash policy, ``session``
    for session affinity, ``cache`` for cache-aware routing, ``prefill_ok`` and
    ``decode_ok`` the engines of each role a LoRA adapter's request may go to
    (``ModelPool.adapter_filter``; None: any). Each may be None."""

    routing_key: str | None
    session: str | None
    cache: CacheRoute | None = None
    prefill_ok: Callable[[Instance], bool] | None = None
    decode_ok: Callable[[Instance], bool] | None = None

    def selection(self, avoid: frozenset[Instance], api_key_name: str = "") -> Selection:
        """What the choice of an engine for this route depends on (router/engines/selection.py)."""
        return Selection(self.routing_key, self.session, api_key_name, avoid, self.cache)


def prefill_busy(pool: ModelPool) -> bool:
    """Every routable P runs ``disagg_max_prefill_queue`` legs or more, and a routable D has
    fewer prompts of its own still to compute than the least busy P: D would start this one
    sooner (join the shorter queue; a D-alone prompt also skips the transfer). False when
    off, or when no P is routable: that is refused, not served elsewhere."""
    limit = pool.config.disagg_max_prefill_queue
    usable = candidates(pool.prefill) if limit else []
    if not usable:
        return False
    queue = min(p.legs_running for p in usable)
    decode = candidates(pool.decode)
    return queue >= limit and bool(decode) and min(d.prefilling for d in decode) < queue
