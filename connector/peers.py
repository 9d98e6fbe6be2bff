"""Links to peer agents: metadata exchange and the compatibility handshake.

A link to a peer rank goes CONNECTING -> READY, or ends FAILED (no metadata within the handshake
timeout) or REFUSED (the peer's HELLO does not match ours, or it refused ours). Both sides fetch
the other's agent metadata from its NIXL listener and push their own, then each sends HELLO as
soon as it can reach the peer. A link is READY once the peer's HELLO has been checked; it
carries the peer's KV layout (what P writes into, or a kept turn's D writes into on P).

A worker links to the peer's worker at its own place when both run the same TP size, else to
the workers ``tp_map`` names (``ensure``'s ``tp_rank``/``tp_size``: the peer's); HELLO carries
the sender's TP rank, so a link the peer opened reaches back to the right listener.

A peer that restarts under the same engine id has the same agent name, and NIXL will not load a
name it already holds: a link would stay bound to the dead incarnation, and the new one would
wait for a HELLO this side never sends again. Each HELLO therefore names its sender's
incarnation (a token drawn per worker start); a HELLO naming another incarnation than the
link's first one makes this side drop the link: the transfers bound to the old incarnation are
ended (``on_restart``), the old agent's metadata is removed from ours, and the link starts
over (metadata fetched again, our HELLO sent once it is loaded).

NIXL over TCP can hold a notice until the connection carries another, so a link still
CONNECTING sends its HELLO again every ``nudge_s``, and a READY link answers such a repeated
HELLO with its own again (at most once per ``nudge_s``): each side's repeats carry out what
the connection held in its direction. A repeated HELLO changes nothing on a READY link.

A HELLO whose ``Compat`` differs (model, layout, attention backend, dtypes, memory type,
parallel sizes the map cannot bridge: ``tp_map.pair_mismatches``) is refused: this side logs
the differing fields with both engines' values and sends them in ``REFUSE``, which the peer
logs too.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from connector.address import NixlAddress
from connector.layout import CacheLayout
from connector.metadata import Compat, Kind, Message, WorkerRank, encode
from connector.tp_map import pair_mismatches
from connector.transport import NixlAgent

__all__ = ["Link", "LinkState", "PeerTable"]

# Under "vllm." so the lines land in the engine log with vLLM's format and level.
log = logging.getLogger(f"vllm.{__name__}")

# A link without the peer's metadata asks for it again after 0.5 s, then twice as long each
# time up to 8 s: a fetch that takes long (a listener on a loaded machine) is not cut short
# every half second by the next one.
_REFETCH_S, _REFETCH_MAX_S = 0.5, 8.0


class LinkState(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"
    REFUSED = "refused"


@dataclass(slots=True)
class Link:
    """This rank's view of one peer rank."""

    name: str
    addr: NixlAddress | None
    started: float
    state: LinkState = LinkState.CONNECTING
    hello_sent: bool = False
    layout: CacheLayout | None = None
    reason: str = ""
    handshake_s: float = 0.0
    port: int = 0  # the peer worker's NIXL listener
    peer_tp: int = 0  # the peer engine's TP size, from its HELLO (0 until then)
    incarnation: str | None = None  # the peer's, from its first HELLO (None: not yet, or
    # a peer that names none)
    fetched_at: float | None = None  # when its metadata was last asked for
    hello_at: float = 0.0  # when our HELLO was last sent (hello_sent)
    refetches: int = 0  # times it was asked for again (each waits twice as long)

    @property
    def settled(self) -> bool:
        return self.state is not LinkState.CONNECTING

    @property
    def failure_kind(self) -> str:
        """The stats failure kind (``stats.FAILURE_KINDS``) of a settled link that is not READY."""
        return "refused" if self.state is LinkState.REFUSED else "handshake"


