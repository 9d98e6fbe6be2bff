"""vLLM 0.32's KV event payloads: the fake engines encode them byte for byte as vLLM does, and
the router decodes both event shapes (maps since vLLM PR #42892, arrays before)."""

from __future__ import annotations

import msgspec
import pytest

from router.kvindex.blocks import pack
from router.kvindex.wire import (
    Cleared,
    EventError,
    Removed,
    Stored,
    decode_batch,
    decode_seq,
    encode_seq,
)
from tests.fakes import kv_events as fake

# vLLM 0.32's own encoder (``msgspec.msgpack.Encoder().encode(KVEventBatch(...))``) for
# the events of EVENTS below, ts 1.5, rank 0. ARRAY: the same events with vLLM's structs
# declared ``array_like=True`` (the shape before the change), fields up to ``medium``.
MAP = bytes.fromhex(
    "93cb3ff80000000000009488a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "920b0cb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980001020304050607aa"
    "626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0"
    "89a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cfffffffffffffffffb1"
    "706172656e745f626c6f636b5f686173680ca9746f6b656e5f6964739408090a0baa626c6f636b5f7369"
    "7a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f69"
    "64780083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573910ba66d656469"
    "756da347505581a474797065b0416c6c426c6f636b73436c656172656400"
)
ARRAY = bytes.fromhex(
    "93cb3ff80000000000009497ab426c6f636b53746f726564920b0cc098000102030405060704c0a34750"
    "5597ab426c6f636b53746f72656491cfffffffffffffffff0c9408090a0b04c0a347505593ac426c6f63"
    "6b52656d6f766564910ba347505591b0416c6c426c6f636b73436c656172656400"
)
U64 = 2**64 - 1
EVENTS: list[fake.Event] = [
    fake.Stored([11, 12], None, list(range(8)), 4),
    fake.Stored([U64], 12, [8, 9, 10, 11], 4),
    fake.Removed([11]),
    fake.Cleared(),
]
DECODED = (
    Stored((11, 12), None, pack(range(8)), 4, "GPU", True),
    Stored((U64,), 12, pack([8, 9, 10, 11]), 4, "GPU", True),
    Removed((11,), "GPU", True),
    Cleared(),
)


def test_the_fakes_encode_array_events_as_vllm_did() -> None:
    assert fake.encode_batch(EVENTS, "array", 1.5) == ARRAY


def test_the_fakes_encode_map_events_as_vllm_032_does_but_for_the_group_field() -> None:
    """vLLM's second event names ``group_idx: 0`` (set by the test that made the bytes);
    the fakes leave it out, as vLLM does for its default (None)."""
    doc = msgspec.msgpack.decode(MAP)
    doc[1][1].pop("group_idx")
    assert fake.encode_batch(EVENTS, "map", 1.5) == msgspec.msgpack.encode(doc)


@pytest.mark.parametrize("payload", [MAP, ARRAY], ids=["map", "array"])
def test_both_shapes_decode_to_the_same_events(payload: bytes) -> None:
    batch = decode_batch(payload)
    assert batch.ts == 1.5 and batch.rank == 0 and batch.unknown == ()
    assert batch.events == DECODED


def test_a_batch_without_rank_and_with_bytes_hashes_and_a_new_event_kind() -> None:
    doc = [
        2.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [b"\x01" * 32],
                "parent_block_hash": None,
                "token_ids": [1, 2],
                "block_size": 2,
                "lora_id": None,
                "medium": None,
                "lora_name": None,
                "future_field": 7,
            },
            {"type": "BlockReused", "block_hashes": [1]},
        ],
    ]
    batch = decode_batch(msgspec.msgpack.encode(doc))
    assert batch.rank is None and batch.unknown == ("BlockReused",)
    assert batch.events == (Stored((b"\x01" * 32,), None, pack([1, 2]), 2, None, True),)


@pytest.mark.parametrize(
    "extra",
    [
        {"lora_id": 3},
        {"lora_name": "a", "extra_keys": [["a", "salt"]]},
        {"group_idx": 1},
        {"extra_keys": [["salt"]]},
    ],
)
def test_blocks_keyed_by_more_than_token_ids_are_not_plain(extra: dict[str, object]) -> None:
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }
    (stored,) = decode_batch(msgspec.msgpack.encode([1.0, [event], 0])).events
    assert isinstance(stored, Stored) and not stored.plain


def test_a_lora_block_is_keyed_with_its_adapter_name() -> None:
    """vLLM 0.32 publishes a LoRA block with its engine-local ``lora_id``, its
    ``lora_name`` and, per block, ``[lora_name]`` as extra keys: plain, tagged with the name."""
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": 3,
        "medium": "GPU",
        "lora_name": "sql",
        "extra_keys": [["sql"]],
    }
    (stored,) = decode_batch(msgspec.msgpack.encode([1.0, [event], 0])).events
    assert isinstance(stored, Stored) and stored.plain and stored.lora == "sql"


@pytest.mark.parametrize(
    "doc",
    [
        {"ts": 1},
        [1.0],
        ["x", []],
        [1.0, [{"block_hashes": [1]}]],
        [1.0, [{"type": "BlockStored", "block_hashes": ["x"], "token_ids": [], "block_size": 1}]],
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 0}]],
        [1.0, [{"type": "BlockRemoved", "block_hashes": 5}]],
        [1.0, [7]],
        [1.0, [], "rank"],
    ],
)
def test_malformed_batches_are_refused(doc: object) -> None:
    with pytest.raises(EventError):
        decode_batch(msgspec.msgpack.encode(doc))


def test_not_msgpack_is_refused() -> None:
    with pytest.raises(EventError):
        decode_batch(b"\xc1")


def test_sequence_frames() -> None:
    assert decode_seq((5).to_bytes(8, "big")) == 5
    assert decode_seq(fake.END_SEQ) == -1 == decode_seq(encode_seq(-1))
    with pytest.raises(EventError):
        decode_seq(b"\x00")
