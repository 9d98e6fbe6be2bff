"""Where each KV block of each layer lives in memory, and the WRITE descriptors between two caches.

vLLM hands the worker one paged tensor per attention layer. The block dimension is either the
first one (CPU backend: ``(num_blocks, 2, block_size, heads*head_dim)``, K and V inside a block,
one *segment*) or the second one after a K/V dimension of 2 (CUDA flash-attention style:
``(2, num_blocks, ...)``, two segments). Either way a block of a segment is ``block_bytes``
contiguous bytes, ``block_stride`` bytes after the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from connector.transport import Desc

__all__ = ["CacheLayout", "LayerLayout", "block_runs", "write_descs"]


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """One layer: base address of each segment (K and V, or one combined)."""

    segments: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The registered KV cache of one worker; D sends its own to P in HELLO."""

    layers: tuple[LayerLayout, ...]
    num_blocks: int
    block_bytes: int
    block_stride: int
    device_id: int
    mem_type: str

    def to_wire(self) -> dict[str, Any]:
        return {
            "layers": [list(layer.segments) for layer in self.layers],
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "block_stride": self.block_stride,
            "device_id": self.device_id,
            "mem_type": self.mem_type,
        }

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> CacheLayout:
        return cls(
            tuple(LayerLayout(tuple(int(a) for a in seg)) for seg in obj["layers"]),
            int(obj["num_blocks"]),
            int(obj["block_bytes"]),
            int(obj["block_stride"]),
            int(obj["device_id"]),
            str(obj["mem_type"]),
        )

    def is_dense(self) -> bool:
        """Whether consecutive blocks of a segment are adjacent (runs can be one descriptor)."""
        return self.block_stride == self.block_bytes

    def regions(self) -> list[Desc]:
        """Memory to register: every segment of every layer, whole."""
        size = self.block_stride * self.num_blocks
        return [(base, size, self.device_id) for layer in self.layers for base in layer.segments]

    @classmethod
    def from_tensors(cls, tensors: list[Any], num_blocks: int, mem_type: str) -> CacheLayout:
        """Derive the layout from the per-layer tensors (in layer order)."""
        first = tensors[0]
        elem = first.element_size()
        if first.shape[0] == num_blocks:
            block_dim, nseg = 0, 1
        elif first.shape[0] == 2 and first.shape[1] == num_blocks:
            block_dim, nseg = 1, 2
        else:
            raise ValueError(
                f"unsupported KV cache shape {tuple(first.shape)} for {num_blocks} blocks"
            )
        stride = first.stride(block_dim) * elem
        block_bytes = stride if block_dim == 0 else _inner_bytes(first, block_dim)
        layers = []
        for t in tensors:
            if tuple(t.shape) != tuple(first.shape):
                raise ValueError("all layers must share one KV cache shape")
            seg_stride = t.stride(0) * elem if nseg == 2 else 0
            layers.append(LayerLayout(tuple(t.data_ptr() + i * seg_stride for i in range(nseg))))
        device = max(first.get_device(), 0)
        return cls(tuple(layers), num_blocks, block_bytes, stride, device, mem_type)


def _inner_bytes(tensor: Any, block_dim: int) -> int:
    n = 1
    for size in tensor.shape[block_dim + 1 :]:
        n *= size
    return int(n * tensor.element_size())


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Merge ``src[i] -> dst[i]`` block pairs into ``(src_start, dst_start, count)`` runs where
    both sides are consecutive, so a contiguous prompt becomes one descriptor per segment."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def write_descs(
    local: CacheLayout, remote: CacheLayout, layer: int, runs: list[tuple[int, int, int]]
) -> tuple[list[Desc], list[Desc]]:
    """Descriptor lists for writing ``runs`` of one layer from ``local`` into ``remote``."""
    src: list[Desc] = []
    dst: list[Desc] = []
    lseg, rseg = local.layers[layer].segments, remote.layers[layer].segments
    if not (local.is_dense() and remote.is_dense()):
        # Padded blocks: a run would also copy the padding between blocks; write one by one.
        runs = [(s + i, d + i, 1) for s, d, n in runs for i in range(n)]
    for lbase, rbase in zip(lseg, rseg, strict=True):
        for s, d, n in runs:
            length = (n - 1) * local.block_stride + local.block_bytes
            src.append((lbase + s * local.block_stride, length, local.device_id))
            dst.append((rbase + d * remote.block_stride, length, remote.device_id))
    return src, dst
