"""The one fake NIXL for connector tests: in-process agents on a shared ``Fabric``.

* Metadata exchange is instant when the peer's listener port exists (``fetch_remote`` /
  ``send_local``), unless the fabric is told to hold it (``fabric.hold_metadata = True``).
* Descriptor lists are prepared as NIXL prepares them (``prep_blocks``): a local list must lie
  in the agent's registered memory, a remote one in the peer's (whose metadata must be loaded),
  else preparing raises. ``fabric.preps`` counts every preparation.
* ``post_write`` picks descriptors by index and really copies bytes (``ctypes.memmove``) when
  the write completes, so tests can compare tensors; the attached notification is delivered
  after the data, when NIXL's UCX backend sends it: at once for a WRITE complete within its
  post, else at the poster's first ``xfer_state`` after the completion (NIXL sends a pending
  notification from ``check_xfer_state``, never by itself). Each WRITE is recorded (``Xfer``:
  its resolved descriptors).
* Scripted states: ``fabric.write_mode`` is ``"done"`` (complete at post), ``"proc"`` (stay in
  progress until ``fabric.complete_all()``), ``"err"`` (report ERR) or ``"post_fail"`` (raise).
* ``fabric.kill(name)`` makes an agent vanish: notifications to it raise, its writes hang.
* ``fabric.lazy_notices = True``: a notice (``send_notif``'s, or a WRITE's when NIXL sends it)
  leaves its sender only at the sender's next ``get_notifs`` or ``xfer_state``, as with NIXL
  without its progress thread, where a UCX send moves only while its worker is progressed.
* ``fabric.held_paths.add((sender, target))``: a notice from ``sender`` to ``target`` waits on
  the way until the next one on that path is sent (which then waits in its place), as NIXL over
  TCP was seen to hold one until the connection carried another.
"""

from __future__ import annotations

import ctypes
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

Desc = tuple[int, int, int]
Blocks = tuple[int, int, int, int, int]


@dataclass
class Xfer:
    src: FakeAgent
    target: str
    local: list[Desc]
    remote: list[Desc]
    notif: bytes
    state: str = "PROC"
    notif_pending: bool = False  # completed after its post: sent at the poster's next check


@dataclass
class Prepped:
    """A prepared descriptor list: whose memory (None: the preparing agent's) and the list."""

    owner: str | None
    descs: list[Desc]
    mem_type: str
    released: bool = False


@dataclass
class Fabric:
    agents: dict[str, FakeAgent] = field(default_factory=dict)
    listeners: dict[int, str] = field(default_factory=dict)
    write_mode: str = "done"
    hold_metadata: bool = False
    lazy_notices: bool = False
    dead: set[str] = field(default_factory=set)
    held_paths: set[tuple[str, str]] = field(default_factory=set)
    held: dict[tuple[str, str], bytes] = field(default_factory=dict)  # the notice on the way
    xfers: list[Xfer] = field(default_factory=list)
    preps: int = 0  # descriptor lists prepared, by every agent

    def agent(self, name: str, port: int) -> FakeAgent:
        """An ``AgentFactory``: ``fabric.agent(name, listen_port)``."""
        a = FakeAgent(self, name)
        self.agents[name] = a
        self.listeners[port] = name
        return a

    def kill(self, name: str) -> None:
        self.dead.add(name)

    def complete_all(self) -> None:
        """Complete every WRITE in flight (the NIC or copy engine finished); their
        notifications wait for the posters' next ``xfer_state``."""
        for x in self.xfers:
            if x.state == "PROC":
                self._complete(x)
                x.notif_pending = bool(x.notif)

    def _complete(self, x: Xfer) -> None:
        for (s, n, _), (d, m, _) in zip(x.local, x.remote, strict=True):
            assert n == m
            ctypes.memmove(d, s, n)
        x.state = "DONE"

    def _notify(self, x: Xfer) -> None:
        x.notif_pending = False
        if x.notif:
            self.deliver(x.src, x.target, x.notif)

    def deliver(self, src: FakeAgent, target: str, msg: bytes) -> None:
        """``msg`` from ``src`` to ``target``: now, or at ``src``'s next progress if lazy."""
        if self.lazy_notices:
            src.outbox.append((target, msg))
            return
        path = (src.name, target)
        if path in self.held_paths:  # this one waits; the one it replaces arrives
            msg, self.held[path] = self.held.get(path, b""), msg
        if msg and target not in self.dead:
            self.agents[target].inbox[src.name].append(msg)

    def writes_to(self, target: str) -> list[Xfer]:
        return [x for x in self.xfers if x.target == target]


