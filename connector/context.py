"""What a worker rank's sender (P) and receiver (D) share: agent, links, notices, stats, clock.

The sender and receiver each own their transfers; everything both of them touch lives here, with
one owner each: ``WorkerSide`` sets ``layout`` and the peer table once at registration, and this
class alone keeps the queue of notices still waiting for an unreachable peer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from connector.layout import CacheLayout
from connector.peers import PeerTable
from connector.stats import WorkerStats
from connector.tp_map import TpPlace
from connector.transport import NixlAgent
from connector.writer import BlockWriter

__all__ = ["Timeouts", "WorkerContext"]

# Under "vllm." so the lines land in the engine log with vLLM's format and level.
log = logging.getLogger(f"vllm.{__name__}")


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds; set through ``kv_connector_extra_config`` (see connector.py)."""

    handshake_s: float = 5.0  # metadata exchange + HELLO with a peer rank
    reg_s: float = 30.0  # P: prompt computed, still no REG from D
    recv_s: float = 120.0  # D: blocks registered, transfer not complete
    write_s: float = 30.0  # P: a WRITE still in progress
    memory_s: float = 300.0  # how long an early REG or ABORT for an unknown tid is kept
    idle_wait_s: float = 0.002  # see WorkerSide._idle_wait; 0 turns it off
    keep_s: float = 300.0  # D: how long a finished turn is kept for a next P's ASK
    pull_s: float = 5.0  # a kept turn's ASK answered to PULL, and the PULL to its last W
    early_ask_s: float = 1.0  # D: an ASK for a turn not kept (yet) waits this long for it
    # A side waiting on its peer's notice sends its own last one again this often (0: never):
    # NIXL over TCP can hold a notice until the connection carries another (peers.py, sender.py,
    # receiver.py; docs/connector-progress.md).
    nudge_s: float = 1.0


class WorkerContext:
    """One rank's shared resources. Single-threaded, like everything on the worker side."""

    def __init__(
        self,
        agent: NixlAgent,
        tp_rank: int,
        timeouts: Timeouts,
        clock: Callable[[], float],
        tp: TpPlace | None = None,
    ) -> None:
        self.agent = agent
        self.rank = tp_rank
        self.tp = tp or TpPlace()  # where this worker sits in the head map (tp_map)
        self.t = timeouts
        self.clock = clock
        self.stats = WorkerStats()
        self.layout: CacheLayout | None = None  # ours; set by register_kv_caches
        self._peers: PeerTable | None = None
        self._writer: BlockWriter | None = None
        self._notices: list[tuple[str, bytes, float]] = []  # (agent, message, give-up time)

    def attach(self, layout: CacheLayout, peers: PeerTable, writer: BlockWriter) -> None:
        """Called once, by registration: the cache is registered and links can be made."""
        self.layout, self._peers, self._writer = layout, peers, writer

    @property
    def peers(self) -> PeerTable:
        assert self._peers is not None, "register_kv_caches must run first"
        return self._peers

    @property
    def writer(self) -> BlockWriter:
        assert self._writer is not None, "register_kv_caches must run first"
        return self._writer

    def notice(self, agent: str, raw: bytes) -> None:
        """Send now if the peer is reachable, else keep trying until the handshake timeout."""
        if self.peers.can_notify(agent) and self._send_notif(agent, raw):
            return
        self._notices.append((agent, raw, self.clock() + self.t.handshake_s))

    def flush_notices(self) -> None:
        """Retry queued notices; drop (and log) those whose peer stayed unreachable too long."""
        keep: list[tuple[str, bytes, float]] = []
        now = self.clock()
        for agent, raw, give_up in self._notices:
            if self.peers.can_notify(agent) and self._send_notif(agent, raw):
                continue
            if now < give_up:
                keep.append((agent, raw, give_up))
            else:
                log.warning("pd-connector: dropped notice to unreachable %s", agent)
        self._notices = keep

    def xfer_state(self, handle: object) -> str:
        """A posted WRITE's state (``PROC``, ``DONE``, ``ERR``); an agent that cannot tell
        counts as a failed WRITE."""
        try:
            return self.agent.xfer_state(handle)
        except Exception:
            return "ERR"

    def release(self, handle: object) -> None:
        """Release a WRITE's handle; releasing a stuck WRITE may fail, and nothing else can
        be done about it then."""
        try:
            self.agent.release(handle)
        except Exception as exc:
            log.debug("pd-connector: release failed: %s", exc)

    def _send_notif(self, agent: str, raw: bytes) -> bool:
        try:
            self.agent.send_notif(agent, raw)
            return True
        except Exception as exc:
            log.warning("pd-connector: notification to %s failed: %s", agent, exc)
            return False
