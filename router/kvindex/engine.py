"""One engine's prefix cache as its KV events tell it: the blocks it holds, by the router's key.

:class:`EngineIndex` is the only owner of that state; its stream (``router/kvindex/stream.py``)
applies the engine's batches in sequence order and says whether the set is complete
(``known``): every event since the engine started, or since its cache was last cleared, was
applied. An incomplete set is never read as "holds nothing": the scorer treats such an engine
as unknown (``router/kvindex/route.py``).

Blocks are tracked per engine block (medium and engine hash, as ``BlockRemoved`` names them),
with a count: two blocks with one hash (computed by two requests in the same step) are two
stores and two removals in vLLM. Each maps to the router's key (``router/kvindex/blocks.py``),
computed from the event's token ids chained to its parent's key; a block whose parent the
index does not hold (evicted by the bound, or stored before a gap) gets no key and is counted
as ``unkeyed``, as are blocks whose hash covers more than token ids and their LoRA adapter
(multimodal input, cache salt, a second KV cache group) and partial blocks (smaller than the
engine's block). A LoRA adapter's first block chains to the adapter's own root
(``router/kvindex/blocks.py``), so its keys never equal the base model's or another
adapter's.

Memory is bounded: past ``max_blocks`` engine blocks, the least recently stored are dropped
(``evicted``): an engine would evict its least recently used first too, and a dropped block
only makes a prediction lower, never wrong the other way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.kvindex.blocks import adapter_root, chain_keys
from router.kvindex.wire import Batch, BlockHash, Cleared, Removed, Stored

__all__ = ["EngineIndex", "StreamStats"]

_EngineBlock = tuple[str | None, BlockHash]


@dataclass(slots=True)
class StreamStats:
    """Counters of one engine's stream, read by the metrics at scrape time."""

    batches: int = 0
    stored: int = 0  # blocks
    removed: int = 0  # blocks
    cleared: int = 0  # AllBlocksCleared events
    unknown_events: int = 0  # event kinds this router does not know (ignored)
    decode_errors: int = 0  # batches that could not be decoded (the set became unknown)
    unkeyed: int = 0  # stored blocks the index could not key (see module doc)
    evicted: int = 0  # blocks dropped by the memory bound
    gaps: int = 0  # missing sequence numbers found
    gaps_filled: int = 0  # ... and filled by a replay
    gaps_unfilled: int = 0  # ... that no replay could fill (the set became unknown)
    restarts: int = 0  # the engine restarted (its sequence numbers began again)
    replays: int = 0  # replay requests sent


@dataclass(slots=True)
class _Entry:
    key: int
    count: int


class EngineIndex:
    """The blocks one engine holds (see module doc)."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.known = False
        self.block_size: int | None = None
        self.stats = StreamStats()
        self._entries: dict[_EngineBlock, _Entry] = {}
        self._held: dict[int, int] = {}  # router key -> engine blocks with that key

    @property
    def blocks(self) -> int:
        """Engine blocks indexed now (what ``max_blocks`` bounds)."""
        return len(self._entries)

    def clear(self) -> None:
        """Forget every block (the engine's cache was reset, or the set is no longer
        trusted); ``known`` is the caller's to set."""
        self._entries.clear()
        self._held.clear()

    def apply(self, batch: Batch) -> None:
        """Apply one batch's events in order."""
        self.stats.batches += 1
        self.stats.unknown_events += len(batch.unknown)
        for event in batch.events:
            if isinstance(event, Stored):
                self._store(event)
            elif isinstance(event, Removed):
                self._remove(event)
            elif isinstance(event, Cleared):
                self.stats.cleared += 1
                self.clear()
                self.known = True  # empty now, and every later event will be applied

    def holds(self, key: int) -> bool:
        """Whether the engine holds the block with the router's key ``key``."""
        return key in self._held

    def matched(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` (a prompt's block keys, in order) the engine holds from the
        first on: the prefix its cache would match."""
        held = self._held
        for i, key in enumerate(keys):
            if key not in held:
                return i
        return len(keys)

    def _store(self, ev: Stored) -> None:
        n = len(ev.hashes)
        size = self.block_size
        if not ev.plain or (size is not None and ev.block_size < size):
            self.stats.unkeyed += n
            return
        if size is None or ev.block_size > size:
            if size is not None:  # what was indexed were partial blocks
                self.clear()
            self.block_size = size = ev.block_size
        parent = adapter_root(ev.lora)
        if ev.parent is not None:
            entry = self._entries.get((ev.medium, ev.parent))
            if entry is None:
                self.stats.unkeyed += n
                return
            parent = entry.key
        keys = chain_keys(parent, ev.token_ids, size)
        for block_hash, key in zip(ev.hashes, keys, strict=True):
            self._add((ev.medium, block_hash), key)

    def _add(self, block: _EngineBlock, key: int) -> None:
        self.stats.stored += 1
        entry = self._entries.pop(block, None)  # re-inserted last: most recently stored
        if entry is None:
            entry = _Entry(key, 0)
            self._held[key] = self._held.get(key, 0) + 1
        entry.count += 1
        self._entries[block] = entry
        while len(self._entries) > self.max_blocks:
            first, oldest = next(iter(self._entries.items()))
            self._drop(first, oldest)
            self.stats.evicted += 1

    def _remove(self, ev: Removed) -> None:
        if not ev.plain:
            return  # another KV cache group: never stored here
        for block_hash in ev.hashes:
            block = (ev.medium, block_hash)
            entry = self._entries.get(block)
            if entry is None:
                continue  # never keyed, or dropped by the bound
            self.stats.removed += 1
            entry.count -= 1
            if entry.count <= 0:
                self._drop(block, entry)

    def _drop(self, block: _EngineBlock, entry: _Entry) -> None:
        del self._entries[block]
        left = self._held[entry.key] - 1
        if left:
            self._held[entry.key] = left
        else:
            del self._held[entry.key]
