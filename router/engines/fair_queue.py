"""The admission queue: priority classes first, shared fairly between API keys within one.

Each waiter has a class *level* (0 most urgent; :mod:`router.priority` maps a request's
class to it) and may have a TTFT deadline. Waiters queue per (level, key), earliest
deadline first within one (a waiter without a deadline after every one with, then by
arrival). When a slot frees, it goes to the queue whose head has the lowest *effective*
level; among equals, to the key that holds the fewest slots at that moment, and among
keys that hold as many, to the one served least recently (max-min fairness over the
slots, round robin between equals): the ledger ranks the keys (:meth:`SlotLedger.rank
<router.engines.ledger.SlotLedger.rank>`); among keys ranked alike, to the earliest
deadline, then the oldest head. A key that floods the router thus only ever waits behind
itself and more urgent classes, and within a class the queue is earliest-deadline-first.

Aging (why: a lower class must not starve under a steady stream of urgent requests): a
waiter's effective level drops by one for every ``aging`` seconds it has waited, down to
0. A waiter of level L therefore competes as the most urgent class after at most
``L * aging`` seconds, and from then on is served by key fairness and arrival order.

When the queue is full, the key with the most waiters gives up its last one (latest
deadline, else newest) of its least urgent level for a key with fewer (longest queue
drop, :meth:`FairQueue.overflow`), so a flood cannot crowd the others out of the queue
either.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["FairQueue"]

T = TypeVar("T")


@dataclass(slots=True)
class _Entry(Generic[T]):
    arrival: int  # global order of pushes: ties between equal heads
    since: float  # when it was queued (the clock's time): its age, for aging
    item: T
    deadline: float = math.inf  # its TTFT deadline on the clock (inf: none): EDF order

    def order(self) -> tuple[float, int]:
        return self.deadline, self.arrival


_Lane = tuple[int, str]  # (class level, API key name)


class FairQueue(Generic[T]):
    def __init__(
        self,
        rank: Callable[[str], tuple[int, int]],
        clock: Callable[[], float] | None = None,
        aging: float = math.inf,
    ) -> None:
        """``rank(api_key_name)``: lower goes first, read at each choice (the ledger's: slots
        held, then when last served); keys of equal rank in the order their heads arrived.
        ``clock``: the time aging is read from (needed only with a finite ``aging``);
        ``aging``: seconds of waiting that raise a waiter's class by one level."""
        self._rank = rank
        self._clock = clock
        self._aging = aging
        self._lanes: dict[_Lane, list[_Entry[T]]] = {}  # each sorted by _Entry.order
        self._per_name: dict[str, int] = {}
        self._arrivals = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[T]:
        for lane in self._lanes.values():
            for entry in lane:
                yield entry.item

    def set_aging(self, aging: float) -> None:
        self._aging = aging

    def waiting(self, api_key_name: str) -> int:
        return self._per_name.get(api_key_name, 0)

    def push(self, api_key_name: str, item: T, level: int = 0, deadline: float = math.inf) -> None:
        """Queue ``item`` for ``api_key_name`` at ``level``; ``deadline``: when its TTFT
        deadline passes on the clock (inf: none)."""
        since = self._clock() if self._clock is not None else 0.0
        entry = _Entry(next(self._arrivals), since, item, deadline)
        lane = self._lanes.setdefault((level, api_key_name), [])
        bisect.insort(lane, entry, key=_Entry.order)
        self._per_name[api_key_name] = self._per_name.get(api_key_name, 0) + 1
        self._size += 1

    def peek(self) -> T | None:
        """The waiter whose turn it is, or None."""
        lane = self._next_lane()
        return None if lane is None else self._lanes[lane][0].item

    def pop(self) -> T:
        """Remove the waiter whose turn it is now (after anything that changes the slots
        held, take the one :meth:`peek` gave with :meth:`remove`)."""
        lane = self._next_lane()
        if lane is None:
            raise IndexError("pop from an empty FairQueue")
        return self._take(lane, self._lanes[lane][0])

    def remove(self, api_key_name: str, item: T, level: int = 0) -> bool:
        """Take ``item`` (pushed with ``api_key_name`` and ``level``) out wherever it is (a
        waiter gone); False if it was not queued."""
        lane = (level, api_key_name)
        for entry in self._lanes.get(lane, ()):
            if entry.item == item:
                self._take(lane, entry)
                return True
        return False

    def overflow(self, api_key_name: str) -> T | None:
        """The queue is full and ``api_key_name`` wants a place: the last waiter (latest
        deadline, else newest) of the least urgent level of the API key with the most
        waiters, taken out, if that key has more than ``api_key_name`` would have after
        joining (else None: ``api_key_name`` itself is the one over its share)."""
        if not self._per_name:
            return None
        longest = max(self._per_name, key=self._per_name.__getitem__)
        if longest == api_key_name or self._per_name[longest] <= self.waiting(api_key_name) + 1:
            return None
        lane = max(lane for lane in self._lanes if lane[1] == longest)
        return self._take(lane, self._lanes[lane][-1])

    def _take(self, lane: _Lane, entry: _Entry[T]) -> T:
        queue = self._lanes[lane]
        queue.remove(entry)
        if not queue:
            del self._lanes[lane]
        api_key_name = lane[1]
        left = self._per_name[api_key_name] - 1
        if left:
            self._per_name[api_key_name] = left
        else:
            del self._per_name[api_key_name]
        self._size -= 1
        return entry.item

    def _effective(self, lane: _Lane, now: float) -> int:
        """The lane's level, less one per ``aging`` seconds its head has waited."""
        level = lane[0]
        if level == 0 or math.isinf(self._aging):
            return level
        waited = now - self._lanes[lane][0].since
        return max(0, level - int(waited // self._aging))

    def _next_lane(self) -> _Lane | None:
        if not self._lanes:
            return None
        now = self._clock() if self._clock is not None else 0.0
        return min(
            self._lanes,
            key=lambda ln: (
                self._effective(ln, now),
                self._rank(ln[1]),
                self._lanes[ln][0].order(),
            ),
        )
