"""Decode slot counts shared by the worker processes of one router (``--workers N``).

The table lives in shared memory (one ``RawArray`` of 64-bit integers) and is
guarded by one process-shared lock. It has a fixed number of entries, each keyed
by a stable 64-bit hash of ``model`` and decode URL (Python's ``hash`` differs
between processes) and allocated on first use, because instances come and go
through config reload and discovery. An entry holds one count per worker and a
total; the total is what bounds the engine, so the bound is exact on one host.

Layout, all int64: ``[holder]`` then per entry ``[key, total, count_0 .. count_{N-1}]``.
``holder`` is the worker id + 1 of the lock holder (0: none), written just after
acquiring and cleared just before releasing, so that the supervisor can free the
lock of a worker killed inside a critical section (see :meth:`SharedSlotTable.reset_worker`).

Reads of ``total`` are lock-free: an aligned int64 load is atomic on the
platforms we run on, and candidate filtering only needs a recent value; the
decision itself (:meth:`WorkerSlots.try_acquire`) is taken under the lock.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import multiprocessing
from typing import Any

__all__ = ["SharedSlotTable", "SlotTableFull", "WorkerSlots", "slot_key"]

log = logging.getLogger("pd_router")

_HEADER = 1  # the holder word
_KEY, _TOTAL, _ROWS = 0, 1, 2  # offsets inside an entry
# A live worker holds the lock for microseconds; a lock held this long by nobody
# we know of belongs to a worker that died between acquiring and marking it.
_STUCK_LOCK_S = 2.0


class SlotTableFull(RuntimeError):
    """Every entry of the shared table is taken by another (model, decode URL)."""


def slot_key(model: str, url: str) -> str:
    """The table key of one decode instance of one model.

    Keyed by model too: two models naming the same URL are separate instances with
    separate slot counts in a single-process router, and stay so here.
    """
    return f"{model}\0{url}"


def _hash(key: str) -> int:
    """A stable, non-zero signed 64-bit hash (0 marks a free entry)."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)
    return h or 1


class SharedSlotTable:
    """Per-worker and total slot counts of every decode instance, in shared memory.

    Create it in the supervisor before starting the workers; each worker uses its
    own view from :meth:`bind`. Picklable for a ``spawn`` start (the array and the
    lock travel as multiprocessing handles).
    """

    def __init__(self, workers: int, capacity: int = 1024, ctx: Any = None) -> None:
        if workers < 1 or capacity < 1:
            raise ValueError("workers and capacity must be at least 1")
        mp = ctx or multiprocessing.get_context()
        self.workers = workers
        self.capacity = capacity
        self._stride = 2 + workers
        self._arr: Any = mp.RawArray(ctypes.c_int64, _HEADER + capacity * self._stride)
        self._lock: Any = mp.Lock()

    def bind(self, worker: int) -> WorkerSlots:
        """The view of worker ``worker`` (0 <= worker < workers)."""
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} out of range 0..{self.workers - 1}")
        return WorkerSlots(self, worker)

    # -- used by the views and the supervisor ----------------------------------

    def _base(self, index: int) -> int:
        return _HEADER + index * self._stride

    def _find(self, h: int, allocate: bool) -> int | None:
        """Index of the entry of hash ``h`` (linear probing); caller holds the lock."""
        arr, cap = self._arr, self.capacity
        start = (h & 0x7FFFFFFFFFFFFFFF) % cap
        for step in range(cap):
            i = (start + step) % cap
            k = arr[self._base(i) + _KEY]
            if k == h:
                return i
            if k == 0:
                if not allocate:
                    return None
                arr[self._base(i) + _KEY] = h
                return i
        if allocate:
            raise SlotTableFull(
                f"the shared slot table is full ({cap} decode instances); "
                "restart the router to clear entries of removed instances"
            )
        return None

    def _enter(self, worker: int) -> None:
        self._lock.acquire()
        self._arr[0] = worker + 1

    def _leave(self) -> None:
        self._arr[0] = 0
        self._lock.release()

    def index(self, key: str, worker: int) -> int:
        """The entry of ``key``, allocated on first use. Raises :class:`SlotTableFull`."""
        h = _hash(key)
        self._enter(worker)
        try:
            found = self._find(h, allocate=True)
        finally:
            self._leave()
        assert found is not None
        return found

    def total_at(self, index: int) -> int:
        """Lock-free read of an entry's total (all workers)."""
        return int(self._arr[self._base(index) + _TOTAL])

    def count_at(self, index: int, worker: int) -> int:
        return int(self._arr[self._base(index) + _ROWS + worker])

    def try_acquire_at(self, index: int, worker: int, limit: int) -> bool:
        base = self._base(index)
        arr = self._arr
        self._enter(worker)
        try:
            if arr[base + _TOTAL] >= limit:
                return False
            # Row first, then total: a worker killed between the two leaves the row
            # ahead, and reset_worker recomputes totals from the rows.
            arr[base + _ROWS + worker] += 1
            arr[base + _TOTAL] += 1
            return True
        finally:
            self._leave()

    def release_at(self, index: int, worker: int) -> None:
        base = self._base(index)
        arr = self._arr
        self._enter(worker)
        try:
            # Guarded: a release can never take another worker's slot.
            if arr[base + _ROWS + worker] > 0:
                arr[base + _ROWS + worker] -= 1
                arr[base + _TOTAL] -= 1
        finally:
            self._leave()

    def reset_worker(self, worker: int) -> None:
        """Zero the row of a worker that is gone (supervisor only, worker dead).

        Frees the lock if the dead worker held it, then recomputes every total as
        the sum of its rows, which also repairs an entry the worker was killed in
        the middle of updating.
        """
        if self._arr[0] == worker + 1:
            self._arr[0] = 0
            self._lock.release()
        if not self._lock.acquire(timeout=_STUCK_LOCK_S):
            # Killed between acquiring and marking: no live worker holds it this long.
            log.error("shared slot lock stuck after worker %d died; freeing it", worker)
            self._lock.release()
            self._lock.acquire()
        self._arr[0] = self.workers + 1  # the supervisor
        try:
            for i in range(self.capacity):
                base = self._base(i)
                if self._arr[base + _KEY] == 0:
                    continue
                self._arr[base + _ROWS + worker] = 0
                rows = self._arr[base + _ROWS : base + _ROWS + self.workers]
                self._arr[base + _TOTAL] = sum(rows)
        finally:
            self._leave()


class WorkerSlots:
    """One worker's view of the shared table: the ledger's interface to it.

    Entry indexes are cached per key: entries are never freed while the table
    lives, so a cached index stays valid.
    """

    def __init__(self, table: SharedSlotTable, worker: int) -> None:
        self.table = table
        self.worker = worker
        self._index: dict[str, int] = {}

    def _idx(self, key: str) -> int:
        i = self._index.get(key)
        if i is None:
            i = self._index[key] = self.table.index(key, self.worker)
        return i

    def try_acquire(self, key: str, limit: int) -> bool:
        """Take one slot of ``key`` if fewer than ``limit`` are taken router-wide."""
        return self.table.try_acquire_at(self._idx(key), self.worker, limit)

    def release(self, key: str) -> None:
        """Give back one slot this worker holds on ``key`` (no-op if it holds none)."""
        self.table.release_at(self._idx(key), self.worker)

    def total(self, key: str) -> int:
        """Slots of ``key`` held by all workers (lock-free, may be a moment old)."""
        return self.table.total_at(self._idx(key))

    def mine(self, key: str) -> int:
        """Slots of ``key`` held by this worker."""
        return self.table.count_at(self._idx(key), self.worker)