class FakeAgent:
    """Implements ``connector.transport.NixlAgent``."""

    def __init__(self, fabric: Fabric, name: str) -> None:
        self.fabric = fabric
        self.name = name
        self.known: set[str] = set()
        self.pending_md: set[str] = set()
        self.inbox: dict[str, list[bytes]] = defaultdict(list)
        self.regions: list[tuple[Desc, str]] = []  # registered (region, mem type)
        self.deregistered: list[tuple[Desc, str]] = []
        self.prepped: list[Prepped] = []
        self.sent: list[tuple[str, bytes]] = []
        self.outbox: list[tuple[str, bytes]] = []  # lazy notices not yet progressed out
        self.removed: list[str] = []  # remote agents forgotten (remove_remote), in order
        self.closed = False

    def register(self, regions: Sequence[Desc], mem_type: str) -> None:
        self.regions.extend((r, mem_type) for r in regions)

    def deregister(self) -> None:
        self.deregistered.extend(self.regions)
        self.regions.clear()

    def fetch_remote(self, agent: str, host: str, port: int) -> None:
        if self.fabric.listeners.get(port) == agent:
            self.pending_md.add(agent)

    def send_local(self, host: str, port: int) -> None:
        peer = self.fabric.listeners.get(port)
        if peer is not None:
            self.fabric.agents[peer].pending_md.add(self.name)

    def has_remote(self, agent: str) -> bool:
        if agent in self.pending_md and not self.fabric.hold_metadata:
            self.known.add(agent)
            self.pending_md.discard(agent)
        return agent in self.known

    def remove_remote(self, agent: str) -> None:
        self.removed.append(agent)
        self.known.discard(agent)
        self.pending_md.discard(agent)

    def send_notif(self, agent: str, msg: bytes) -> None:
        if agent not in self.known or agent in self.fabric.dead:
            raise RuntimeError(f"cannot reach {agent}")
        self.sent.append((agent, msg))
        self.fabric.deliver(self, agent, msg)

    def progress(self) -> None:
        """Send what waits in the outbox (to agents still alive)."""
        out, self.outbox = self.outbox, []
        for target, msg in out:
            if target not in self.fabric.dead:
                self.fabric.agents[target].inbox[self.name].append(msg)

    def get_notifs(self) -> dict[str, list[bytes]]:
        self.progress()
        out = {k: v for k, v in self.inbox.items() if v}
        self.inbox = defaultdict(list)
        return out

    def prep_blocks(self, agent: str | None, rows: Sequence[Blocks], mem_type: str) -> object:
        if agent is not None and agent not in self.known:
            raise RuntimeError(f"no metadata of {agent}")
        owner = self if agent is None else self.fabric.agents[agent]
        descs = [
            (a + k * stride, n, dev) for a, n, dev, stride, count in rows for k in range(count)
        ]
        for d in descs:
            if not owner.holds(d, mem_type):
                raise RuntimeError(f"{d} is not in {owner.name}'s registered {mem_type} memory")
        self.fabric.preps += 1
        prepped = Prepped(agent, descs, mem_type)
        self.prepped.append(prepped)
        return prepped

    def holds(self, desc: Desc, mem_type: str) -> bool:
        """Whether ``desc`` lies in one region registered with ``mem_type``."""
        addr, n, _ = desc
        return any(
            mt == mem_type and a <= addr and addr + n <= a + size
            for (a, size, _), mt in self.regions
        )

    def post_write(
        self,
        agent: str,
        local: object,
        local_idx: Sequence[int],
        remote: object,
        remote_idx: Sequence[int],
        notif: bytes,
    ) -> object:
        assert isinstance(local, Prepped) and isinstance(remote, Prepped)
        assert local.owner is None and remote.owner == agent, "lists of the wrong agents"
        assert not local.released and not remote.released, "a released list"
        assert len(local_idx) == len(remote_idx)
        mode = self.fabric.write_mode
        if mode == "post_fail" or agent not in self.known:
            raise RuntimeError("post failed")
        src = [local.descs[i] for i in local_idx]
        dst = [remote.descs[i] for i in remote_idx]
        x = Xfer(self, agent, src, dst, notif)
        self.fabric.xfers.append(x)
        if mode == "err":
            x.state = "ERR"
        elif mode == "done" and agent not in self.fabric.dead:
            self.fabric._complete(x)
            self.fabric._notify(x)
        return x

    def release_prepped(self, handle: object) -> None:
        assert isinstance(handle, Prepped)
        handle.released = True

    def xfer_state(self, handle: object) -> str:
        assert isinstance(handle, Xfer)
        if handle.notif_pending:
            self.fabric._notify(handle)
        self.progress()
        return handle.state

    def release(self, handle: object) -> None:
        pass

    def close(self) -> None:
        self.closed = True
