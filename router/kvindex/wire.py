"""vLLM 0.32's KV cache events on the wire, decoded (pure functions, no sockets).

An engine started with ``--kv-events-config`` publishes one ZMQ message per scheduler step
that changed its prefix cache: three frames, ``(topic, seq, payload)``. ``seq`` is 8 bytes
big-endian, counting from 0 at the engine's start; ``payload`` is msgpack (vLLM encodes it with
msgspec): an ``EventBatch`` always as an array ``[ts, events, data_parallel_rank]`` (the rank
may be left out), and each event **tagged**, in one of two shapes:

* a map keyed by field name, the tag under ``"type"`` (vLLM 0.32, since vLLM PR #42892):
  ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., ...}``;
* an array, the tag first and the fields in declaration order (earlier releases):
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, ...]``.

Both are decoded; fields added after the ones read here are ignored, and trailing fields left
out (msgspec's ``omit_defaults``) take their default. Block hashes are 64-bit integers by
default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or bytes: both are kept as they come.

The replay endpoint (a ZMQ ROUTER) answers a request frame holding an 8-byte start sequence
with one message per buffered batch from there, ``(topic, seq, payload)``, then an end marker
whose seq is -1 and payload empty (:data:`END_SEQ`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from router.kvindex.blocks import TOKEN_BYTES, pack

__all__ = [
    "END_SEQ",
    "Batch",
    "Cleared",
    "EventError",
    "Removed",
    "Stored",
    "decode_batch",
    "decode_seq",
    "encode_seq",
]

END_SEQ = -1

BlockHash = int | bytes
_DECODER = msgspec.msgpack.Decoder()

# Field order of the array encoding (vLLM's struct declaration order, tag first).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class EventError(ValueError):
    """A message that is not a well-formed batch of KV events."""


@dataclass(frozen=True, slots=True)
class Stored:
    """``BlockStored``: full blocks now in the engine's prefix cache, each chained to the one
    before (the first to ``parent``, None for a prompt's first block). ``plain`` is False for
    blocks whose hash also covers something besides token ids and their LoRA adapter
    (multimodal input, a cache salt, an adapter known only by the engine's own number) or
    that belong to another KV cache group than the first: the router cannot reproduce their
    key. ``lora``: the adapter the blocks were computed with (``lora_name``; None: the base
    model), whose blocks an engine matches only for that adapter's requests."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: bytes  # packed (router/kvindex/blocks.py)
    block_size: int
    medium: str | None
    plain: bool
    lora: str | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    """``BlockRemoved``: blocks evicted from the engine's prefix cache."""

    hashes: tuple[BlockHash, ...]
    medium: str | None
    plain: bool


@dataclass(frozen=True, slots=True)
class Cleared:
    """``AllBlocksCleared``: the engine's prefix cache was reset."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    """One published step: its events in order, and the tags of events not understood
    (newer vLLM releases may add kinds; they do not change the block set)."""

    ts: float
    events: tuple[Event, ...]
    rank: int | None
    unknown: tuple[str, ...] = ()


def encode_seq(seq: int) -> bytes:
    """A sequence number as the 8-byte big-endian frame (signed: -1 is the end marker)."""
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    """The sequence number of a frame; raises :class:`EventError` unless it is 8 bytes."""
    if len(frame) != 8:
        raise EventError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> Batch:
    """Decode one payload; raises :class:`EventError` for anything not a batch of events."""
    try:
        doc = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventError(f"not msgpack: {exc}") from None
    if not isinstance(doc, list) or not 2 <= len(doc) <= 3:
        raise EventError("a batch is an array [ts, events, rank]")
    ts, raw, *rest = doc
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(raw, list):
        raise EventError("a batch is an array [ts, events, rank]")
    rank = rest[0] if rest else None
    if rank is not None and not _is_int(rank):
        raise EventError("data_parallel_rank must be an integer or nil")
    events: list[Event] = []
    unknown: list[str] = []
    for item in raw:
        tag, fields = _fields(item)
        event = _event(tag, fields)
        if event is None:
            unknown.append(tag)
        else:
            events.append(event)
    return Batch(float(ts), tuple(events), rank, tuple(unknown))


def _fields(item: Any) -> tuple[str, dict[str, Any]]:
    """An event's tag and its fields by name, from either encoding."""
    if isinstance(item, dict):
        tag = item.get("type")
        if not isinstance(tag, str):
            raise EventError("an event map needs a string 'type'")
        return tag, item
    if isinstance(item, list) and item and isinstance(item[0], str):
        tag = item[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
        return tag, dict(zip(names, item[1:], strict=False))
    raise EventError("an event is a tagged map or a tagged array")


def _event(tag: str, f: dict[str, Any]) -> Event | None:
    if tag == "BlockStored":
        return _stored(f)
    if tag == "BlockRemoved":
        hashes = _hashes(f.get("block_hashes"))
        return Removed(hashes, _medium(f), _group(f) in (None, 0))
    if tag == "AllBlocksCleared":
        return Cleared()
    return None


def _stored(f: dict[str, Any]) -> Stored:
    hashes = _hashes(f.get("block_hashes"))
    parent = f.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise EventError("parent_block_hash must be an integer, bytes or nil")
    tokens = f.get("token_ids")
    if not isinstance(tokens, list):
        raise EventError("token_ids must be a list of integers")
    try:
        packed = pack(tokens)  # in C: what is not a 64-bit integer raises
    except (TypeError, OverflowError):
        raise EventError("token_ids must be a list of integers") from None
    size = f.get("block_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise EventError("block_size must be a positive integer")
    lora = f.get("lora_name")
    if lora is not None and not isinstance(lora, str):
        raise EventError("lora_name must be a string or nil")
    extra = f.get("extra_keys")
    plain = (
        # ``lora_id`` is the engine's own counter (vLLM's OpenAIServingModels numbers
        # adapters as they load): only the name is the same on every engine.
        (lora is not None or f.get("lora_id") is None)
        and _group(f) in (None, 0)
        and (extra is None or all(_lora_only(e, lora) for e in _seq(extra)))
        and len(packed) == size * len(hashes) * TOKEN_BYTES
    )
    return Stored(hashes, parent, packed, size, _medium(f), plain, lora)


def _lora_only(keys: Any, lora: str | None) -> bool:
    """Whether a block's published extra keys name nothing but its adapter: vLLM 0.32
    publishes a LoRA block's as ``[lora_name]`` (untagged; ``to_event_extra_keys`` in
    ``vllm/v1/core/kv_cache_utils.py``), a base model block's as None."""
    return keys is None or (lora is not None and isinstance(keys, list) and keys == [lora])


def _hashes(value: Any) -> tuple[BlockHash, ...]:
    if not isinstance(value, list) or not all(_is_hash(h) for h in value):
        raise EventError("block_hashes must be a list of integers or bytes")
    return tuple(value)


def _medium(f: dict[str, Any]) -> str | None:
    medium = f.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise EventError("medium must be a string or nil")
    return medium


def _group(f: dict[str, Any]) -> Any:
    return f.get("group_idx")


def _seq(value: Any) -> Sequence[Any]:
    if not isinstance(value, list):
        raise EventError("extra_keys must be a list or nil")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hash(value: Any) -> bool:
    return _is_int(value) or isinstance(value, bytes)
