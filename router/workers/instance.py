"""One engine instance as the router sees it: role, health, breaker, load."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from router.pd.pipelined_params import PeerIdentity
from router.workers.breaker import Breaker

__all__ = ["Instance", "Role"]


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class Instance:
    """Mutable state of one engine, owned by the router's :class:`Registry`.

    ``healthy`` is None until the first active health check answers; such an
    instance is routable (the breaker guards it) but does not make ``/ready`` pass.
    ``degraded`` marks a decode engine that holds leaked KV blocks while idle.
    """

    url: str
    role: Role
    model: str
    breaker: Breaker
    slots: int = 0  # decode: capacity offered to this router
    in_flight: int = 0  # requests currently using the instance
    at_engine: int = 0  # decode: streams with first bytes in and no end seen yet
    healthy: bool | None = None
    health_failures: int = 0
    degraded: bool = False
    suspect: bool = False  # decode: a leg was closed while waiting for KV
    # The engine's NIXL identity as configured or discovered (pipelined mode).
    peer: PeerIdentity | None = None

    @property
    def routable(self) -> bool:
        return self.healthy is not False and not self.degraded and self.breaker.allows()

    # Decode, several router replicas: how many requests this replica may hold here
    # now (its fair part of what the engine reports free); None = all ``slots``.
    cap: int | None = None

    # Decode, ``--workers N``: reads the router-wide count of this instance from the
    # shared slot table (set by the ledger); None = this process is the router.
    shared_in_use: Callable[[], int] | None = None

    @property
    def limit(self) -> int:
        """Slots this router may hold here now (``slots``, or its replica ``cap``)."""
        return self.slots if self.cap is None else min(self.slots, self.cap)

    @property
    def in_use(self) -> int:
        """Slots held here by the whole router: every worker's with a shared table,
        else this process's ``in_flight``."""
        return self.in_flight if self.shared_in_use is None else self.shared_in_use()

    @property
    def free_slots(self) -> int:
        return self.limit - self.in_use
