"""The decode slot ledger: "decode slot first".

Before any upstream call, a request reserves a slot on one decode engine. The
ledger is the single writer of every decode instance's ``slots_held`` count. When
no slot is free the request waits in a bounded queue shared fairly between API keys
(:mod:`router.engines.fair_queue`: FIFO per key, a freed slot to the key holding the
fewest, the one served least recently among equals); a full queue answers 429 (to the
key holding the most of it), a wait past ``max_wait`` answers 503, both with
``Retry-After``. A
reservation is released exactly once, on every exit path (the dispatcher holds it
in a ``try/finally``); a waiter cancelled after being handed a slot gives it back.

With ``--workers N`` each worker has its own ledger (queue, policy) and all of them
share a :class:`~router.shared_slots.WorkerSlots` table: an instance's free slots
come from the router-wide total, a reservation is taken with ``try_acquire`` (on a
lost race the next candidate is tried) and a release gives it back there. The
queue is fair per worker, not across workers.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router.engines.affinity import Affinity, Placement
from router.engines.breaker import BreakerState
from router.engines.fair_queue import FairQueue
from router.engines.instance import Instance, Role, candidates, refusal
from router.engines.policies import Policy
from router.engines.selection import Selection, select
from router.errors import (
    DeadlineExceeded,
    DeadlineUnattainable,
    FairShareExceeded,
    NoCapacity,
    NoHealthyEngine,
    QueueFull,
)
from router.shared_slots import WorkerSlots, slot_key

__all__ = ["Deadline", "Reservation", "SlotLedger"]

_ANYONE = Selection()  # no routing key, session, chooser or API key name: the policy's pick

# Waiters re-check the shared table this often while (and only while) this worker
# has waiters. Why a poller rather than a pipe or eventfd per worker: a release in
# another worker would otherwise cost a write syscall on every release, waiters or
# not, plus N x N descriptors kept across restarts; waiting only happens when the
# engines are full, where a few milliseconds are small next to a decode stream
# (seconds), and an idle or unsaturated worker pays nothing.
_SHARED_POLL_S = 0.005

# The weight of a new slot hold time in its moving average: about the last ten streams.
_HOLD_WEIGHT = 0.2


@dataclass(eq=False, slots=True)
class Reservation:
    instance: Instance
    released: bool = False
    detached: bool = False  # handed to a background owner that releases it later
    placement: Placement | None = None  # how a request with a session key got this D
    api_key_name: str = ""  # the API key's name (slots held per key: the fair queue's order)
    taken_at: float = 0.0  # when the slot was taken (the ledger's clock): its hold time


@dataclass(frozen=True, slots=True)
class Deadline:
    """A request's TTFT deadline: ``at`` on the ledger's clock; ``ms`` as given (for the
    refusal's message); ``service_s``: its predicted time to first token once it holds a
    slot (the prompt's learned compute time; 0 when unknown)."""

    at: float
    ms: float
    service_s: float = 0.0


@dataclass(eq=False, slots=True)
class _Waiter:
    fut: asyncio.Future[Reservation]
    selection: Selection  # its api_key_name: whose turn in the fair queue
    level: int = field(default=0)  # the priority class's level: 0 most urgent (router/priority.py)
    deadline_at: float = field(default=math.inf)  # its TTFT deadline on the clock (inf: none)
    allowed: Callable[[Instance], bool] | None = field(default=None)  # see reserve

    @property
    def api_key_name(self) -> str:
        return self.selection.api_key_name


class SlotLedger:
    """Reservations on one model's decode instances."""

    def __init__(
        self,
        model: str,
        instances: Sequence[Instance],
        policy: Policy,
        queue_size: int,
        max_wait: float,
        shared: WorkerSlots | None = None,
        *,
        probe_interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        affinity: Affinity | None = None,
        aging: float = math.inf,
    ) -> None:
        """``probe_interval``: the health-check interval, the Retry-After of a refusal
        while every decode instance is out for health. ``affinity``: the model's session
        table, which places requests that carry a session key (else ``policy``).
        ``aging``: seconds of waiting that raise a waiter's class by one level."""
        self.model = model
        self._affinity = affinity
        self._shared = shared
        self._poll: asyncio.TimerHandle | None = None
        self._reopen: asyncio.TimerHandle | None = None
        self._probe_interval = probe_interval
        self._clock = clock
        self._instances: list[Instance] = []
        self._policy = policy
        self._queue_size = queue_size
        self._max_wait = max_wait
        self._held: dict[str, int] = {}  # slots held per API key name
        self._granted: dict[str, int] = {}  # per API key name: when it last got a slot
        self._grants = itertools.count()
        self._hold_s: float | None = None  # moving average of how long a slot is held
        self._live: set[Reservation] = set()  # held now: when each slot is expected back
        self._waiters: FairQueue[_Waiter] = FairQueue(self.rank, clock, aging)
        self._poking = False
        self._again = False
        self.set_instances(instances)

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    def held(self, api_key_name: str) -> int:
        """Decode slots the API key named ``api_key_name`` holds in this ledger."""
        return self._held.get(api_key_name, 0)

    def rank(self, api_key_name: str) -> tuple[int, int]:
        """The fair queue's order: slots held, then the last grant (-1: never)."""
        return self._held.get(api_key_name, 0), self._granted.get(api_key_name, -1)

    @property
    def instances(self) -> Sequence[Instance]:
        return self._instances

    @property
    def slots_in_use(self) -> int:
        return sum(i.slots_held for i in self._instances)

    def set_instances(self, instances: Sequence[Instance]) -> None:
        """Replace the decode instances (reload, discovery); waiters may now fit."""
        wanted = list(instances)
        for gone in set(self._instances) - set(wanted):
            gone.detach()
        self._instances = wanted
        for inst in wanted:
            inst.watch(self.poke)
        self._attach(wanted)
        self.poke()

    def set_policy(self, policy: Policy) -> None:
        self._policy = policy

    def set_limits(
        self, queue_size: int, max_wait: float, probe_interval: float, aging: float = math.inf
    ) -> None:
        self._queue_size = queue_size
        self._max_wait = max_wait
        self._probe_interval = probe_interval
        self._waiters.set_aging(aging)

    async def reserve(
        self,
        selection: Selection = _ANYONE,
        *,
        level: int = 0,
        deadline: Deadline | None = None,
        allowed: Callable[[Instance], bool] | None = None,
    ) -> Reservation:
        """A slot on a routable decode instance that ``allowed`` admits (when given: an
        adapter request's holders), among those with a free slot, chosen for ``selection``
        by :func:`~router.engines.selection.select`. ``selection.api_key_name`` and
        ``level`` (the priority class's level, 0 most urgent) are the request's place in
        the queue (:mod:`router.engines.fair_queue`).

        Raises :class:`NoHealthyEngine` (none in rotation), :class:`QueueFull`,
        :class:`DeadlineExceeded` (``deadline`` passed before a slot was given: none is
        taken) or :class:`NoCapacity` (no slot freed within ``max_wait``). Cancellation-safe.
        """
        self.poke()  # waiters refused if none is in rotation, else served first
        usable = self._usable(allowed)
        wait = self._wait_for(deadline, level, usable)
        if not self._waiters:
            got = self._take(usable, selection)  # usable: allowed already
            if got is not None:
                return got
        return await self._queue(selection, level, deadline, allowed, wait)

    def _usable(self, allowed: Callable[[Instance], bool] | None) -> list[Instance]:
        """The decode engines in rotation that ``allowed`` admits; refused if none."""
        usable = candidates(self._instances)
        if allowed is not None:
            usable = [i for i in usable if allowed(i)]
        if not usable:
            raise self._refusal()
        return usable

    def _wait_for(self, deadline: Deadline | None, level: int, usable: list[Instance]) -> float:
        """How long the request may wait for a slot: ``max_wait``, or less to meet its
        deadline (refused now if that is already past or cannot be met)."""
        if deadline is None:
            return self._max_wait
        wait = min(self._max_wait, deadline.at - self._clock())
        if wait <= 0:
            raise self._missed(deadline)
        self._check_attainable(deadline, level, usable)
        return wait

    async def _queue(
        self,
        selection: Selection,
        level: int,
        deadline: Deadline | None,
        allowed: Callable[[Instance], bool] | None,
        wait: float,
    ) -> Reservation:
        """Wait in the fair queue for a slot, at most ``wait`` seconds."""
        api_key_name = selection.api_key_name
        if len(self._waiters) >= self._queue_size:
            self._make_room(api_key_name)
        fut = asyncio.get_running_loop().create_future()
        at = math.inf if deadline is None else deadline.at
        waiter = _Waiter(fut, selection, level, at, allowed)
        self._waiters.push(api_key_name, waiter, level, at)
        self._schedule_poll()
        self._arm_reopen()
        try:
            async with asyncio.timeout(wait):
                return await waiter.fut
        except TimeoutError:
            self._reclaim(waiter)
            if deadline is not None and wait < self._max_wait:
                raise self._missed(deadline) from None
            raise self._no_capacity() from None
        except asyncio.CancelledError:
            self._reclaim(waiter)
            raise
        finally:
            self._waiters.remove(api_key_name, waiter, level)

    def _no_capacity(self) -> NoCapacity:
        return NoCapacity(
            f"no decode slot for model {self.model!r} became free within {self._max_wait:g}s",
            retry_after=min(self._max_wait, 5.0),
        )

    def _make_room(self, api_key_name: str) -> None:
        """The queue is full: the key holding the most of it gives up its newest waiter
        for ``api_key_name``, unless that is the key (then it is refused)."""
        victim = self._waiters.overflow(api_key_name)
        if victim is not None:
            if not victim.fut.done():
                victim.fut.set_exception(self._share_exceeded(victim.api_key_name))
            return
        others = any(True for w in self._waiters if w.api_key_name != api_key_name)
        if others:
            raise self._share_exceeded(api_key_name)
        raise QueueFull(
            f"all decode slots for model {self.model!r} are busy and the queue is full",
            retry_after=1.0,
        )

    @property
    def hold_s(self) -> float | None:
        """How long a decode slot is held, a moving average over recent releases (None
        before the first): the queue's turnover, for predicted waits."""
        return self._hold_s

    def predicted_wait(
        self,
        level: int,
        deadline_at: float = math.inf,
        usable: list[Instance] | None = None,
    ) -> tuple[float, int]:
        """A new waiter's predicted wait for a slot and how many wait before it: those of a
        more urgent level, and those of its level whose deadline is not later (the
        queue's order, aging aside).

        Each held slot is expected back ``hold`` (the moving average) after it was taken,
        a free one at once; the k-th in line (0: the first) gets the (k mod slots)-th of
        those times, plus ``hold`` for every full round of the slots before it. 0 s while a
        slot is free and none waits, or before any hold time is known (nothing to predict
        from). Slots another worker holds (``--workers``) count as free: optimistic, so a
        refusal is never the price of not seeing them. ``usable``: the decode instances the
        request may take a slot on (default: every routable one)."""
        ahead = sum(
            1
            for w in self._waiters
            if not w.fut.done()
            and (w.level < level or (w.level == level and w.deadline_at <= deadline_at))
        )
        hold = self._hold_s
        if usable is None:
            usable = candidates(self._instances)
        capacity = sum(i.limit for i in usable)
        free = any(i.free_slots > 0 for i in usable)
        if hold is None or capacity == 0 or (free and ahead == 0):
            return 0.0, ahead
        now = self._clock()
        back = sorted(
            max(0.0, r.taken_at + hold - now) for r in self._live if r.instance in usable
        )[:capacity]
        back = [0.0] * (capacity - len(back)) + back
        rounds, place = divmod(ahead, capacity)
        return back[place] + rounds * hold, ahead

    def _check_attainable(self, deadline: Deadline, level: int, usable: list[Instance]) -> None:
        """Refuse at once a request whose predicted TTFT (:meth:`predicted_wait` plus
        ``deadline.service_s``) ends past its deadline: it would only take a place, then
        a slot, a prefill and a decode, for an answer its client no longer wants."""
        wait, ahead = self.predicted_wait(level, deadline.at, usable)
        predicted = wait + deadline.service_s
        if self._clock() + predicted > deadline.at:
            raise DeadlineUnattainable(
                self.model, deadline.ms, predicted * 1000, ahead, retry_after=max(1.0, wait)
            )

    def _missed(self, deadline: Deadline) -> DeadlineExceeded:
        # Retry-After 1 s: the queue turns over in about a stream's time; a later try may fit.
        return DeadlineExceeded(self.model, deadline.ms, retry_after=1.0)

    def _share_exceeded(self, api_key_name: str) -> FairShareExceeded:
        return FairShareExceeded(
            f"all decode slots for model {self.model!r} are busy and API key {api_key_name!r} "
            "holds the largest share of the full queue",
            retry_after=1.0,
        )

    def release(self, reservation: Reservation) -> None:
        """Give the slot back (idempotent) and hand it to the oldest waiter."""
        if reservation.released:
            return
        reservation.released = True
        self._live.discard(reservation)
        self._observe_hold(self._clock() - reservation.taken_at)
        inst = reservation.instance
        inst.give_slot()
        held = self._held[reservation.api_key_name] - 1
        if held:
            self._held[reservation.api_key_name] = held
        else:
            del self._held[reservation.api_key_name]
        if self._shared is not None:
            self._shared.release(slot_key(self.model, inst.key))
        self.poke()

    def _observe_hold(self, seconds: float) -> None:
        old = self._hold_s
        self._hold_s = seconds if old is None else old + _HOLD_WEIGHT * (seconds - old)

    def poke(self) -> None:
        """Re-evaluate the waiters: serve them in FIFO order while capacity lasts,
        refuse them all if no decode instance is in rotation any more.

        Re-entrant calls (an instance that changes state while being read here)
        are folded into one more pass of the outer call.
        """
        if self._poking:
            self._again = True
            return
        self._poking = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._serve()
        finally:
            self._poking = False
        self._arm_reopen()

    def _serve(self) -> None:
        while (head := self._waiters.peek()) is not None:
            if head.fut.done():
                self._waiters.remove(head.api_key_name, head, head.level)
                continue
            usable = candidates(self._instances)
            if not usable:
                self._refuse_all()
                return
            got = self._take(usable, head.selection, head.allowed)
            if got is None:
                return
            # By identity: taking the slot changed what the queue would pick next.
            self._waiters.remove(head.api_key_name, head, head.level)
            head.fut.set_result(got)

    def _refuse_all(self) -> None:
        while self._waiters:
            waiter = self._waiters.pop()
            if not waiter.fut.done():
                waiter.fut.set_exception(self._refusal())

    def _take(
        self,
        usable: list[Instance],
        selection: Selection,
        allowed: Callable[[Instance], bool] | None = None,
    ) -> Reservation | None:
        free = [i for i in usable if i.free_slots > 0 and (allowed is None or allowed(i))]
        name = selection.api_key_name
        while free:
            inst, placement = select(Role.DECODE, free, selection, self._policy, self._affinity)
            if self._acquire(inst):
                inst.take_slot()
                self._held[name] = self._held.get(name, 0) + 1
                self._granted[name] = next(self._grants)
                got = Reservation(
                    inst, placement=placement, api_key_name=name, taken_at=self._clock()
                )
                self._live.add(got)
                return got
            # Another worker took the last slot between our read and its lock.
            free.remove(inst)
        return None

    def _refusal(self) -> NoHealthyEngine:
        return refusal(
            Role.DECODE, self.model, self._instances, self._clock(), self._probe_interval
        )

    def _arm_reopen(self) -> None:
        """While requests wait: wake up when the earliest ejection ends by itself."""
        if self._reopen is not None:
            self._reopen.cancel()
            self._reopen = None
        if not self._waiters:
            return
        ends = [
            i.breaker.reopens_at
            for i in self._instances
            if i.in_service and i.breaker.state is BreakerState.OPEN
        ]
        if ends:
            delay = max(0.001, min(ends) - self._clock())
            self._reopen = asyncio.get_running_loop().call_later(delay, self._on_reopen)

    def _on_reopen(self) -> None:
        self._reopen = None
        self.poke()

    def _acquire(self, inst: Instance) -> bool:
        """Take the slot router-wide (always granted without a shared table)."""
        if self._shared is None:
            return True
        return self._shared.try_acquire(slot_key(self.model, inst.key), inst.limit)

    def _attach(self, instances: Sequence[Instance]) -> None:
        """Make ``free_slots`` of these instances read the shared total."""
        shared = self._shared
        if shared is None:
            return
        for inst in instances:
            inst.share_slots(functools.partial(shared.total, slot_key(self.model, inst.key)))

    def _schedule_poll(self) -> None:
        if self._shared is not None and self._poll is None:
            self._poll = asyncio.get_running_loop().call_later(_SHARED_POLL_S, self._on_poll)

    def _on_poll(self) -> None:
        """Serve waiters with slots released by other workers; re-arm while any wait."""
        self._poll = None
        self.poke()
        if self._waiters:
            self._schedule_poll()

    def _reclaim(self, waiter: _Waiter) -> None:
        fut = waiter.fut
        if not fut.done():
            fut.cancel()
        elif not fut.cancelled() and fut.exception() is None:  # retrieves a refusal too
            self.release(fut.result())