class PeerTable:
    """All links of one worker rank; driven by the worker's polling (one thread)."""

    def __init__(
        self,
        agent: NixlAgent,
        rank: WorkerRank,
        hello: dict[str, Any],
        compat: Compat,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_restart: Callable[[str], None] = lambda name: None,
        nudge_s: float = 1.0,
        on_repeat: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_restart(name)``: peer ``name`` restarted; called before its old metadata is
        removed, so whatever was bound to the old incarnation can be ended and released.
        ``nudge_s``: how often HELLO is sent again (see the module's docstring; 0: never);
        ``on_repeat()``: called for each HELLO sent again (the stats count it)."""
        self._agent = agent
        self._on_restart = on_restart
        self._rank = rank
        self._hello = hello  # our HELLO body: compat, address, layout
        self._compat = compat
        self._timeout_s = timeout_s
        self._nudge_s = nudge_s
        self._on_repeat = on_repeat
        self._clock = clock
        self._links: dict[str, Link] = {}

    def get(self, name: str) -> Link | None:
        return self._links.get(name)

    def ensure(
        self, addr: NixlAddress, tp_rank: int | None = None, tp_size: int | None = None
    ) -> Link:
        """The link to ``addr``'s worker at TP rank ``tp_rank`` of ``tp_size`` (None: ours,
        the equal-TP pairing), starting the metadata exchange on first use."""
        peer = WorkerRank(
            self._rank.tp_rank if tp_rank is None else tp_rank,
            self._rank.pp_rank,
            self._rank.tp_size if tp_size is None else tp_size,
        )
        name = peer.agent_name(addr.engine_id)
        link = self._links.get(name)
        if link is not None and link.state is LinkState.FAILED:
            del self._links[name]  # a failed peer may have restarted: try again
            link = None
        if link is None:
            link = Link(name, addr, self._clock(), port=addr.port + peer.index)
            self._links[name] = link
            self._connect(link)
        elif link.addr is None:
            link.addr, link.port = addr, addr.port + peer.index
            self._connect(link)
        return link

    def can_notify(self, name: str) -> bool:
        """Best-effort notices (FAIL/ABORT) need only the peer's metadata."""
        try:
            return self._agent.has_remote(name)
        except Exception:  # a dead peer must not break our step
            return False

    def poll(self) -> list[Link]:
        """Advance handshakes; returns links that became FAILED in this call."""
        failed: list[Link] = []
        now = self._clock()
        for link in self._links.values():
            if link.state in (LinkState.FAILED, LinkState.REFUSED):
                continue
            self._refetch(link, now)
            # A link can be READY (their HELLO checked) before ours could be sent: keep trying.
            if not link.hello_sent and self.can_notify(link.name):
                self._send_hello(link)
            elif link.state is LinkState.CONNECTING and self._due(link, now):
                self._send_hello(link)  # theirs has not come: ours again
            if link.state is LinkState.CONNECTING and now - link.started > self._timeout_s:
                link.state = LinkState.FAILED
                link.reason = f"no handshake with {link.name} within {self._timeout_s:.1f}s"
                log.error("pd-connector: %s", link.reason)
                failed.append(link)
        return failed

    def on_message(self, sender: str, msg: Message) -> Link | None:
        """Handle HELLO/REFUSE/VERSION from ``sender``; returns its link if its state changed."""
        link = self._links.get(sender)
        if link is None:
            link = Link(sender, None, self._clock())
            self._links[sender] = link
        if msg.kind is Kind.HELLO:
            link = self._relink_if_restarted(link, msg.body)
            again = link.state is LinkState.READY  # the peer repeats: ours may not have come
            self._on_hello(link, msg.body)
            if again and link.state is LinkState.READY and self._due(link, self._clock()):
                self._send_hello(link)
        elif msg.kind is Kind.VERSION:
            self._refuse(
                link,
                f"peer speaks wire version {msg.body.get('v')!r}, we speak {self._compat.version}"
                f" (vLLM {self._hello.get('vllm_version', 'unknown')} at {self._agent.name})",
            )
        elif msg.kind is Kind.REFUSE:
            self._mark_refused(link, f"peer refused us: {msg.body.get('reason', '')}")
        else:
            return None
        return link

    # -- internals -----------------------------------------------------------------------------

    def _connect(self, link: Link) -> None:
        assert link.addr is not None
        port = link.port
        link.fetched_at = self._clock()
        try:
            self._agent.fetch_remote(link.name, link.addr.host, port)
            self._agent.send_local(link.addr.host, port)
        except Exception as exc:  # unreachable host: the handshake timeout reports it
            log.warning("pd-connector: metadata exchange with %s failed: %s", link.name, exc)

    def _relink_if_restarted(self, link: Link, body: dict[str, Any]) -> Link:
        """``link``, or a fresh one in its place if ``body`` is a HELLO from another
        incarnation of the peer than the one the link was made with."""
        incarnation = body.get("incarnation")
        new = None if incarnation is None else str(incarnation)
        if link.incarnation is None or new is None or new == link.incarnation:
            if link.incarnation is None:
                link.incarnation = new
            return link
        log.warning(
            "pd-connector: peer %s restarted (incarnation %s, was %s): linking again",
            link.name,
            new,
            link.incarnation,
        )
        self._on_restart(link.name)
        try:
            self._agent.remove_remote(link.name)
        except Exception as exc:  # not loaded (or gone): nothing to remove
            log.debug("pd-connector: removing %s's metadata failed: %s", link.name, exc)
        fresh = Link(link.name, link.addr, self._clock(), port=link.port, incarnation=new)
        self._links[link.name] = fresh
        if fresh.addr is not None:  # ours: the new peer fetched it already to say HELLO
            self._fetch(fresh)
        return fresh

    def _refetch(self, link: Link, now: float) -> None:
        """Ask again for the metadata of a link still without it: NIXL's metadata client
        keeps its socket to a listener, and the first fetch after the peer restarted goes
        down the dead one (NIXL drops it then: the next fetch connects afresh)."""
        if (
            link.addr is not None
            and link.fetched_at is not None
            and now - link.fetched_at >= min(_REFETCH_MAX_S, _REFETCH_S * 2**link.refetches)
            and not self.can_notify(link.name)
        ):
            link.refetches += 1
            self._fetch(link)

    def _fetch(self, link: Link) -> None:
        assert link.addr is not None
        link.fetched_at = self._clock()
        try:
            self._agent.fetch_remote(link.name, link.addr.host, link.port)
        except Exception as exc:  # the handshake timeout reports it
            log.warning("pd-connector: metadata fetch from %s failed: %s", link.name, exc)

    def _on_hello(self, link: Link, body: dict[str, Any]) -> None:
        try:
            peer = Compat(**body["compat"])
            layout = _peer_layout(peer, body.get("layout"))
        except (KeyError, TypeError, ValueError) as exc:
            self._refuse(link, f"malformed HELLO: {exc}")
            return
        mine = self._hello.get("layout") or {}
        bad = pair_mismatches(
            self._compat,
            peer,
            self._agent.name,
            link.name,
            int(mine.get("head_bytes", 0)),
            layout.head_bytes if layout is not None else 0,
        )
        if bad:
            # Both engines' vLLM versions beside the fields (the connector pairs releases, but
            # an operator reading one refusal should see what each side runs).
            versions = (
                f"vLLM {self._hello.get('vllm_version', 'unknown')} at {self._agent.name}, "
                f"{body.get('vllm_version', 'unknown')} at {link.name}"
            )
            self._refuse(link, f"incompatible peer ({versions}): " + "; ".join(bad))
            return
        if layout is not None:
            link.layout = layout
        link.peer_tp = peer.tp_size
        if link.addr is None and body.get("engine_id") is not None:
            addr = NixlAddress(str(body["engine_id"]), str(body["host"]), int(body["port"]))
            self.ensure(addr, int(body.get("tp_rank", self._rank.tp_rank)), peer.tp_size)
        if not link.hello_sent and self.can_notify(link.name):
            self._send_hello(link)
        if link.state is LinkState.CONNECTING:
            link.state = LinkState.READY
            link.handshake_s = self._clock() - link.started
            log.info("pd-connector: link to %s ready in %.3fs", link.name, link.handshake_s)

    def _send_hello(self, link: Link) -> None:
        if link.hello_sent:
            self._on_repeat()
        self._send(link, encode(Kind.HELLO, **self._hello))
        link.hello_sent, link.hello_at = True, self._clock()

    def _due(self, link: Link, now: float) -> bool:
        """Our HELLO was sent at least ``nudge_s`` ago (and may be sent again)."""
        return self._nudge_s > 0 and link.hello_sent and now - link.hello_at >= self._nudge_s

    def _refuse(self, link: Link, reason: str) -> None:
        if self.can_notify(link.name):
            self._send(link, encode(Kind.REFUSE, reason=reason))
        self._mark_refused(link, reason)

    def _mark_refused(self, link: Link, reason: str) -> None:
        link.state, link.reason = LinkState.REFUSED, reason
        log.error("pd-connector: refusing peer %s: %s", link.name, reason)

    def _send(self, link: Link, raw: bytes) -> None:
        try:
            self._agent.send_notif(link.name, raw)
        except Exception as exc:
            log.warning("pd-connector: notification to %s failed: %s", link.name, exc)


def _peer_layout(peer: Compat, wire: dict[str, Any] | None) -> CacheLayout | None:
    """The layout in a peer's HELLO, if any; ValueError if it contradicts the peer's Compat."""
    if wire is None:
        return None
    layout = CacheLayout.from_wire(wire)
    if (len(layout.layers), layout.block_bytes, layout.mem_type) != (
        peer.num_layers,
        peer.block_bytes,
        peer.mem_type,
    ):
        raise ValueError("the layout contradicts the compatibility fields")
    return layout
