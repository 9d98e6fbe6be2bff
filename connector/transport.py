"""The NIXL seam: a narrow ``NixlAgent`` Protocol and the real adapter over the ``nixl`` package.

The worker only ever talks to a ``NixlAgent``; tests inject ``tests/fakes/fake_nixl.py``.
``nixl`` is imported lazily, inside ``RealNixlAgent.__init__``, so the scheduler process and the
unit tests never load it.

A descriptor is ``(address, length, device_id)``; a block row ``(address, length, device_id,
stride, count)`` stands for ``count`` descriptors of ``length`` bytes, ``stride`` bytes apart.
WRITEs go between descriptor lists prepared once (``prep_blocks``: ours at registration, a
peer's at its first WRITE), naming blocks by index, as NIXL's ``prep_xfer_dlist`` and
``make_prepped_xfer`` intend: no descriptor is built per WRITE. Every agent listens for metadata
requests on its own port (NIXL's listener thread), so peers exchange agent metadata without a
side service.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["AgentFactory", "Blocks", "Desc", "NixlAgent", "RealNixlAgent", "XferState"]

Desc = tuple[int, int, int]
Blocks = tuple[int, int, int, int, int]  # address, length, device_id, stride, count
XferState = str  # "PROC" | "DONE" | "ERR"


class NixlAgent(Protocol):
    """What the connector needs from one NIXL agent (one per worker rank)."""

    name: str

    def register(self, regions: Sequence[Desc], mem_type: str) -> None:
        """Register memory once at start (the buffers under the KV cache)."""

    def deregister(self) -> None:
        """Deregister everything ``register`` registered (shutdown)."""

    def fetch_remote(self, agent: str, host: str, port: int) -> None:
        """Ask ``agent``'s listener for its metadata (asynchronous; see ``has_remote``)."""

    def send_local(self, host: str, port: int) -> None:
        """Push our metadata to the listener at ``host:port`` (asynchronous)."""

    def has_remote(self, agent: str) -> bool:
        """Whether ``agent``'s metadata is loaded, i.e. we can notify it and write to it."""

    def remove_remote(self, agent: str) -> None:
        """Forget ``agent``'s metadata and disconnect from it (a peer that restarted under the
        same name: NIXL refuses to load a name it holds, so the old one must go first)."""

    def send_notif(self, agent: str, msg: bytes) -> None:
        """Send a standalone notification; raises on a transport error."""

    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications since the last call, by sender agent name."""

    def prep_blocks(self, agent: str | None, rows: Sequence[Blocks], mem_type: str) -> object:
        """Prepare a descriptor list once: of our registered memory (``agent`` None) or of
        ``agent``'s (its metadata loaded). Descriptor ``k`` of row ``r`` has index
        ``sum(count of rows before r) + k``. Returns a handle for ``post_write`` and
        ``release_prepped``; raises if the memory is not registered."""

    def post_write(
        self,
        agent: str,
        local: object,
        local_idx: Sequence[int],
        remote: object,
        remote_idx: Sequence[int],
        notif: bytes,
    ) -> object:
        """Post one WRITE of ``local``'s descriptors ``local_idx[i]`` into ``remote``'s
        ``remote_idx[i]`` (``agent``'s prepared list); ``notif`` reaches ``agent`` after the
        data. Returns a handle for ``xfer_state``/``release``; raises if posting fails."""

    def release_prepped(self, handle: object) -> None:
        """Release a prepared descriptor list no longer written through."""

    def xfer_state(self, handle: object) -> XferState:
        """``"PROC"``, ``"DONE"`` or ``"ERR"``."""

    def release(self, handle: object) -> None:
        """Release a handle that is no longer in progress."""

    def close(self) -> None:
        """Drop the agent (worker shutdown, after ``deregister``)."""


AgentFactory = Callable[[str, int], NixlAgent]
"""``factory(agent_name, listen_port)`` -> a ready agent with memory not yet registered."""

# Built once per process: constructing an agent swaps the bindings' config class for a moment
# (see RealNixlAgent), so two agents must not be built concurrently.
_BUILD_LOCK = threading.Lock()


class RealNixlAgent:
    """``NixlAgent`` over ``nixl.nixl_agent`` with the UCX backend and a listener thread.

    Without NIXL's UCX progress thread (``progress_thread`` False, the default) the UCX
    workers progress in this agent's own calls: ``get_notifs`` progresses them all,
    ``xfer_state`` a WRITE's. The worker calls both in every hook and every idle wait, and its
    engine keeps stepping while a transfer is open on either side (D until it has every WRITE,
    P until D's ``ACK``), so a queued notice or an emulated RMA (TCP loopback) always moves.
    With the thread on, on a 2-core host running three engine workers, notices stayed stuck
    until a receive timed out (30 s) and a worker's ``check_remote_metadata`` waited on NIXL's
    lock as long (docs/connector-progress.md). ``progress_delay_us`` is the thread's sleep
    when it is on.

    Raises ``RuntimeError`` if a backend plugin in ``backends`` is missing (NIXL itself only
    logs a warning and builds an agent that cannot transfer).
    """

    def __init__(
        self,
        name: str,
        listen_port: int,
        *,
        progress_thread: bool = False,
        progress_delay_us: int = 1000,
        backends: Sequence[str] = ("UCX",),
    ) -> None:
        import numpy as np
        from nixl import _api as api

        self.name = name
        self._np = np
        self._api = api
        conf = api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            enable_listen_thread=True,
            listen_port=listen_port,
            backends=list(backends),
        )
        with _BUILD_LOCK:
            self._agent: Any = _build_agent(api, name, conf, progress_delay_us)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            available = list(self._agent.get_plugin_list())
            self._agent = None
            raise RuntimeError(
                f"NIXL backend plugin(s) {missing} not available (available plugins:"
                f" {available}); install the plugin in the engine image or set"
                f' "backends" in kv_connector_extra_config to available ones'
            )
        self._registered: list[Any] = []  # registration descriptor lists, for deregister

    def register(self, regions: Sequence[Desc], mem_type: str) -> None:
        # Registration descriptors carry a fourth field (a per-region label), unused here.
        descs = self._agent.register_memory([(a, n, d, "") for a, n, d in regions], mem_type)
        self._registered.append(descs)

    def deregister(self) -> None:
        while self._registered:
            self._agent.deregister_memory(self._registered.pop())

    def fetch_remote(self, agent: str, host: str, port: int) -> None:
        self._agent.fetch_remote_metadata(agent, host, port)

    def send_local(self, host: str, port: int) -> None:
        self._agent.send_local_metadata(host, port)

    def has_remote(self, agent: str) -> bool:
        return bool(self._agent.check_remote_metadata(agent))

    def remove_remote(self, agent: str) -> None:
        self._agent.remove_remote_agent(agent)

    def send_notif(self, agent: str, msg: bytes) -> None:
        self._agent.send_notif(agent, msg)

    def get_notifs(self) -> dict[str, list[bytes]]:
        return dict(self._agent.get_new_notifs())

    def prep_blocks(self, agent: str | None, rows: Sequence[Blocks], mem_type: str) -> object:
        # NIXL's strided form (Nx5): the list is prepared without a Python tuple per block.
        arr = self._np.array(rows, dtype=self._np.uint64).reshape(-1, 5)
        return self._agent.prep_xfer_dlist(agent or "NIXL_INIT_AGENT", arr, mem_type)

    def post_write(
        self,
        agent: str,
        local: object,
        local_idx: Sequence[int],
        remote: object,
        remote_idx: Sequence[int],
        notif: bytes,
    ) -> object:
        np = self._np
        handle = self._agent.make_prepped_xfer(
            "WRITE",
            local,
            np.asarray(local_idx, dtype=np.int32),
            remote,
            np.asarray(remote_idx, dtype=np.int32),
            notif,
        )
        if self._agent.transfer(handle) == "ERR":
            self._agent.release_xfer_handle(handle)
            raise RuntimeError(f"NIXL WRITE to {agent} failed to post")
        return handle

    def release_prepped(self, handle: object) -> None:
        self._agent.release_dlist_handle(handle)

    def xfer_state(self, handle: object) -> XferState:
        return str(self._agent.check_xfer_state(handle))

    def release(self, handle: object) -> None:
        self._agent.release_xfer_handle(handle)

    def close(self) -> None:
        self._agent = None


def _build_agent(api: Any, name: str, conf: Any, delay_us: int) -> Any:
    """Build ``nixl_agent`` with a progress-thread delay.

    ``nixl_agent.__init__`` hard-codes ``pthrDelay = 0``, which makes the UCX progress thread
    spin a whole core even when idle; on small CPU hosts that starves the model forward. The
    config class is looked up on the bindings module at call time, so a subclass that keeps the
    delay at least ``delay_us`` is swapped in only while this agent is built.
    """
    bindings = api.nixlBind
    base = bindings.nixlAgentConfig

    class _DelayedConfig(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: Any) -> None:
            if key == "pthrDelay":
                value = max(int(value), delay_us)
            super().__setattr__(key, value)

    bindings.nixlAgentConfig = _DelayedConfig
    try:
        return api.nixl_agent(name, conf)
    finally:
        bindings.nixlAgentConfig = base
