"""Where each KV block of each layer lives in memory, read from the tensors vLLM hands the worker.

vLLM 0.32 allocates one buffer per KV-cache group and gives every attention layer a strided view
of it, logically ``[B, H, N, C]`` (block, KV head, token slot, K then V of one head at one token);
the physical order of the axes is the engine's KV cache layout (``vllm/v1/kv_cache_layout.py``),
which places the layer axis ``L`` too. A block manager block may be split into kernel blocks,
making the first axis ``num_blocks * r`` long.

This connector copies a block of a layer as one contiguous piece of ``block_bytes`` bytes,
``block_stride`` bytes after the previous block's. ``CacheLayout.from_tensors`` derives both from
each view's shape *and* strides and refuses a view whose block is not one piece:

* ``LBHNC`` (HND), ``LBNHC`` (NHD): layer-outer, blocks adjoin (``block_stride == block_bytes``);
* ``BLHNC``, ``BLNHC``: block-outer, a block's piece is followed by the other layers' pieces of
  that block (``block_stride`` is the whole packed block);
* ``LHBNC``, ``BHLNC``: head-outer, a block is one piece per KV head, apart: refused, unless the
  cache has one KV head (MLA's latent), where the piece is whole again.

The bytes *inside* a piece are in the layout's order (HNC or NHC), so both engines must run the
same layout: the handshake compares its name (``Compat.kv_layout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from connector.transport import Blocks, Desc

__all__ = ["LAYOUT_ADVICE", "CacheLayout", "LayoutError", "memory_type", "storage_regions"]

LAYOUT_ADVICE = (
    "set VLLM_KV_CACHE_LAYOUT=LBHNC (alias HND; LBNHC/NHD, BLHNC, BLNHC work too) on both "
    "engines, or choose an attention backend that supports it (--attention-backend)"
)


class LayoutError(ValueError):
    """A KV cache view whose blocks are not one contiguous piece each (or not blocks at all)."""


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The registered KV cache of one worker; each side sends its own to the peer in HELLO.

    Block ``b`` of layer ``l`` is the ``block_bytes`` bytes at ``layers[l] + b * block_stride``.
    """

    layers: tuple[int, ...]  # address of block 0 of each layer, in layer order
    num_blocks: int
    block_bytes: int
    block_stride: int
    device_id: int
    mem_type: str
    # Bytes from one KV head to the next inside a block when the head axis is the block's
    # outermost (HND layouts: a run of heads is one sub-piece, what unequal TP sizes write);
    # 0 when it is not (NHD, kernel blocks), so a block cannot be written by head slices.
    head_bytes: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "block_stride": self.block_stride,
            "device_id": self.device_id,
            "mem_type": self.mem_type,
            "head_bytes": self.head_bytes,
        }

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> CacheLayout:
        return cls(
            tuple(int(a) for a in obj["layers"]),
            int(obj["num_blocks"]),
            int(obj["block_bytes"]),
            int(obj["block_stride"]),
            int(obj["device_id"]),
            str(obj["mem_type"]),
            int(obj.get("head_bytes", 0)),
        )

    def block_rows(self, part: tuple[int, int] | None = None) -> list[Blocks]:
        """Every block of every layer, one strided row per layer: the list prepared once.
        ``part`` (offset, length): only those bytes of each block (a run of heads)."""
        offset, length = part if part is not None else (0, self.block_bytes)
        if offset < 0 or length <= 0 or offset + length > self.block_bytes:
            raise ValueError(f"bytes {offset}+{length} outside a block of {self.block_bytes}")
        return [
            (base + offset, length, self.device_id, self.block_stride, self.num_blocks)
            for base in self.layers
        ]

    def indices(self, layer: int, blocks: Sequence[int]) -> list[int]:
        """Positions of ``blocks`` of ``layer`` in ``block_rows``' list; ValueError for a block
        or layer this cache does not have (a peer's bad block id must not address other
        memory)."""
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"layer {layer} out of range (cache has {len(self.layers)})")
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} out of range (cache has {self.num_blocks})")
        return [layer * self.num_blocks + b for b in blocks]

    @classmethod
    def from_tensors(cls, tensors: Sequence[Any], num_blocks: int, mem_type: str) -> CacheLayout:
        """Derive the layout from the per-layer views (in layer order); ``LayoutError`` names
        the shape and strides of a view that is not laid out as whole blocks."""
        first = tensors[0]
        piece, stride = _geometry(first, num_blocks)
        for t in tensors[1:]:
            if (tuple(t.shape), tuple(t.stride()), t.dtype) != (
                tuple(first.shape),
                tuple(first.stride()),
                first.dtype,
            ):
                raise LayoutError(
                    f"layers differ: shape {tuple(t.shape)} strides {tuple(t.stride())} {t.dtype}"
                    f" vs shape {tuple(first.shape)} strides {tuple(first.stride())}"
                    f" {first.dtype}"
                )
        for t in tensors:
            _check_inside_storage(t, num_blocks, piece, stride)
        device = max(first.get_device(), 0)
        bases = tuple(int(t.data_ptr()) for t in tensors)
        heads = _head_bytes(first, num_blocks, piece)
        return cls(bases, num_blocks, piece, stride, device, mem_type, heads)


