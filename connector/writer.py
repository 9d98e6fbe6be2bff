"""WRITEs of whole KV blocks through NIXL descriptor lists prepared once, not per WRITE.

Our list (every block of every layer) is prepared at registration; a peer's on the first WRITE
to it, again only when the peer announces another layout (a new HELLO, e.g. after a restart).
A WRITE then names blocks by index. At the GPU block size (16 tokens) a prompt has 8 times the
blocks it has at the CPU's 128, so building descriptors per WRITE on the forward thread would
cost 8 times as much there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from connector.layout import CacheLayout
from connector.transport import NixlAgent

__all__ = ["BlockWriter"]

# Under "vllm." so the lines land in the engine log with vLLM's format and level.
log = logging.getLogger(f"vllm.{__name__}")


class BlockWriter:
    """One rank's prepared descriptor lists: ours and each peer's; their only owner."""

    def __init__(self, agent: NixlAgent, layout: CacheLayout) -> None:
        self._agent = agent
        self._layout = layout
        self._local = agent.prep_blocks(None, layout.block_rows(), layout.mem_type)
        self._remote: dict[str, tuple[CacheLayout, object]] = {}  # peer -> (its layout, list)

    def write(
        self,
        peer: str,
        remote: CacheLayout,
        layer: int,
        src: Sequence[int],
        dst: Sequence[int],
        notif: bytes,
    ) -> object:
        """Post one WRITE of our blocks ``src[i]`` of ``layer`` into ``peer``'s ``dst[i]``;
        ``remote`` is the layout ``peer`` announced. Returns the transfer's handle; raises if
        a block id is out of range or posting fails."""
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
        local_idx = self._layout.indices(layer, src)
        remote_idx = remote.indices(layer, dst)
        handle = self._prepared(peer, remote)
        return self._agent.post_write(peer, self._local, local_idx, handle, remote_idx, notif)

    def bytes_of(self, blocks: int) -> int:
        """Bytes a WRITE of ``blocks`` blocks of one layer moves."""
        return blocks * self._layout.block_bytes

    def close(self) -> None:
        """Release every prepared list (shutdown, before memory is deregistered)."""
        for _, handle in self._remote.values():
            self._release(handle)
        self._remote.clear()
        self._release(self._local)

    def _prepared(self, peer: str, remote: CacheLayout) -> object:
        entry = self._remote.get(peer)
        if entry is not None and entry[0] is remote:
            return entry[1]
        if entry is not None:  # the peer announced another layout: its old list is stale
            self._release(entry[1])
            del self._remote[peer]
        handle = self._agent.prep_blocks(peer, remote.block_rows(), remote.mem_type)
        self._remote[peer] = (remote, handle)
        return handle

    def _release(self, handle: object) -> None:
        try:
            self._agent.release_prepped(handle)
        except Exception as exc:  # shutting down or a dead peer: nothing more to do
            log.debug("pd-connector: releasing a descriptor list failed: %s", exc)
