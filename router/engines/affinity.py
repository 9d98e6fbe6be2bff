"""Soft session affinity: a conversation's turns go back to the P and the D that served its
last turn, whose prefix caches hold its history, as long as that keeps load within a bound.

For a session key ``k`` and the candidates ``C`` of one role (the instances a request may go
to now, never empty), :meth:`Affinity.select` picks:

1. the instance the session table remembers for ``(k, role)``, if it is in ``C`` and within
   the bound (``hit``);
2. else the first instance within the bound in rendezvous-hash order of ``(k, url)``
   (``placed``, or ``spilled`` when the remembered or the first-hashed instance was over the
   bound): every router worker and replica maps a key to the same instance without sharing
   the table, and an instance leaving moves only the sessions that were on it.

The bound is that of consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam,
2018): with ``L`` the candidates' total load (decode: reserved slots; prefill: legs in
flight) and ``n = |C|``, an instance may take the request while ``load + 1 <= ceil(c(L+1)/n)``,
``c = load_factor >= 1``. The least loaded candidate always satisfies it, so affinity never
refuses a request, and no instance carries more than ``c`` times the average load plus one.

The load is this router's own count, or (several router replicas) what the engines report
(``router/engines/reported.py``, injected as ``load``), so that replicas spill alike.

The table holds at most ``max_sessions`` keys (least recently used dropped first); a key not
used for ``ttl_seconds`` is forgotten.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router.config import SessionConfig
from router.engines.instance import Instance, Role

__all__ = ["Affinity", "Placement"]


class Placement(enum.StrEnum):
    """How a request with a session key was placed (``result`` label of the metric)."""

    HIT = "hit"  # where the session went last time
    PLACED = "placed"  # a new (or forgotten) session, or its instance is gone
    SPILLED = "spilled"  # its instance was over the load bound: another one


@dataclass(slots=True)
class _Entry:
    last_used: float
    urls: dict[Role, str] = field(default_factory=dict)


def _own_load(inst: Instance) -> int:
    return inst.load


def _rank(key: str, url: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()


class Affinity:
    """One model's session table and placement rule (see module doc)."""

    def __init__(
        self,
        config: SessionConfig,
        clock: Callable[[], float],
        load: Callable[[Instance], int] | None = None,
    ) -> None:
        """``load``: an instance's load for the bound (default: this router's own count,
        ``Instance.load``)."""
        self.config = config
        self._clock = clock
        self._load = load or _own_load
        self._table: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def select(
        self, role: Role, key: str, candidates: Sequence[Instance]
    ) -> tuple[Instance, Placement]:
        """The instance for ``key`` among ``candidates`` (never empty), and how it was
        chosen; remembered for the session's next request."""
        now = self._clock()
        self._expire(now)
        entry = self._table.get(key)
        load = self._load
        cap = math.ceil(
            self.config.load_factor * (sum(map(load, candidates)) + 1) / len(candidates)
        )
        remembered = None
        if entry is not None:
            url = entry.urls.get(role)
            remembered = next((i for i in candidates if i.url == url), None)
        if remembered is not None and load(remembered) + 1 <= cap:
            chosen, how = remembered, Placement.HIT
        else:
            ranked = sorted(candidates, key=lambda i: _rank(key, i.url), reverse=True)
            chosen = next(i for i in ranked if load(i) + 1 <= cap)
            over = remembered if remembered is not None else ranked[0]
            how = Placement.SPILLED if chosen is not over else Placement.PLACED
        self._remember(key, role, chosen.url, now)
        return chosen, how

    def forget(self, key: str) -> None:
        self._table.pop(key, None)

    def _remember(self, key: str, role: Role, url: str, now: float) -> None:
        entry = self._table.get(key)
        if entry is None:
            entry = self._table[key] = _Entry(now)
            while len(self._table) > self.config.max_sessions:
                self._table.popitem(last=False)
        else:
            self._table.move_to_end(key)
            entry.last_used = now
        entry.urls[role] = url

    def _expire(self, now: float) -> None:
        """Drop keys unused for ``ttl_seconds`` (the least recently used come first)."""
        limit = now - self.config.ttl_seconds
        while self._table:
            key, entry = next(iter(self._table.items()))
            if entry.last_used > limit:
                return
            del self._table[key]
