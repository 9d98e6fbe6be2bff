"""Configuration reload without restart: on SIGHUP, or when the file changes.

Only the model section is applied live (models, instances, slots, policies,
admission limits); requests in flight keep their instances and finish. Settings
bound at start (listen address, timeouts, auth, CORS, per-key limits, connection
bounds) need a restart: a reload that changes them says so in the log and applies
the rest.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

from router.config import ConfigError, RouterConfig, load_config
from router.registry import Registry

__all__ = ["ConfigReloader"]

log = logging.getLogger("pd_router.reload")

_RESTART_ONLY = (
    "listen",
    "timeouts",
    "auth",
    "cors",
    "limits",
    "connections",
    "retries",
    "breaker",
    "health",
    "log_level",
)


class ConfigReloader:
    def __init__(self, path: str | Path, registry: Registry, current: RouterConfig) -> None:
        self._path = Path(path)
        self._registry = registry
        self._current = current
        self._mtime = self._stat()

    def _stat(self) -> float:
        try:
            return self._path.stat().st_mtime
        except OSError:
            return 0.0

    def reload(self) -> list[str]:
        """Apply the file's models now; raises :class:`ConfigError` and changes nothing
        if the file is invalid."""
        new = load_config(self._path)
        stale = [k for k in _RESTART_ONLY if getattr(new, k) != getattr(self._current, k)]
        if stale:
            log.warning("reload: %s changed; these apply after a restart", ", ".join(stale))
        new = new.model_copy(update={k: getattr(self._current, k) for k in _RESTART_ONLY})
        changes = self._registry.apply(new)
        self._current = new
        log.info("reloaded %s: %s", self._path, "; ".join(changes) or "no instance changes")
        return changes

    def _reload_logged(self) -> None:
        try:
            self.reload()
        except ConfigError as exc:
            log.error("reload rejected, keeping the running configuration:\n%s", exc)

    async def watch(self, interval: float) -> None:
        """Reload whenever the file's modification time changes; cancel to stop."""
        while True:
            await asyncio.sleep(interval)
            mtime = self._stat()
            if mtime != self._mtime:
                self._mtime = mtime
                self._reload_logged()

    def install_sighup(self) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._reload_logged)

    def remove_sighup(self) -> None:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
