"""The router's own key for a KV block: a chained hash of token ids, as a 64-bit integer.

vLLM names a block by a hash the router cannot reproduce without the engine's settings
(``--prefix-caching-hash-algo``, its seed, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). Its events
carry each block's token ids, so the router keys blocks itself: the key of block ``i`` is a
hash of the key of block ``i - 1`` and the block's token ids (the first block chains to
:data:`ROOT`). Equal keys at block ``i`` therefore mean equal token ids up to the block's end,
whichever engine computed them, so a request's keys, computed from its token ids, name exactly
the blocks an engine's prefix cache would match. BLAKE2b with an 8-byte digest: a collision
between two of a router's few million live blocks has a chance of about 1e-7.

A LoRA adapter's blocks chain from a root of their own (:func:`adapter_root`, from its name):
vLLM's block hash covers the adapter (``("lora", name, path)`` in its extra keys), so an
engine never matches an adapter's prompt with the base model's blocks or another adapter's,
and neither do the router's keys.

Token ids are hashed packed (:func:`pack`: 8 bytes each, little-endian), packed once per
event or request, so a key costs one hash call over a slice of bytes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

__all__ = [
    "ROOT",
    "TOKEN_BYTES",
    "adapter_root",
    "block_key",
    "chain_keys",
    "pack",
    "prefix_keys",
]

ROOT = 0
TOKEN_BYTES = 8


def pack(token_ids: Sequence[int]) -> bytes:
    """Token ids as the bytes keys are made of; raises TypeError or OverflowError for
    anything that is not a 64-bit integer."""
    packed = array("q", token_ids)
    if packed.itemsize != TOKEN_BYTES:  # pragma: no cover (C long long is 8 bytes)
        raise OverflowError("token ids need 8-byte integers")
    return packed.tobytes() if array("h", [1]).tobytes() == b"\x01\x00" else _swapped(packed)


def _swapped(packed: array[int]) -> bytes:  # pragma: no cover (big-endian hosts)
    packed.byteswap()
    return packed.tobytes()


def adapter_root(adapter: str | None) -> int:
    """The key a prompt's first block chains to: :data:`ROOT` for the base model, a hash of
    the name for a LoRA adapter (the same on every engine and replica)."""
    if adapter is None:
        return ROOT
    digest = hashlib.blake2b(b"lora\0" + adapter.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def block_key(parent: int, block: bytes | memoryview) -> int:
    """The key of a block whose packed token ids are ``block``, after the block ``parent``."""
    digest = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    digest.update(block)
    return int.from_bytes(digest.digest(), "little")


def chain_keys(parent: int, packed: bytes, block_size: int) -> list[int]:
    """Keys of the full blocks of ``packed`` token ids (a partial last block has none), the
    first chained to ``parent``."""
    step = block_size * TOKEN_BYTES
    view = memoryview(packed)
    keys: list[int] = []
    for start in range(0, len(packed) - step + 1, step):
        parent = block_key(parent, view[start : start + step])
        keys.append(parent)
    return keys


def prefix_keys(token_ids: Sequence[int], block_size: int, adapter: str | None = None) -> list[int]:
    """Keys of a prompt's full blocks, from its first token (as ``adapter``'s, if given)."""
    return chain_keys(adapter_root(adapter), pack(token_ids), block_size)
