"""A fake engine's prefix cache and its KV event publisher, in vLLM 0.32's wire format.

:class:`Publisher` does what ``vllm.distributed.kv_events.ZmqEventPublisher`` does, on real
ZMQ sockets in the test's event loop: every batch goes out on a PUB socket as three frames
``(topic, seq, payload)``, ``seq`` 8 bytes big-endian from 0 (an XPUB socket, so that a test
can wait until a subscriber is connected, ``subscribed``; subscribers see a PUB), the payload
msgpack ``[ts, events, data_parallel_rank]``; the last ``buffer_steps`` batches are kept for a
ROUTER replay socket, which answers an 8-byte start sequence with every buffered batch from there,
then ``seq = -1`` and an empty payload. Events are tagged maps (vLLM 0.32) or tagged arrays
(earlier releases), ``encoding`` says which; ``tests/unit/test_kv_wire.py`` holds the bytes
vLLM 0.32's own encoder gives for the same events. A test can make the stream lose batches
(``lose``), restart the engine (``restart``) or limit its replay buffer.

:class:`PrefixCache` is the engine's cache, with its own chained block hashes (64-bit, as vLLM
sends them by default): ``hit`` is what a prompt would find, ``store`` caches a sequence's
full blocks (least recently used evicted past ``capacity``) and returns the events to publish.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

Encoding = Literal["map", "array"]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class Stored:
    hashes: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int
    lora: str | None = None  # the LoRA adapter the blocks were computed with


@dataclass(frozen=True)
class Removed:
    hashes: list[int]


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def event_doc(event: Event, encoding: Encoding) -> Any:
    """One event as vLLM encodes it (``medium`` "GPU", defaults left out). A LoRA block
    carries ``lora_id`` (the engine's own number for the adapter), ``lora_name`` and, per
    block, the untagged extra keys vLLM 0.32 publishes for it: ``[lora_name]``
    (``vllm/v1/core/kv_cache_utils.py``, ``to_event_extra_keys``)."""
    if isinstance(event, Stored):
        lora_id = None if event.lora is None else 7
        extra = None if event.lora is None else [[event.lora] for _ in event.hashes]
        if encoding == "array":
            doc: list[Any] = [
                "BlockStored",
                event.hashes,
                event.parent,
                event.token_ids,
                event.block_size,
                lora_id,
                "GPU",
            ]
            return doc if event.lora is None else [*doc, event.lora, extra]
        out = {
            "type": "BlockStored",
            "block_hashes": event.hashes,
            "parent_block_hash": event.parent,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": lora_id,
            "medium": "GPU",
            "lora_name": event.lora,
        }
        if extra is not None:
            out["extra_keys"] = extra
        return out
    if isinstance(event, Removed):
        if encoding == "array":
            return ["BlockRemoved", event.hashes, "GPU"]
        return {"type": "BlockRemoved", "block_hashes": event.hashes, "medium": "GPU"}
    return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}


def encode_batch(events: Sequence[Event], encoding: Encoding, ts: float, rank: int = 0) -> bytes:
    return msgspec.msgpack.encode([ts, [event_doc(e, encoding) for e in events], rank])


class Publisher:
    """One engine's publisher (see module doc). ``start`` binds; ``aclose`` closes."""

    def __init__(
        self, encoding: Encoding = "map", buffer_steps: int = 10_000, topic: str = ""
    ) -> None:
        self.encoding = encoding
        self.topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._router = self._ctx.socket(zmq.ROUTER)
        self.next_seq = 0
        self.lose = 0  # the next batches are buffered but never sent on PUB (a gap)
        self.replay_enabled = True
        self.replays = 0
        self.subscriptions = 0  # subscribe messages seen (each subscriber sends one)
        self.endpoint = ""
        self.replay_endpoint = ""
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for sock in (self._pub, self._router):
            sock.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.bind("tcp://127.0.0.1:*")
        self._router.bind("tcp://127.0.0.1:*")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks = [
            asyncio.create_task(self._serve_replay()),
            asyncio.create_task(self._count_subscribers()),
        ]

    async def subscribed(self, count: int = 1, timeout: float = 5.0) -> None:
        """Wait until ``count`` subscriptions in all have reached the publisher."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.subscriptions < count:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{self.subscriptions} subscriptions, wanted {count}")
            await asyncio.sleep(0.005)

    async def _count_subscribers(self) -> None:
        while True:
            message = await self._pub.recv()
            if message[:1] == b"\x01":
                self.subscriptions += 1

    def publish(self, events: Sequence[Event]) -> int:
        """Send one batch; returns its sequence number."""
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(events, self.encoding, time.time())
        self._buffer.append((seq, payload))
        if self.lose > 0:
            self.lose -= 1
        else:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """The engine starts again: sequence numbers from 0, an empty buffer."""
        self.next_seq = 0
        self._buffer.clear()

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or not self.replay_enabled:
                continue
            self.replays += 1
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._router.send_multipart(
                        [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                    )
            await self._router.send_multipart([client, b"", b"", END_SEQ, b""])

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.destroy(linger=0)


def _block_hash(parent: int | None, tokens: Sequence[int], lora: str | None = None) -> int:
    # As vLLM's, a LoRA block's hash covers the adapter: no prefix is shared across adapters.
    data = (parent or 0).to_bytes(8, "big") + b"".join(t.to_bytes(4, "big") for t in tokens)
    data += b"" if lora is None else b"lora:" + lora.encode()
    return int.from_bytes(hashlib.sha256(b"fake-engine" + data).digest()[:8], "big")


class PrefixCache:
    """A fake engine's prefix cache (see module doc)."""

    def __init__(self, block_size: int = 16, capacity: int = 100_000) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self, tokens: Sequence[int], lora: str | None = None) -> list[int]:
        out: list[int] = []
        parent = None
        bs = self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = _block_hash(parent, tokens[start : start + bs], lora)
            out.append(parent)
        return out

    def hit(self, tokens: Sequence[int], lora: str | None = None) -> int:
        """Prompt tokens found in the cache, as vLLM counts them (whole blocks, at most
        ``(len - 1) // block_size``), with ``lora``'s blocks only; the blocks found become
        most recently used."""
        found = 0
        for h in self.hashes(tokens, lora)[: max(0, len(tokens) - 1) // self.block_size]:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            found += 1
        return found * self.block_size

    def store(self, tokens: Sequence[int], lora: str | None = None) -> list[Event]:
        """Cache the full blocks of ``tokens`` (computed with the adapter ``lora``); the
        events that say so."""
        hashes = self.hashes(tokens, lora)
        first = next((i for i, h in enumerate(hashes) if h not in self._blocks), len(hashes))
        for h in hashes[:first]:
            self._blocks.move_to_end(h)
        if first == len(hashes):
            return []
        bs = self.block_size
        new = hashes[first:]
        events: list[Event] = [
            Stored(
                new,
                hashes[first - 1] if first else None,
                list(tokens[first * bs : len(hashes) * bs]),
                bs,
                lora,
            )
        ]
        for h in new:
            self._blocks[h] = None
        evicted = []
        while len(self._blocks) > self.capacity:
            evicted.append(self._blocks.popitem(last=False)[0])
        if evicted:
            events.append(Removed(evicted))
        return events

    def clear(self) -> list[Event]:
        self._blocks.clear()
        return [Cleared()]
