"""KV caches as vLLM 0.32 allocates them: one buffer, one strided ``[B, H, N, C]`` view per layer.

vLLM 0.32 (``vllm/v1/kv_cache_layout.py``, ``kv_cache_interface.py``) describes the cache of one
KV-cache group by the logical axes ``[L, B, H, N, C]`` (layer, block, KV head, token slot of the
block, content: K then V of one head at one token, in bytes) and a *layout*, the physical order
of those axes. Each layer gets a view of the shared int8 buffer, ``[B, H, N, C]`` with C
reinterpreted in the KV dtype; that view is what ``register_kv_caches`` receives. The names
below are vLLM's ``KVCacheLayout`` members: ``LBNHC`` is FlashAttention's NHD, ``LBHNC`` HND
(vLLM's CPU attention and FlashInfer), the others head- or block-outer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["LAYOUTS", "KvCache", "KvShape", "build", "default_layouts", "mem_type"]

# Physical order of the logical axes (0=L, 1=B, 2=H, 3=N, 4=C), outermost first.
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


@dataclass(frozen=True, slots=True)
class KvShape:
    """One KV-cache group of a small attention model."""

    layers: int = 4
    blocks: int = 48
    heads: int = 2  # KV heads
    block_size: int = 16  # vLLM's default on CUDA
    head_size: int = 64
    dtype_name: str = "bfloat16"

    @property
    def content_bytes(self) -> int:
        """C: K and V of one head at one token."""
        return 2 * self.head_size * _DTYPE_BYTES[self.dtype_name]


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True, slots=True)
class KvCache:
    """A registered-to-be KV cache: the dtype views vLLM hands the connector, by layer name,
    and the same memory as int8 ``[B, N, H, C]`` views (token slots before heads) that the
    check's kernels write and compare through."""

    buffer: torch.Tensor
    views: dict[str, torch.Tensor]
    slots: list[torch.Tensor]  # per layer, in layer order: [B, N, H, C] int8
    shape: KvShape
    layout: str


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def build(shape: KvShape, layout: str, device: str) -> KvCache:
    """A zeroed cache of ``shape`` in ``layout`` on ``device`` (``cpu`` or ``cuda``)."""
    import torch

    order = LAYOUTS[layout]
    logical = (shape.layers, shape.blocks, shape.heads, shape.block_size, shape.content_bytes)
    strides = [0] * 5
    size = 1
    for axis in reversed(order):  # innermost first: each axis spans everything inside it
        strides[axis] = size
        size *= logical[axis]
    buffer = torch.zeros(size, dtype=torch.int8, device=device)
    cube = torch.as_strided(buffer, logical, strides)
    dtype = getattr(torch, shape.dtype_name)
    views = {layer_name(i): cube[i].view(dtype) for i in range(shape.layers)}
    slots = [cube[i].permute(0, 2, 1, 3) for i in range(shape.layers)]
    return KvCache(buffer, views, slots, shape, layout)


def default_layouts(device: str) -> tuple[str, ...]:
    """The layouts vLLM 0.32 resolves by default: HND on CPU (its CPU attention reads only
    that); on CUDA NHD (FlashAttention) and HND (FlashInfer on some GPUs)."""
    return ("LBHNC",) if device == "cpu" else ("LBNHC", "LBHNC")


def mem_type(device: str) -> str:
    """NIXL's memory type for a cache on ``device``."""
    return "DRAM" if device == "cpu" else "VRAM"
