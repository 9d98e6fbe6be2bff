"""One engine instance as the router sees it: role, health, outlier state, load."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from connector.address import NixlAddress
from router.config import engine_key
from router.engines.adapters import Adapter
from router.engines.breaker import Breaker, BreakerState
from router.engines.pairing import EngineFacts
from router.errors import NoHealthyEngine

__all__ = ["Instance", "Role", "candidates", "refusal"]

log = logging.getLogger("pd_router.rotation")


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


def _nothing() -> None:
    pass


# The context managers of a leg's counters and deadline are classes, not generators
# (``contextlib.contextmanager``): each leg of every request enters them, and a generator-based
# one costs about seven calls where these cost two.


class _RunningLeg:
    __slots__ = ("_inst",)

    def __init__(self, inst: Instance) -> None:
        self._inst = inst

    def __enter__(self) -> None:
        self._inst.breaker.on_dispatch()
        self._inst._legs_running += 1

    def __exit__(self, *exc: object) -> None:
        self._inst._legs_running -= 1


class _ComputingPrompt:
    __slots__ = ("_inst",)

    def __init__(self, inst: Instance) -> None:
        self._inst = inst

    def __enter__(self) -> None:
        self._inst._prefilling += 1

    def __exit__(self, *exc: object) -> None:
        self._inst._prefilling -= 1


class _Deadline:
    __slots__ = ("_cm", "_deadlines")

    def __init__(self, deadlines: set[asyncio.Timeout], cm: asyncio.Timeout) -> None:
        self._deadlines, self._cm = deadlines, cm

    def __enter__(self) -> None:
        self._deadlines.add(self._cm)

    def __exit__(self, *exc: object) -> None:
        self._deadlines.discard(self._cm)


class _Registered:
    __slots__ = ("_fn", "_set")

    def __init__(self, registered: set[Callable[[], None]], fn: Callable[[], None]) -> None:
        self._set, self._fn = registered, fn

    def __enter__(self) -> None:
        self._set.add(self._fn)

    def __exit__(self, *exc: object) -> None:
        self._set.discard(self._fn)


_NOTHING: contextlib.nullcontext[None] = contextlib.nullcontext()


class Instance:
    """Mutable state of one engine, owned by the router's :class:`Registry`.

    Every field has one writer and is written through a method or setter here, never
    assigned from outside: the counters (``slots_held`` by the ledger, ``legs_running``
    and ``prefilling`` by the legs, ``at_engine`` by the decode leg, ``health_failures``
    and the leak verdict by the health monitor) say in their docstrings who writes them.
    ``slots_held`` (a decode engine's slots) and ``legs_running`` (a prefill engine's
    legs) are two counts, never one name for both; ``load`` reads the one of the role.

    ``healthy`` is None until the first active health check answers; such an
    instance is routable (outlier detection guards it) but does not make
    ``/ready`` pass. ``degraded`` marks a decode engine that holds leaked KV
    blocks while idle.

    Routability is derived, never stored: every change of ``healthy``,
    ``degraded``, ``cap`` or the breaker's state calls ``on_change`` (the decode
    ledger's re-evaluation of its waiters), so nothing that can make a waiter
    fit goes unnoticed. Leaving or rejoining rotation is logged once.
    """

    def __init__(
        self,
        url: str,
        role: Role,
        model: str,
        breaker: Breaker,
        *,
        slots: int = 0,
        healthy: bool | None = None,
        rank: int | None = None,
    ) -> None:
        # ``url``: where its API server answers (shared by the ranks of a data-parallel
        # engine); ``rank``: the data-parallel rank every leg pins (None: no DP); ``key``:
        # this engine's own name, in every per-engine table and log line.
        self.url = url
        self.rank = rank
        self.key = engine_key(url, rank)
        self.role = role
        self.model = model
        self.breaker = breaker
        self._slots = slots  # decode: capacity offered to this router
        # The counters, each written by one method below (see "counters").
        self._slots_held = 0
        self._legs_running = 0
        self._at_engine = 0
        self._prefilling = 0
        self._health_failures = 0
        self._suspect = False
        # The engine's NIXL address: configured (or discovered), else learned from
        # P's responses in push mode. ``kv_host`` overrides the host P reports.
        self.kv_host: str | None = None
        self._block_size: int | None = None
        self._version: str | None = None
        self._adapters: Mapping[str, Adapter] = {}
        self._adapters_changes = 0  # how many times they changed (see learn_adapters)
        self._unpaired: str | None = None
        self._nixl_configured: NixlAddress | None = None
        self._nixl_learned: NixlAddress | None = None
        # Decode, ``--workers N``: reads the router-wide count of this instance from the
        # shared slot table (set by the ledger); None = this process is the router.
        self._shared_in_use: Callable[[], int] | None = None
        self.on_change: Callable[[], None] = _nothing
        self._healthy = healthy
        self._degraded = False
        self._cap: int | None = None
        self._in_rotation = True
        # Deadlines of legs waiting on this engine: cut short when it turns unhealthy.
        self._deadlines: set[asyncio.Timeout] = set()
        # Streams told when this engine is ejected or fails its health checks (migration).
        self._leaving: set[Callable[[], None]] = set()
        breaker.on_change = self._changed
        breaker.name = f"role={role} engine={self.key}"

    def __repr__(self) -> str:
        return f"Instance({self.role.value} {self.key})"

    @property
    def rank_label(self) -> str:
        """The ``rank`` label of its metrics: the data-parallel rank, "" without one."""
        return "" if self.rank is None else str(self.rank)

    # -- state with side effects ----------------------------------------------

    @property
    def healthy(self) -> bool | None:
        return self._healthy

    @healthy.setter
    def healthy(self, value: bool | None) -> None:
        if value == self._healthy:
            return
        self._healthy = value
        if value is False:
            self._cut_deadlines()
        self._changed()

    @property
    def degraded(self) -> bool:
        """Decode: out of rotation while it holds KV blocks with nothing running (a leak);
        written only by :meth:`leak_checked`."""
        return self._degraded

    @property
    def cap(self) -> int | None:
        """Decode, several router replicas: how many requests this replica may hold
        here now (its fair part of what the engine reports free); None = ``slots``."""
        return self._cap

    @cap.setter
    def cap(self, value: int | None) -> None:
        if value != self._cap:
            self._cap = value
            self._changed()

    def watch(self, on_change: Callable[[], None]) -> None:
        """Call ``on_change`` on every change that can make a waiter fit (the ledger)."""
        self.on_change = on_change

    def detach(self) -> None:
        """No longer watched (dropped by a reload or discovery)."""
        self.on_change = _nothing

    def _changed(self) -> None:
        now = self.in_rotation
        if now != self._in_rotation:
            self._in_rotation = now
            if now:
                log.warning("event=rotation_in role=%s engine=%s", self.role, self.key)
            else:
                log.warning(
                    "event=rotation_out role=%s engine=%s reason=%r",
                    self.role,
                    self.key,
                    self.why_out(),
                )
                if self._leaving and self.ejected:
                    for tell in list(self._leaving):
                        tell()
        self.on_change()

    @property
    def ejected(self) -> bool:
        """Out for failing its health checks or by outlier detection (the engine is in
        doubt; not leaked KV, a capacity matter, nor a missing partner)."""
        return self._healthy is False or self.breaker.state is BreakerState.OPEN

    def leaving(self, tell: Callable[[], None]) -> AbstractContextManager[None]:
        """While entered, ``tell()`` is called when this engine leaves rotation
        :attr:`ejected` (a migrating stream on it moves on, router/pd/migration.py)."""
        return _Registered(self._leaving, tell)

    # -- NIXL address ---------------------------------------------------------------

    @property
    def nixl(self) -> NixlAddress | None:
        """Where this engine's KV connector is reached: as configured, else as learned."""
        return self._nixl_configured or self._nixl_learned

    def configure_nixl(self, address: NixlAddress | None, kv_host: str | None) -> None:
        """Set from the config (or discovery); a learned address is kept only while
        none is configured."""
        self._nixl_configured = address
        self.kv_host = kv_host

    def learn_nixl(self, params: dict[str, Any]) -> NixlAddress | None:
        """Learn the address P reported in its ``kv_transfer_params`` (``kv_host``
        replacing its host); returns it, or None if the params lack one."""
        address = NixlAddress.from_params(params, self.kv_host)
        if address is not None:
            self._nixl_learned = address
        return address

    def forget_nixl(self) -> None:
        """Drop a learned address after a failure: the engine may have restarted with
        another engine id. A configured address stays."""
        self._nixl_learned = None

    # -- derived ----------------------------------------------------------------

    # -- what the engine runs, and whether it has a partner -------------------------------

    @property
    def facts(self) -> EngineFacts:
        """Its vLLM version and block size, as far as read (router/engines/pairing.py)."""
        return EngineFacts(self._version, self._block_size)

    def learn_version(self, version: str | None) -> None:
        """The engine's ``/version`` (the health monitor's, when it joins or comes back)."""
        self._version = version

    @property
    def adapters(self) -> Mapping[str, Adapter]:
        """The LoRA adapters the engine holds, by name, as last read from its ``/v1/models``
        (router/engines/adapters.py); empty until read, or for a model with ``lora`` off.
        Kept while the engine is out: read again when it comes back."""
        return self._adapters

    @property
    def adapters_changes(self) -> int:
        """How many times :attr:`adapters` changed: a reader notes it before it asks."""
        return self._adapters_changes

    def learn_adapters(self, adapters: Mapping[str, Adapter], since: int | None = None) -> bool:
        """Set by the facts reader (what the engine lists), and by the adapter loader once a
        load succeeded (router/engines/adapter_loads.py: the next read confirms it); True
        when they changed. ``since``: the reader's :attr:`adapters_changes` when it asked; a
        list asked for before a later change (a load that ended meanwhile) is older than
        what is known, and ignored. A change may make a waiter fit (a D that now holds its
        adapter), so the ledger is told."""
        if adapters == self._adapters or (since is not None and since != self._adapters_changes):
            return False
        self._adapters = dict(adapters)
        self._adapters_changes += 1
        self._changed()
        return True

    @property
    def unpaired(self) -> str | None:
        """Why no engine of the other role can pair with this one (its pool's check, on
        every change of its engines or their facts); None: it has a partner."""
        return self._unpaired

    def set_unpaired(self, reason: str | None) -> None:
        if reason != self._unpaired:
            self._unpaired = reason
            self._changed()

    @property
    def routable(self) -> bool:
        """May get a request now (a half-open breaker: only its one trial)."""
        return self.in_service and self.breaker.allows()

    @property
    def in_service(self) -> bool:
        return self._healthy is not False and not self._degraded and self._unpaired is None

    @property
    def in_rotation(self) -> bool:
        """Not out for health, leaked KV or ejection: may take requests now or once
        a half-open trial ends (``admissible`` when it is the last of its role)."""
        return self.in_service and self.breaker.state is not BreakerState.OPEN

    @property
    def up_but_degraded(self) -> bool:
        """Out only for leaked KV blocks: still serves when no other is in rotation."""
        return (
            self._degraded
            and self._healthy is not False
            and self._unpaired is None
            and self.breaker.state is not BreakerState.OPEN
        )

    def why_out(self) -> str:
        if self._healthy is False:
            return "failed health checks"
        if self._unpaired is not None:
            return f"no engine to pair with: {self._unpaired}"
        if self._degraded:
            return "holds leaked KV blocks"
        return "ejected by outlier detection"

    def back_in(self, now: float, probe_interval: float) -> float:
        """Seconds until this instance may be back in rotation at the earliest."""
        if self.in_service and self.breaker.state is BreakerState.OPEN:
            return max(0.0, self.breaker.reopens_at - now)
        return 0.0 if self.in_rotation else probe_interval

    # -- counters: each has one writer, named in its docstring ------------------------

    @property
    def slots(self) -> int:
        """Decode: the slots this engine offers the router (the registry sets it)."""
        return self._slots

    def set_slots(self, slots: int) -> None:
        self._slots = slots

    @property
    def slots_held(self) -> int:
        """Decode: slots this process holds here (the ledger's reservations)."""
        return self._slots_held

    def take_slot(self) -> None:
        """The ledger granted a reservation here: a request is sent (in the breaker's
        half-open state, the one trial)."""
        self._slots_held += 1
        self.breaker.on_dispatch()

    def give_slot(self) -> None:
        """The ledger released a reservation here."""
        self._slots_held -= 1

    @property
    def legs_running(self) -> int:
        """Prefill: P legs sent here whose answer is not read yet."""
        return self._legs_running

    def running_leg(self) -> AbstractContextManager[None]:
        """One P leg runs here for the length of the block (router/pd/legs.py); sending it
        is, in the breaker's half-open state, the one trial. The instance is the breaker's
        only caller of ``on_dispatch``: here for P, in :meth:`take_slot` for D."""
        return _RunningLeg(self)

    @property
    def at_engine(self) -> int:
        """Streams with first bytes in and no end seen yet: decode, and a prefill engine's
        P-alone requests (router/pd/adaptive.py); router/engines/load.py subtracts them
        from the engine's own report."""
        return self._at_engine

    def stream_started(self) -> None:
        """A streaming D leg's first bytes are in (router/pd/legs.py's DecodeLeg)."""
        self._at_engine += 1

    def stream_ended(self) -> None:
        """That leg's end was read, or it was closed."""
        self._at_engine -= 1

    @property
    def prefilling(self) -> int:
        """Legs that compute their own prompt, still before their first bytes: D alone on a
        decode engine, P alone (router/pd/adaptive.py) on a prefill engine."""
        return self._prefilling

    def computing_prompt(self, computes: bool) -> AbstractContextManager[None]:
        """A D leg before its first bytes; it counts in ``prefilling`` if it ``computes``
        the prompt (D alone)."""
        return _ComputingPrompt(self) if computes else _NOTHING

    @property
    def health_failures(self) -> int:
        """Health checks failed in a row (the health monitor's)."""
        return self._health_failures

    def probed(self, ok: bool) -> int:
        """One health check's result; returns the failures in a row."""
        self._health_failures = 0 if ok else self._health_failures + 1
        return self._health_failures

    # -- the leak watch: ``suspect`` and ``degraded``, written by these two methods only --

    @property
    def suspect(self) -> bool:
        """Decode: a leg was closed while it waited for KV; it may have leaked blocks
        (vLLM 0.32's push connector) until the health monitor's leak check says."""
        return self._suspect

    def suspect_leak(self) -> None:
        """A leg here was closed while it waited for KV (router/pd/plans.py): watch it. Only
        :meth:`leak_checked` clears the suspicion."""
        self._suspect = True

    def leak_checked(self, leaked: bool) -> None:
        """The health monitor's verdict on an idle engine: ``degraded`` (and still
        ``suspect``) while it leaks, cleared of both once it does not."""
        self._suspect = leaked
        if leaked != self._degraded:
            self._degraded = leaked
            self._changed()

    @property
    def block_size(self) -> int | None:
        """KV tokens per block, once learned from the engine's ``/metrics``."""
        return self._block_size

    def learn_block_size(self, block_size: int | None) -> None:
        self._block_size = block_size

    def share_slots(self, total: Callable[[], int]) -> None:
        """``--workers N``: ``in_use`` reads ``total()``, the router-wide count (the ledger)."""
        if self._shared_in_use is None:
            self._shared_in_use = total

    @property
    def load(self) -> int:
        """What this router runs here: slots held router-wide (decode); legs, and requests
        served alone, on a prefill engine."""
        if self.role is Role.DECODE:
            return self.in_use
        return self._legs_running + self._prefilling + self._at_engine

    # -- capacity -----------------------------------------------------------------

    @property
    def limit(self) -> int:
        """Slots this router may hold here now (``slots``, or its replica ``cap``)."""
        return self.slots if self._cap is None else min(self.slots, self._cap)

    @property
    def in_use(self) -> int:
        """Decode: slots held here by the whole router: every worker's with a shared
        table, else this process's ``slots_held``."""
        shared = self._shared_in_use
        return self._slots_held if shared is None else shared()

    @property
    def free_slots(self) -> int:
        return self.limit - self.in_use

    # -- legs ---------------------------------------------------------------------

    def deadline(self, cm: asyncio.Timeout) -> AbstractContextManager[None]:
        """Register an entered ``asyncio.timeout`` of a leg on this engine: if the
        health monitor declares the engine unhealthy meanwhile, it expires at once."""
        return _Deadline(self._deadlines, cm)

    def _cut_deadlines(self) -> None:
        if not self._deadlines:
            return
        loop_time = asyncio.get_event_loop().time
        for cm in list(self._deadlines):
            with contextlib.suppress(RuntimeError):  # already expiring
                cm.reschedule(loop_time())


def candidates(instances: Sequence[Instance]) -> list[Instance]:
    """The instances of one role that requests may go to now, best tier first: past
    their breaker; else (panic) half-open ones beyond their single trial; else (panic)
    decode engines that hold leaked KV blocks, which cost capacity, not correctness:
    taking the last one out for them would be an outage. Empty: refuse at once."""
    for tier in (
        [i for i in instances if i.routable],
        [i for i in instances if i.in_rotation],
        [i for i in instances if i.up_but_degraded],
    ):
        if tier:
            return tier
    return []


def refusal(
    role: Role, model: str, instances: Sequence[Instance], now: float, probe_interval: float
) -> NoHealthyEngine:
    """The 503 for a role with no candidate, its Retry-After the earliest return; where every
    engine of the role is up but has no partner, why (``no_compatible_pair``)."""
    waits = [i.back_in(now, probe_interval) for i in instances]
    unpaired = [i.unpaired for i in instances if i.healthy is not False]
    why = None
    if unpaired and all(unpaired):
        why = "; ".join(sorted({u for u in unpaired if u is not None}))
    return NoHealthyEngine(role.value, model, min(waits, default=probe_interval), why)
