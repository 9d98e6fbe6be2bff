"""WRITEs of whole KV blocks through NIXL descriptor lists prepared once, not per WRITE.

Our list (every block of every layer) is prepared at registration; a peer's on the first WRITE
to it, again only when the peer announces another layout (a new HELLO, e.g. after a restart).
A WRITE then names blocks by index. At the GPU block size (16 tokens) a prompt has 8 times the
blocks it has at the CPU's 128, so building descriptors per WRITE on the forward thread would
cost 8 times as much there.

P and D of unequal tensor-parallel sizes write a run of heads of each block (``part``: offsets
in our block and the peer's, and the length; ``tp_map.byte_part``): the lists over those bytes
are prepared the same way, once per part (a worker writes each peer one part, always the same).
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
        self._local_parts: dict[tuple[int, int], object] = {}  # (offset, length) -> list
        # peer -> (its layout, the part of its blocks, list)
        self._remote: dict[str, tuple[CacheLayout, tuple[int, int] | None, object]] = {}

    def write(
        self,
        peer: str,
        remote: CacheLayout,
        layer: int,
        src: Sequence[int],
        dst: Sequence[int],
        notif: bytes,
        part: tuple[int, int, int] | None = None,
    ) -> object:
        """Post one WRITE of our blocks ``src[i]`` of ``layer`` into ``peer``'s ``dst[i]``;
        ``remote`` is the layout ``peer`` announced; ``part`` (our offset, the peer's offset,
        length): only those bytes of each block, else whole blocks, which must then be the
        same size on both sides. Returns the transfer's handle; raises if a block id is out
        of range, the blocks differ in size, or posting fails."""
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
        if part is None and remote.block_bytes != self._layout.block_bytes:
            raise ValueError(
                f"whole blocks of {self._layout.block_bytes} B cannot fill {peer}'s blocks of"
                f" {remote.block_bytes} B (unequal tensor-parallel sizes write head slices)"
            )
        local_idx = self._layout.indices(layer, src)
        remote_idx = remote.indices(layer, dst)
        local = self._local if part is None else self._local_part(part[0], part[2])
        handle = self._prepared(peer, remote, None if part is None else (part[1], part[2]))
        return self._agent.post_write(peer, local, local_idx, handle, remote_idx, notif)

    def bytes_of(self, blocks: int, length: int | None = None) -> int:
        """Bytes a WRITE of ``blocks`` blocks of one layer moves (``length`` of each, if a
        part)."""
        return blocks * (self._layout.block_bytes if length is None else length)

    def forget(self, peer: str) -> None:
        """Release ``peer``'s prepared list, if any (the peer restarted: its memory is gone)."""
        entry = self._remote.pop(peer, None)
        if entry is not None:
            self._release(entry[2])

    def close(self) -> None:
        """Release every prepared list (shutdown, before memory is deregistered)."""
        for _, _, handle in self._remote.values():
            self._release(handle)
        self._remote.clear()
        for handle in self._local_parts.values():
            self._release(handle)
        self._local_parts.clear()
        self._release(self._local)

    def _local_part(self, offset: int, length: int) -> object:
        handle = self._local_parts.get((offset, length))
        if handle is None:
            rows = self._layout.block_rows((offset, length))
            handle = self._agent.prep_blocks(None, rows, self._layout.mem_type)
            self._local_parts[(offset, length)] = handle
        return handle

    def _prepared(self, peer: str, remote: CacheLayout, part: tuple[int, int] | None) -> object:
        entry = self._remote.get(peer)
        if entry is not None and entry[0] is remote and entry[1] == part:
            return entry[2]
        if entry is not None:  # the peer announced another layout: its old list is stale
            self._release(entry[2])
            del self._remote[peer]
        handle = self._agent.prep_blocks(peer, remote.block_rows(part), remote.mem_type)
        self._remote[peer] = (remote, part, handle)
        return handle

    def _release(self, handle: object) -> None:
        try:
            self._agent.release_prepped(handle)
        except Exception as exc:  # shutting down or a dead peer: nothing more to do
            log.debug("pd-connector: releasing a descriptor list failed: %s", exc)
