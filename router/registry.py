"""Model pools: each model's prefill and decode instances, policies and ledger.
The registry is the single owner of instance state.

Pools are reconciled, not rebuilt: :meth:`Registry.apply` (config reload) and
:meth:`Registry.set_instances` (service discovery) keep the :class:`Instance`
objects of engines that stay, so their load, health and breaker survive, add new
ones and drop vanished ones. A dropped instance is no longer selected; requests
already on it keep their reference and finish normally.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from connector.address import NixlAddress
from router.config import (
    DecodeInstanceConfig,
    Mode,
    ModelConfig,
    PrefillInstanceConfig,
    RouterConfig,
    engine_key,
)
from router.engines.adapters import Adapter
from router.engines.affinity import Affinity, Placement
from router.engines.breaker import Breaker
from router.engines.instance import Instance, Role, candidates
from router.engines.kept_turns import KeptTurnTable
from router.engines.ledger import SlotLedger
from router.engines.pairing import mismatch
from router.engines.policies import Policy, make_policy
from router.engines.reported import own_load
from router.engines.selection import Selection, select
from router.engines.timings import Timings
from router.errors import Fault
from router.shared_slots import WorkerSlots

__all__ = ["ModelPool", "PrefillLease", "Registry"]

_C = TypeVar("_C", PrefillInstanceConfig, DecodeInstanceConfig)


@dataclass(frozen=True, slots=True)
class PrefillLease:
    """The prefill instance one attempt runs on, as :meth:`ModelPool.select_prefill` gives
    it (the decode side's is the ledger's :class:`~router.engines.ledger.Reservation`).
    P has no slots: there is nothing to give back; its legs count themselves
    (``Instance.running_leg``)."""

    instance: Instance
    placement: Placement | None = None  # how a request with a session key got this P


@dataclass(eq=False)
class ModelPool:
    config: ModelConfig
    prefill: list[Instance]
    ledger: SlotLedger  # owns the decode instances: ``decode`` reads its list
    prefill_policy: Policy
    affinity: Affinity
    kept_turns: KeptTurnTable
    # Recent prefill and step times (the adaptive choice's estimates; the dispatcher writes).
    timings: Timings = field(default_factory=Timings)
    # An engine's load from every router replica (engine-reported with several replicas).
    load: Callable[[Instance], int] = own_load

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def mode(self) -> Mode:
        return self.config.mode

    @property
    def decode(self) -> Sequence[Instance]:
        """The decode instances, as the slot ledger holds them (their one owner)."""
        return self.ledger.instances

    @property
    def routing_key_needed(self) -> bool:
        return self.prefill_policy.needs_routing_key

    def select_prefill(
        self,
        selection: Selection,
        *,
        decode: Instance | None = None,
        allowed: Callable[[Instance], bool] | None = None,
    ) -> PrefillLease | None:
        """A prefill instance from the best tier of :func:`candidates` that can pair with
        ``decode`` (when given) and that ``allowed`` admits (when given: an adapter
        request's holders, :meth:`adapter_filter`), chosen for ``selection`` by
        :func:`~router.engines.selection.select`. None if there is none (P has no queue
        to wait in)."""
        usable = candidates(self.prefill)
        if allowed is not None:
            usable = [p for p in usable if allowed(p)]
        if decode is not None:
            usable = [p for p in usable if self.pair_mismatch(p, decode) is None]
        if not usable:
            return None
        return PrefillLease(
            *select(Role.PREFILL, usable, selection, self.prefill_policy, self.affinity)
        )

    def session_key(self, session: str | None, prefix: Callable[[], str]) -> str | None:
        """The affinity key of a request: its session id, else (with ``prefix_fallback``)
        its prompt's start, read from ``prefix`` only then; None when affinity is off."""
        cfg = self.config.sessions
        if not cfg.enabled:
            return None
        if session is not None:
            return session
        start = prefix() if cfg.prefix_fallback else ""
        return f"prefix:{start}" if start else None

    def record(self, inst: Instance, fault: Fault | None) -> None:
        """Feed one engine call's outcome (None: success) to the instance's outlier
        detection. An error answer may eject the instance only while another
        instance of its role stays in rotation (the panic threshold)."""
        if fault is None:
            inst.breaker.record(None)
            return
        may_eject = fault is not Fault.ANSWER or any(
            o is not inst and o.in_rotation for o in self.of_role(inst.role)
        )
        inst.breaker.record(fault, may_eject=may_eject)

    def has_alternative(self, role: str, avoid: frozenset[Instance]) -> bool:
        """Whether an instance of ``role`` outside ``avoid`` is in rotation (a retry
        can go somewhere new)."""
        return any(i.in_rotation and i not in avoid for i in self.of_role(Role(role)))

    def of_role(self, role: Role) -> Sequence[Instance]:
        return self.prefill if role is Role.PREFILL else self.decode

    def has_healthy_pair(self) -> bool:
        """``/ready``: a healthy D (and in P/D modes a healthy P it can pair with)."""
        decode = [d for d in self.decode if d.healthy is True and not d.degraded]
        if not self.mode.uses_prefill:
            return bool(decode)
        prefill = [p for p in self.prefill if p.healthy is True]
        return any(self.pair_mismatch(p, d) is None for d in decode for p in prefill)

    # -- LoRA adapters (router/engines/adapters.py) ------------------------------

    def serves_adapter(self, adapter: str) -> bool:
        """Whether an adapter request may be routed here at all: some D holds it and, in a
        disaggregated mode, some P holding it can pair with such a D (health aside: an
        engine out for now refuses with a 503, not a 404). Off (``lora.enabled`` false):
        never. An adapter the router may load itself (``lora.modules``) always may."""
        if not self.config.lora.enabled:
            return False
        if adapter in self.config.lora.modules:
            return True
        decode = [d for d in self.decode if adapter in d.adapters]
        if not self.mode.uses_prefill:
            return bool(decode)
        prefill = [p for p in self.prefill if adapter in p.adapters]
        return any(self.pair_mismatch(p, d) is None for d in decode for p in prefill)

    def adapter_filter(
        self, adapter: str | None, role: Role, paired: bool
    ) -> Callable[[Instance], bool] | None:
        """Which engines of ``role`` an ``adapter`` request may go to (None: any, a base
        model request): those that hold it; for D with ``paired`` (the request runs a P
        leg), only those some routable P holding it can pair with, so that a decode slot
        is never taken where no P could serve the prompt."""
        if adapter is None:
            return None
        if adapter in self.config.lora.modules:
            return self._loadable_filter(adapter, role, paired)
        return self._held_filter(adapter, role, paired)

    def _loadable_filter(
        self, adapter: str, role: Role, paired: bool
    ) -> Callable[[Instance], bool]:
        """For an adapter the router loads itself: the engines that hold it while they can
        serve the request (for D with ``paired``: while one pairs with a P that holds it),
        else any (the chosen ones load it first: router/engines/adapter_loads.py)."""
        held = self._held_filter(adapter, role, paired)

        def allowed(inst: Instance) -> bool:
            routable = candidates(self.of_role(role))
            return held(inst) or not any(held(i) for i in routable)

        return allowed

    def _held_filter(self, adapter: str, role: Role, paired: bool) -> Callable[[Instance], bool]:
        """The engines of ``role`` that hold ``adapter`` (for D with ``paired``: and pair
        with a routable P that holds it)."""
        if role is Role.PREFILL or not paired:
            return lambda inst: adapter in inst.adapters

        def allowed(d: Instance) -> bool:
            # Read at each call: a request may wait in the queue while Ps come and go.
            return adapter in d.adapters and any(
                adapter in p.adapters and self.pair_mismatch(p, d) is None
                for p in candidates(self.prefill)
            )

        return allowed

    def adapter_cards(self) -> list[dict[str, Any]]:
        """The ``/v1/models`` cards of the adapters this pool serves (:meth:`serves_adapter`),
        as ``vllm serve`` lists them, by name; each card's ``root`` as the first engine that
        holds it reports it (P before D, in config order)."""
        found: dict[str, Adapter] = {}
        for inst in (*self.prefill, *self.decode):
            for name, adapter in inst.adapters.items():
                found.setdefault(name, adapter)
        for name, path in self.config.lora.modules.items():
            found.setdefault(name, Adapter(name, self.name, path))
        return [found[name].card(self.name) for name in sorted(found) if self.serves_adapter(name)]

    # -- pairing ---------------------------------------------------------------

    def pair_mismatch(self, p: Instance, d: Instance) -> str | None:
        """Why ``p`` cannot hand its KV to ``d`` (router/engines/pairing.py); None: it can."""
        if self.config.pairing == "any":
            return None
        return mismatch(self.mode, p.facts, d.facts)

    def check_pairs(self) -> None:
        """Take out of rotation every engine no engine of the other role can pair with,
        and bring back those that have one again (after each change of the engines or of
        what they run). The health of the other side does not count here: an engine whose
        only partner is down waits for it, as the refusal of the other role says."""
        self.pair_up(self.prefill, self.decode)

    def pair_up(self, prefill: Sequence[Instance], decode: Sequence[Instance]) -> None:
        """:meth:`check_pairs` on these lists (the registry's, before it hands the decode
        list to the ledger: no waiter is served by a D whose partners just left)."""
        if not self.mode.uses_prefill:
            for inst in (*prefill, *decode):
                inst.set_unpaired(None)
            return
        for p in prefill:
            p.set_unpaired(_why_unpaired([self.pair_mismatch(p, d) for d in decode]))
        for d in decode:
            d.set_unpaired(_why_unpaired([self.pair_mismatch(p, d) for p in prefill]))


def _why_unpaired(reasons: Sequence[str | None]) -> str | None:
    """An engine's reason to be out: every engine of the other role refuses it (none at all:
    not unpaired, the refusal of the other role says why)."""
    if not reasons or None in reasons:
        return None
    return "; ".join(sorted({r for r in reasons if r is not None}))


def _reconcile(
    current: Sequence[Instance],
    wanted: Sequence[tuple[str, int | None]],
    make: Callable[[str, int | None], Instance],
) -> list[Instance]:
    by_key = {i.key: i for i in current}
    return [by_key.get(engine_key(url, rank)) or make(url, rank) for url, rank in wanted]


def _ranks(configs: Sequence[_C]) -> list[tuple[_C, str, int | None]]:
    """(config, URL, rank) of every engine the entries route to, a DP entry's ranks in order."""
    return [(c, c.base_url, r) for c in configs for r in c.ranks]


def _nixl(
    cfg: PrefillInstanceConfig | DecodeInstanceConfig, rank: int | None, mode: Mode
) -> NixlAddress | None:
    """The configured (or discovered) NIXL address of the engine (of its data-parallel
    ``rank``), if the config names one."""
    if not (cfg.engine_id and cfg.kv_host and cfg.kv_port):
        return None
    address = NixlAddress(cfg.engine_id, cfg.kv_host, cfg.kv_port, cfg.tp_size, cfg.pp_size)
    if rank is None:
        return address
    # This project's connector (pipelined) gives each rank's TP x PP workers a port each.
    step = cfg.tp_size * cfg.pp_size if mode is Mode.PIPELINED else 1
    return address.of_rank(rank, step)


class Registry:
    """All model pools, by client-visible model name."""

    def __init__(
        self,
        config: RouterConfig,
        clock: Callable[[], float] = time.monotonic,
        shared_slots: WorkerSlots | None = None,
        load: Callable[[Instance], int] | None = None,
    ) -> None:
        """``shared_slots``: this worker's view of the slot table of ``--workers N``.
        ``load``: an instance's load for session affinity's bound (default: this router's
        own count; several replicas: the engines' reports, ``router/engines/reported.py``).
        Listeners (:meth:`subscribe`) are called after every change of the instance lists."""
        self._clock = clock
        self._shared_slots = shared_slots
        self._load = load
        self._listeners: list[Callable[[], None]] = []
        self._pools: dict[str, ModelPool] = {}
        self._config = config
        self.apply(config)

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` after every change of the instance lists (a reload, discovery),
        until the returned function is called."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def _changed(self) -> None:
        for listener in list(self._listeners):
            listener()

    # -- reading -------------------------------------------------------------

    def get(self, model: str) -> ModelPool | None:
        return self._pools.get(model)

    def adapter_pool(self, adapter: str) -> ModelPool | None:
        """The pool that serves the LoRA adapter named ``adapter``
        (:meth:`ModelPool.serves_adapter`), the first in config order if several do; None
        if none does (a model of that name is :meth:`get`'s, never an adapter)."""
        return next((p for p in self._pools.values() if p.serves_adapter(adapter)), None)

    def pools(self) -> Iterator[ModelPool]:
        return iter(list(self._pools.values()))

    def instances(self) -> Iterator[Instance]:
        for pool in list(self._pools.values()):
            yield from pool.prefill
            yield from pool.decode

    def slots_in_use(self) -> int:
        return sum(p.ledger.slots_in_use for p in self._pools.values())

    def check_pairs(self) -> None:
        """Every pool's :meth:`ModelPool.check_pairs` (the health monitor's, after it read
        what an engine runs)."""
        for pool in list(self._pools.values()):
            pool.check_pairs()

    # -- reconciling ---------------------------------------------------------

    def apply(self, config: RouterConfig) -> list[str]:
        """Make the pools match ``config``; returns a description of each change."""
        self._config = config
        changes = [
            f"model {name!r} removed"
            for name in self._pools
            if name not in {m.name for m in config.models}
        ]
        self._pools = {
            m.name: self._pools[m.name] if m.name in self._pools else self._new_pool(m)
            for m in config.models
        }
        for m in config.models:
            if m.discovery is not None:
                # Discovery owns this model's instances: a reload changes settings only.
                pool = self._pools[m.name]
                kept = {"prefill": pool.config.prefill, "decode": pool.config.decode}
                self._update_settings(pool, m.model_copy(update=kept))
                continue
            changes += self.set_instances(m.name, m.prefill, m.decode, model_config=m)
        self._changed()
        return changes

    def set_instances(
        self,
        model: str,
        prefill: Sequence[PrefillInstanceConfig],
        decode: Sequence[DecodeInstanceConfig],
        *,
        model_config: ModelConfig | None = None,
    ) -> list[str]:
        """Replace one model's instance lists (config reload or discovery)."""
        pool = self._pools[model]
        if model_config is not None:
            self._update_settings(pool, model_config)
        cfg = pool.config.model_copy(update={"prefill": list(prefill), "decode": list(decode)})
        pool.config = cfg
        before = {i.key for i in (*pool.prefill, *pool.decode)}
        p_ranks, d_ranks = _ranks(prefill), _ranks(decode)
        pool.prefill = _reconcile(
            pool.prefill,
            [(u, r) for _, u, r in p_ranks],
            lambda u, r: self._instance(u, Role.PREFILL, model, r),
        )
        d_insts = _reconcile(
            pool.decode,
            [(u, r) for _, u, r in d_ranks],
            lambda u, r: self._instance(u, Role.DECODE, model, r),
        )
        for p_inst, (p_cfg, _, rank) in zip(pool.prefill, p_ranks, strict=True):
            p_inst.configure_nixl(_nixl(p_cfg, rank, cfg.mode), p_cfg.kv_host)
        for d_inst, (d_cfg, _, rank) in zip(d_insts, d_ranks, strict=True):
            d_inst.set_slots(d_cfg.slots)
            d_inst.configure_nixl(_nixl(d_cfg, rank, cfg.mode), d_cfg.kv_host)
        pool.pair_up(pool.prefill, d_insts)
        pool.ledger.set_instances(d_insts)  # the decode list's one write (``pool.decode`` reads it)
        after = {i.key for i in (*pool.prefill, *pool.decode)}
        self._changed()
        return [f"model {model!r}: + {u}" for u in sorted(after - before)] + [
            f"model {model!r}: - {u}" for u in sorted(before - after)
        ]

    def _update_settings(self, pool: ModelPool, cfg: ModelConfig) -> None:
        old = pool.config
        pool.config = cfg
        pool.affinity.config = cfg.sessions  # the table is kept: sessions stay put
        if cfg.policy.prefill != old.policy.prefill:
            pool.prefill_policy = make_policy(cfg.policy.prefill)
        if cfg.policy.decode != old.policy.decode:
            pool.ledger.set_policy(make_policy(cfg.policy.decode))
        if (cfg.mode, cfg.pairing) != (old.mode, old.pairing):
            pool.check_pairs()
        admission = self._config.admission
        pool.ledger.set_limits(
            admission.queue_size,
            admission.max_wait,
            self._config.health.interval,
            admission.priority_aging,
        )

    def _new_pool(self, cfg: ModelConfig) -> ModelPool:
        admission = self._config.admission
        affinity = Affinity(cfg.sessions, self._clock, self._load)
        ledger = SlotLedger(
            cfg.name,
            [],
            make_policy(cfg.policy.decode),
            admission.queue_size,
            admission.max_wait,
            shared=self._shared_slots,
            probe_interval=self._config.health.interval,
            clock=self._clock,
            affinity=affinity,
            aging=admission.priority_aging,
        )
        policy = make_policy(cfg.policy.prefill)
        return ModelPool(
            cfg,
            [],
            ledger,
            policy,
            affinity,
            KeptTurnTable(self._clock),
            load=self._load or own_load,
        )

    def _instance(self, url: str, role: Role, model: str, rank: int | None) -> Instance:
        b = self._config.breaker
        breaker = Breaker(
            b.failure_threshold,
            b.open_seconds,
            self._clock,
            answer_threshold=b.consecutive_5xx,
        )
        return Instance(url, role, model, breaker, rank=rank)