def _head_bytes(t: Any, num_blocks: int, piece: int) -> int:
    """``CacheLayout.head_bytes`` of view ``t`` (``[B, H, N, C]``) whose block is ``piece``
    bytes: the head stride if heads are the block's outermost axis, else 0."""
    if len(t.shape) != 4:  # MLA's [B, N, C]: the latent is the one head
        return piece
    heads = int(t.shape[1])
    if heads == 1:
        return piece
    if t.shape[0] != num_blocks:  # kernel blocks: a block holds several runs of the heads
        return 0
    head = int(t.stride()[1]) * int(t.element_size())
    return head if head * heads == piece else 0


def _geometry(t: Any, num_blocks: int) -> tuple[int, int]:
    """(block_bytes, block_stride) of view ``t``: the first axis is the block axis (vLLM's
    ``[B, H, N, C]``), ``r`` kernel blocks per block if it is ``num_blocks * r`` long; the other
    axes, in stride order, must tile one contiguous piece."""
    shape, strides, elem = tuple(t.shape), tuple(t.stride()), int(t.element_size())
    where = f"shape {shape}, strides {strides} (elements of {elem} B)"
    if not shape or num_blocks <= 0 or shape[0] % num_blocks:
        raise LayoutError(f"{where}: the first axis is not {num_blocks} blocks")
    ratio = shape[0] // num_blocks
    inner = [(st, n) for n, st in zip(shape[1:], strides[1:], strict=True) if n > 1]
    if ratio > 1:
        inner.append((strides[0], ratio))  # kernel blocks of one block
    piece = 1
    for st, n in sorted(inner):
        if st != piece:
            raise LayoutError(
                f"{where}: a block is not one contiguous piece (an axis of {n} is {st} elements"
                f" apart where {piece} would be contiguous: head- or K/V-outer)"
            )
        piece *= n
    stride = strides[0] * ratio
    if num_blocks > 1 and stride < piece:
        raise LayoutError(f"{where}: blocks overlap (stride {stride} < block {piece})")
    return piece * elem, stride * elem


def _check_inside_storage(t: Any, num_blocks: int, piece: int, stride: int) -> None:
    storage = t.untyped_storage()
    start, end = int(storage.data_ptr()), int(storage.data_ptr()) + int(storage.nbytes())
    base = int(t.data_ptr())
    if base < start or base + (num_blocks - 1) * stride + piece > end:
        raise LayoutError(f"blocks of a view at {base:#x} reach outside its buffer")


def storage_regions(tensors: Sequence[Any]) -> list[Desc]:
    """Memory to register: each distinct buffer under the views, whole, once (layers of one
    KV-cache group share one)."""
    seen: dict[int, Desc] = {}
    for t in tensors:
        storage = t.untyped_storage()
        ptr = int(storage.data_ptr())
        seen.setdefault(ptr, (ptr, int(storage.nbytes()), max(t.get_device(), 0)))
    return list(seen.values())


def memory_type(device_type: str, kv_buffer_device: str | None) -> str:
    """NIXL memory type of a KV cache on ``device_type`` (a torch device type), checked against
    ``kv_buffer_device`` (vLLM's ``--kv-transfer-config``; None: follow the cache).

    ``cpu`` + ``cpu`` is DRAM, an accelerator's own device type is VRAM. ``cpu`` for a cache in
    device memory asks for host staging, which this connector does not do; an accelerator
    device for a cache in host memory cannot be honoured: both raise ``ValueError``.
    """
    buffer = kv_buffer_device or device_type
    if buffer == device_type:
        return "DRAM" if device_type == "cpu" else "VRAM"
    if buffer == "cpu":
        raise ValueError(
            f"kv_buffer_device 'cpu' with the KV cache on {device_type} means staging KV in host"
            f' memory, which PipelinedPushConnector does not do: set "kv_buffer_device":'
            f' "{device_type}" (or leave it out) to register the {device_type} KV cache itself'
        )
    raise ValueError(
        f"kv_buffer_device {buffer!r} requires the KV cache on {buffer}, but it is on"
        f' {device_type}: set "kv_buffer_device": "{device_type}" (or leave it out)'
    )
