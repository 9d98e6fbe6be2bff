"""Model pools: each model's prefill and decode instances, policies, ledger and
learned prefill identities. The registry is the single owner of instance state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from router.config import Mode, ModelConfig, RouterConfig
from router.pd.kv_params import PrefillIdentity
from router.workers.breaker import Breaker
from router.workers.instance import Instance, Role
from router.workers.ledger import SlotLedger
from router.workers.policies import Policy, make_policy

__all__ = ["ModelPool", "Registry"]


@dataclass(eq=False)
class ModelPool:
    config: ModelConfig
    prefill: list[Instance]
    decode: list[Instance]
    ledger: SlotLedger
    prefill_policy: Policy
    # Push mode: P's NIXL identity per P url, configured or learned from responses.
    identities: dict[str, PrefillIdentity] = field(default_factory=dict)
    configured_identities: frozenset[str] = frozenset()
    kv_hosts: dict[str, str | None] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def mode(self) -> Mode:
        return self.config.mode

    @property
    def key_needed(self) -> bool:
        return self.prefill_policy.needs_key

    def select_prefill(self, key: str | None, avoid: frozenset[Instance]) -> Instance | None:
        routable = [p for p in self.prefill if p.routable]
        if not routable:
            return None
        preferred = [p for p in routable if p not in avoid] or routable
        return self.prefill_policy.select(preferred, key)

    def learn_identity(self, url: str, identity: PrefillIdentity) -> None:
        if url not in self.configured_identities:
            self.identities[url] = identity

    def forget_identity(self, url: str) -> None:
        """Drop a learned identity after P failed: it may have restarted with a new one."""
        if url not in self.configured_identities:
            self.identities.pop(url, None)

    def has_healthy_pair(self) -> bool:
        d_ok = any(d.healthy is True and not d.degraded for d in self.decode)
        if not self.mode.uses_prefill:
            return d_ok
        return d_ok and any(p.healthy is True for p in self.prefill)


def _build_pool(
    cfg: ModelConfig, router_cfg: RouterConfig, clock: Callable[[], float]
) -> ModelPool:
    def breaker() -> Breaker:
        b = router_cfg.breaker
        return Breaker(b.failure_threshold, b.open_seconds, clock)

    prefill = [Instance(p.base_url, Role.PREFILL, cfg.name, breaker()) for p in cfg.prefill]
    decode = [
        Instance(d.base_url, Role.DECODE, cfg.name, breaker(), slots=d.slots) for d in cfg.decode
    ]
    ledger = SlotLedger(
        cfg.name,
        decode,
        make_policy(cfg.policy.decode),
        router_cfg.admission.queue_size,
        router_cfg.admission.max_wait,
    )
    pool = ModelPool(cfg, prefill, decode, ledger, make_policy(cfg.policy.prefill))
    configured = set()
    for p in cfg.prefill:
        pool.kv_hosts[p.base_url] = p.kv_host
        if p.engine_id and p.kv_host and p.kv_port:
            pool.identities[p.base_url] = PrefillIdentity(
                p.engine_id, p.kv_host, p.kv_port, p.tp_size, p.pp_size
            )
            configured.add(p.base_url)
    pool.configured_identities = frozenset(configured)
    return pool


class Registry:
    """All model pools, by client-visible model name."""

    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._pools = {m.name: _build_pool(m, config, clock) for m in config.models}

    def get(self, model: str) -> ModelPool | None:
        return self._pools.get(model)

    def pools(self) -> Iterator[ModelPool]:
        return iter(self._pools.values())

    def instances(self) -> Iterator[Instance]:
        for pool in self._pools.values():
            yield from pool.prefill
            yield from pool.decode

    def slots_in_use(self) -> int:
        return sum(p.ledger.slots_in_use for p in self._pools.values())
