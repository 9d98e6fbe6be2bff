"""The kept turns of one model: a conversation's finished turn that D
keeps for its next P, by session key, each handed out at most once within its TTL.

Below the modules that read it (the registry's pools, the metrics' result labels); what a
kept turn means on the wire, and the check of a reuse, are router/pd/kept_turn_params.py's.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from router.config import KeptTurnsConfig

__all__ = ["KeptTurn", "KeptTurnResult", "KeptTurnTable"]


class KeptTurnResult(enum.StrEnum):
    """What became of a kept turn (``result`` label of ``pdrouter_kept_turns_total``)."""

    KEPT = "kept"  # a finished turn's params recorded
    REUSED = "reused"  # the new prompt starts with everything D holds
    PARTIAL = "partial"  # a shorter common prefix, its blocks only
    MISMATCH = "mismatch"  # the history was edited: too short a common prefix
    EXPIRED = "expired"  # taken after its TTL
    UNAVAILABLE = "unavailable"  # D gone or unhealthy, or its block size unknown
    OFFERED = "offered"  # pipelined: handed to P, which checks it (connector/kept_turns.py)
    UNEQUAL_TP = "unequal_tp"  # pipelined: P and D of unequal TP sizes; P computes the turn


@dataclass(frozen=True, slots=True)
class KeptTurn:
    """One finished turn on D: its params, the token ids its KV holds, where, until when."""

    params: dict[str, Any]
    token_ids: tuple[int, ...]
    decode_key: str
    expires_at: float


class KeptTurnTable:
    """The kept turns of one model, by session key (the only owner of that state)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: OrderedDict[str, KeptTurn] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, config: KeptTurnsConfig, session: str, params: dict[str, Any],
             token_ids: Sequence[int], decode_key: str) -> None:  # fmt: skip
        """Record a finished turn for ``session`` (replacing an older one: D frees that
        one at its own TTL); the least recently kept entries go first past the bound."""
        expires = self._clock() + config.ttl_seconds
        self._entries.pop(session, None)
        self._entries[session] = KeptTurn(dict(params), tuple(token_ids), decode_key, expires)
        while len(self._entries) > config.max_entries:
            self._entries.popitem(last=False)

    def take(self, session: str) -> KeptTurn | KeptTurnResult | None:
        """The session's kept turn, removed (each is used at most once); ``KeptTurnResult.EXPIRED``
        if its TTL has passed, None if there is none."""
        kept = self._entries.pop(session, None)
        if kept is None:
            return None
        return KeptTurnResult.EXPIRED if self._clock() >= kept.expires_at else kept
