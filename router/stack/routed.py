"""A stack's engines seen through one of its extra routers (:meth:`Stack.start_router`).

Tests written against a :class:`Stack` (its engines and its router) run unchanged against a
second router over the same engines: push-sequential over push engines, or other timeouts,
tracing or kept turns, without starting engines again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from router.config import Mode
from router.stack import engines as eng
from router.stack.launcher import ExtraRouter, Stack
from router.stack.metrics import MetricsPage

__all__ = ["RoutedStack"]


class RoutedStack:
    """The engine accessors of ``stack`` and the router accessors of ``router``; the engines
    stay the stack's (a restart through this view reaches every router)."""

    def __init__(self, stack: Stack, router: ExtraRouter) -> None:
        self.stack = stack
        self.router = router

    # -- the router ------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self.router.settings.mode

    @property
    def router_url(self) -> str:
        return self.router.url

    def router_metrics(self) -> MetricsPage:
        return self.router.metrics()

    def router_pids(self) -> list[int]:
        return self.router.pids()

    def router_config(self) -> dict[str, Any]:
        return self.stack.config_for(self.router.settings, self.router.port)

    # -- the engines (the stack's) -----------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.stack.model_name

    @property
    def engines(self) -> list[eng.EngineSpec]:
        return self.stack.engines

    def engine(self, name: str) -> eng.EngineSpec:
        return self.stack.engine(name)

    @property
    def prefill(self) -> eng.EngineSpec:
        return self.stack.prefill

    @property
    def decode(self) -> eng.EngineSpec:
        return self.stack.decode

    def engine_metrics(self, name: str) -> MetricsPage:
        return self.stack.engine_metrics(name)

    def engine_pids(self, name: str) -> list[int]:
        return self.stack.engine_pids(name)

    def engine_core_pids(self, name: str) -> list[int]:
        return self.stack.engine_core_pids(name)

    def signal_engine(self, name: str, sig: int) -> None:
        self.stack.signal_engine(name, sig)

    def restart_engine(self, name: str, grace_s: float = 5.0) -> float:
        return self.stack.restart_engine(name, grace_s)

    def log_path(self, name: str) -> Path:
        return self.stack.log_path(name)
