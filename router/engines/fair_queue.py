"""The admission queue shared fairly between API keys.

Waiters queue per key, FIFO within a key. When a slot frees, it goes to the key that holds
the fewest slots at that moment, and among keys that hold as many, to the one served least
recently (max-min fairness over the slots, round robin between equals): the ledger ranks
the keys (:meth:`SlotLedger.rank <router.engines.ledger.SlotLedger.rank>`). A key that
floods the router thus only ever waits behind itself: another key's request is served at
the next free slot, as it would be were it alone; keys that all keep requests waiting end
up holding equal shares.

When the queue is full, the key with the most waiters gives up its newest one for a key
with fewer (longest queue drop, :meth:`FairQueue.overflow`), so a flood cannot crowd the
others out of the queue either.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["FairQueue"]

T = TypeVar("T")


class FairQueue(Generic[T]):
    def __init__(self, rank: Callable[[str], tuple[int, int]]) -> None:
        """``rank(key)``: lower goes first, read at each choice (the ledger's: slots held,
        then when last served); keys of equal rank in the order their heads arrived."""
        self._rank = rank
        self._queues: dict[str, deque[tuple[int, T]]] = {}
        self._arrivals = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[T]:
        for queue in self._queues.values():
            for _, item in queue:
                yield item

    def waiting(self, key: str) -> int:
        queue = self._queues.get(key)
        return len(queue) if queue is not None else 0

    def push(self, key: str, item: T) -> None:
        self._queues.setdefault(key, deque()).append((next(self._arrivals), item))
        self._size += 1

    def peek(self) -> T | None:
        """The waiter whose turn it is, or None."""
        key = self._next_key()
        return None if key is None else self._queues[key][0][1]

    def pop(self) -> T:
        """Remove the waiter whose turn it is now (after anything that changes the slots
        held, take the one :meth:`peek` gave with :meth:`remove`)."""
        key = self._next_key()
        if key is None:
            raise IndexError("pop from an empty FairQueue")
        queue = self._queues[key]
        _, item = queue.popleft()
        self._size -= 1
        if not queue:
            del self._queues[key]
        return item

    def remove(self, key: str, item: T) -> bool:
        """Take ``item`` out wherever it is (a waiter gone); False if it was not queued."""
        queue = self._queues.get(key)
        if queue is None:
            return False
        for entry in queue:
            if entry[1] == item:
                queue.remove(entry)
                self._size -= 1
                if not queue:
                    del self._queues[key]
                return True
        return False

    def overflow(self, key: str) -> T | None:
        """The queue is full and ``key`` wants a place: the newest waiter of the key with
        the most waiters, taken out, if that key has more than ``key`` would have after
        joining (else None: ``key`` itself is the one over its share)."""
        if not self._queues:
            return None
        longest = max(self._queues, key=lambda k: len(self._queues[k]))
        if longest == key or len(self._queues[longest]) <= self.waiting(key) + 1:
            return None
        queue = self._queues[longest]
        _, item = queue.pop()
        self._size -= 1
        if not queue:
            del self._queues[longest]
        return item

    def _next_key(self) -> str | None:
        if not self._queues:
            return None
        return min(self._queues, key=lambda k: (self._rank(k), self._queues[k][0][0]))
