"""The router's own key for a KV block: a chained hash of token ids, as a 64-bit integer.

vLLM names a block by a hash the router cannot reproduce without the engine's settings
(``--prefix-caching-hash-algo``, its seed, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). Its events
carry each block's token ids, so the router keys blocks itself: the key of block ``i`` is a
hash of the key of block ``i - 1`` and the block's token ids (the first block chains to
:data:`ROOT`). Equal keys at block ``i`` therefore mean equal token ids up to the block's end,
whichever engine computed them, so a request's keys, computed from its token ids, name exactly
the blocks an engine's prefix cache would match. BLAKE2b with an 8-byte digest: a collision
between two of a router's few million live blocks has a chance of about 1e-7.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

__all__ = ["ROOT", "block_key", "chain_keys", "prefix_keys"]

ROOT = 0


def block_key(parent: int, token_ids: Iterable[int]) -> int:
    """The key of a block holding ``token_ids`` after the block keyed ``parent``."""
    digest = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


def chain_keys(parent: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Keys of the full blocks of ``token_ids`` (a partial last block has none), the first
    chained to ``parent``."""
    keys: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


def prefix_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Keys of a prompt's full blocks, from its first token."""
    return chain_keys(ROOT, token_ids, block_size)
