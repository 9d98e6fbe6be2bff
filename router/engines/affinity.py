"""Soft session affinity: a conversation's turns go back to the P and the D that served its
last turn, whose prefix caches hold its history, until that engine is near its capacity.

For a session key ``k`` and the candidates ``C`` of one role (the instances a request may go
to now, never empty), :meth:`Affinity.select` picks:

1. the instance the session table remembers for ``(k, role)``, if it is in ``C`` and has
   room (``hit``);
2. else the first instance with room in rendezvous-hash order of ``(k, url)`` (``placed``,
   or ``spilled`` when the remembered or the first-hashed instance had no room): every
   router worker and replica maps a key to the same instance without sharing the table,
   and an instance leaving moves only the sessions that were on it;
3. else (no candidate has room) the least loaded candidate, ties broken by that same
   order, so affinity never refuses a request.

**Room** is judged against the engine's capacity, never against the other engines' mean
(the rule before 2026-12, which spilled a session from an engine holding one or two
streams more than the mean, long before it was busy, and cost the conversation its
cache): an instance has room while ``load + 1 <= max(1, floor(spill_at x capacity))``,
``spill_at = sessions.spill_at``. Capacity is a D's ``slots``, and for P (which has no
slots) ``sessions.prefill_capacity`` prompts in flight.

The load is this router's own count, or (several router replicas) what the engines report
(``router/engines/reported.py``, injected as ``load``): replicas reading the same reports
make the same choice, and at low load, where no engine nears its capacity, the choice
depends on no load at all, only on the hash (and each replica's table, whose entries
then agree with it).

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
    SPILLED = "spilled"  # its instance was near its capacity: another one


@dataclass(slots=True)
class _Entry:
    last_used: float
    engines: dict[Role, str] = field(default_factory=dict)  # engine keys (Instance.key)


def _own_load(inst: Instance) -> int:
    return inst.load


def _rank(session: str, engine: str) -> bytes:
    return hashlib.blake2b(f"{session}\0{engine}".encode(), digest_size=8).digest()


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
        self, role: Role, session: str, candidates: Sequence[Instance]
    ) -> tuple[Instance, Placement]:
        """The instance for the ``session`` key among ``candidates`` (never empty), and how it was
        chosen; remembered for the session's next request."""
        now = self._clock()
        self._expire(now)
        entry = self._table.get(session)
        remembered = None
        if entry is not None:
            engine = entry.engines.get(role)
            remembered = next((i for i in candidates if i.key == engine), None)
        if remembered is not None and self._has_room(remembered):
            chosen, how = remembered, Placement.HIT
        else:
            ranked = sorted(candidates, key=lambda i: _rank(session, i.key), reverse=True)
            chosen = next((i for i in ranked if self._has_room(i)), None) or min(
                ranked, key=self._load
            )
            over = remembered if remembered is not None else ranked[0]
            how = Placement.SPILLED if chosen is not over else Placement.PLACED
        self._remember(session, role, chosen.key, now)
        return chosen, how

    def limit(self, inst: Instance) -> int:
        """The most requests ``inst`` may hold, this one included, and still keep (or
        take) a session: ``spill_at`` of its capacity, at least 1."""
        capacity = inst.slots if inst.role is Role.DECODE else self.config.prefill_capacity
        return max(1, math.floor(self.config.spill_at * capacity))

    def _has_room(self, inst: Instance) -> bool:
        return self._load(inst) + 1 <= self.limit(inst)

    def forget(self, session: str) -> None:
        self._table.pop(session, None)

    def _remember(self, session: str, role: Role, engine: str, now: float) -> None:
        entry = self._table.get(session)
        if entry is None:
            entry = self._table[session] = _Entry(now)
            while len(self._table) > self.config.max_sessions:
                self._table.popitem(last=False)
        else:
            self._table.move_to_end(session)
            entry.last_used = now
        entry.engines[role] = engine

    def _expire(self, now: float) -> None:
        """Drop keys unused for ``ttl_seconds`` (the least recently used come first)."""
        limit = now - self.config.ttl_seconds
        while self._table:
            session, entry = next(iter(self._table.items()))
            if entry.last_used > limit:
                return
            del self._table[session]
