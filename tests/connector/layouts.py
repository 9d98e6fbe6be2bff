"""KV caches laid out as vLLM 0.32's model runner lays them out, for connector tests.

vLLM (``kv_cache_interface.create_kv_cache_views``) allocates one int8 buffer per KV-cache
group, views it as the logical ``[L, B, H, N, C]`` (layer, block, KV head, token slot, content
bytes: K then V of one head at one token) with the strides of a layout, and hands the worker
``view[l].view(dtype)`` per layer. A layout names the physical order of those axes, outermost
first (``vllm/v1/kv_cache_layout.py``). Built here with ``torch.as_strided`` the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scripts.gpu_check.kv import LAYOUTS  # vLLM 0.32's layouts: the one table of them

if TYPE_CHECKING:
    import torch

__all__ = ["LAYOUTS", "strided_caches"]


def strided_caches(
    layout: str,
    layers: int,
    blocks: int,
    heads: int,
    block_size: int,
    content: int,
    *,
    dtype: torch.dtype | None = None,
    kernel_ratio: int = 1,
    block_stride_bytes: int | None = None,
) -> dict[str, torch.Tensor]:
    """Per-layer ``[B, H, N, C]`` views (C = ``content`` elements of ``dtype``, float32 by
    default) over one zeroed buffer in ``layout``.

    ``kernel_ratio`` r > 1 splits each block into r kernel blocks of ``block_size / r`` tokens,
    as vLLM does for a backend with smaller kernel blocks (layer-outer layouts only): the views'
    first axis is then ``blocks * r`` long. ``block_stride_bytes`` fixes the stride between
    blocks (vLLM pads pages to an alignment; layer-outer layouts).
    """
    import torch

    dtype = dtype or torch.float32
    elem = torch.empty(0, dtype=dtype).element_size()
    order = LAYOUTS[layout]
    assert block_size % kernel_ratio == 0
    logical = [layers, blocks * kernel_ratio, heads, block_size // kernel_ratio, content * elem]
    fixed_block = None
    if block_stride_bytes is not None or kernel_ratio > 1:
        assert order[0] == 0, "a fixed block stride here is for layer-outer layouts"
        page = heads * block_size * content * elem
        fixed_block = (block_stride_bytes or page) // kernel_ratio
    strides = [0] * 5
    span = 1
    for axis in reversed(order):  # innermost first: each axis spans everything inside it
        strides[axis] = fixed_block if axis == 1 and fixed_block is not None else span
        span = strides[axis] * logical[axis]
    buffer = torch.zeros(span, dtype=torch.int8)
    cube = torch.as_strided(buffer, logical, strides)
    return {f"model.layers.{i}.self_attn.attn": cube[i].view(dtype) for i in range(layers)}
