"""A real NIXL agent that also tells the check what it needs to know to order events.

``ObservedAgent`` is ``connector.transport.RealNixlAgent`` (same transfers, same memory) that
remembers two things: which transfer ids D's ``REG`` has reached it for (so P's forward starts
only once its WRITEs can be posted during it), and which of its WRITEs are not released yet
(so a late kernel can wait until every WRITE the connector posted has completed).
"""

from __future__ import annotations

import time
from typing import Any

from connector.metadata import Kind, decode
from connector.transport import RealNixlAgent

__all__ = ["ObservedAgent"]


class ObservedAgent(RealNixlAgent):
    """``RealNixlAgent`` plus what the check observes; used from one thread, like the worker."""

    def __init__(self, name: str, listen_port: int) -> None:
        # NIXL's progress thread on: the check drives P and D from one thread, and P's wait for
        # its WRITEs (a late kernel, ``wait_writes``) makes no call on D's agent, whose UCX
        # worker must progress for a WRITE emulated over TCP loopback to land.
        super().__init__(name, listen_port, progress_thread=True)
        self.regs: set[str] = set()  # tids whose REG was delivered to this agent
        self._open: list[object] = []  # posted WRITEs not yet released

    def get_notifs(self) -> dict[str, list[bytes]]:
        notifs = super().get_notifs()
        for raws in notifs.values():
            for raw in raws:
                msg = decode(raw)
                if msg is not None and msg.kind is Kind.REG:
                    self.regs.add(msg.tid)
        return notifs

    def post_write(self, *args: Any, **kwargs: Any) -> object:
        handle = super().post_write(*args, **kwargs)
        self._open.append(handle)
        return handle

    def release(self, handle: object) -> None:
        if handle in self._open:
            self._open.remove(handle)
        super().release(handle)

    def wait_writes(self, timeout_s: float) -> None:
        """Return once no WRITE posted so far is in progress; raise after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for handle in list(self._open):
            while self.xfer_state(handle) == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: a WRITE still in progress")
                time.sleep(0.0005)
