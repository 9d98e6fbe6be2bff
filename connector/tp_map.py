"""Which P worker writes which KV heads into which D worker, for P and D of different TP sizes.

Pure: no NIXL, no torch; ``pair_mismatches`` is the handshake's check of two workers. With
tensor parallelism each worker holds ``H / tp`` of a model's ``H`` KV heads (worker ``r`` the
``r``-th run of them); vLLM's NixlConnector maps them the same way
("heterogeneous TP", ``nixl/base_worker.py``). For P at ``tp_p`` and D at ``tp_d`` workers:

* equal sizes: P worker ``r`` writes its whole blocks into D worker ``r`` (the path of old);
* D larger (``k = tp_d / tp_p``): P worker ``r`` writes ``k`` slices of its heads, slice ``s``
  (``H / tp_d`` heads) into all heads of D worker ``r * k + s``; each D worker hears one P;
* P larger (``k = tp_p / tp_d``): P worker ``r`` writes all its heads into D worker ``r // k``
  at head ``(r % k) * H / tp_p``; each D worker hears ``k`` Ps and is done after ``k`` DONEs;
* MLA: the latent is one head, the same on every worker (replicated, not split): with D
  larger P worker ``r`` writes its whole latent to each of its ``k`` D workers; with P larger
  only P worker ``r * k`` writes D worker ``r`` (the others hold the same bytes), so every D
  worker still hears one P.

Sizes that are not a whole ratio of each other, a head count either size does not divide
(vLLM then replicates heads across workers; mapping those is not supported) and unequal
pipeline-parallel sizes are refused with ``TpMapError``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from connector.metadata import Compat

__all__ = [
    "HeadSlice",
    "TpMapError",
    "TpPlace",
    "byte_part",
    "check",
    "pair_mismatches",
    "sources",
    "targets",
]


class TpMapError(ValueError):
    """P's and D's parallel sizes (or head count) cannot be mapped onto each other."""


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """One P worker's WRITE target: ``heads`` KV heads from its own head ``src_head`` on, into
    D worker ``d_rank``'s heads from ``dst_head`` on (head indices local to each worker)."""

    d_rank: int
    src_head: int
    dst_head: int
    heads: int


@dataclass(frozen=True, slots=True)
class TpPlace:
    """A worker's place for the map: its TP rank and size, the model's KV heads in all (per
    worker times TP; 1 for MLA) and whether the cache is MLA's replicated latent."""

    rank: int = 0
    size: int = 1
    total_heads: int = 1
    mla: bool = False

    def targets(self, d_tp: int) -> list[HeadSlice]:
        """As P: the D workers (of ``d_tp``) this worker writes, and the heads of each."""
        return targets(self.size, d_tp, self.rank, self.total_heads, self.mla)

    def sources(self, p_tp: int) -> list[int]:
        """As D: the P workers (of ``p_tp``) that write this worker."""
        return sources(p_tp, self.size, self.rank, self.total_heads, self.mla)


def check(tp_p: int, tp_d: int, total_heads: int, mla: bool, pp_p: int = 1, pp_d: int = 1) -> None:
    """Raise ``TpMapError`` (saying why and what would work) unless the sizes map.

    ``total_heads``: the model's KV heads (ignored for MLA, whose latent is replicated)."""
    if tp_p < 1 or tp_d < 1:
        raise TpMapError(f"tensor-parallel sizes must be positive (P {tp_p}, D {tp_d})")
    if pp_p != pp_d:
        raise TpMapError(
            f"P runs pipeline-parallel size {pp_p} and D {pp_d}: unequal pipeline-parallel"
            " sizes are not supported (run both with the same --pipeline-parallel-size)"
        )
    big, small = max(tp_p, tp_d), min(tp_p, tp_d)
    if big % small:
        raise TpMapError(
            f"P's tensor-parallel size {tp_p} and D's {tp_d} are not a whole ratio of each"
            " other (one must divide the other, e.g. 1 and 2, 2 and 8)"
        )
    if mla or tp_p == tp_d:
        return
    if total_heads % big:
        raise TpMapError(
            f"{total_heads} KV heads do not divide among {big} workers (P TP {tp_p}, D TP"
            f" {tp_d}): with replicated heads only equal tensor-parallel sizes are supported"
        )


def targets(tp_p: int, tp_d: int, p_rank: int, total_heads: int, mla: bool) -> list[HeadSlice]:
    """The D workers P worker ``p_rank`` writes, with the heads it writes to each (in D rank
    order; empty for an MLA P worker whose latent another P worker writes)."""
    check(tp_p, tp_d, total_heads, mla)
    _check_rank(p_rank, tp_p, "P")
    heads_p = 1 if mla else total_heads // tp_p
    if tp_p == tp_d:
        return [HeadSlice(p_rank, 0, 0, heads_p)]
    if tp_d > tp_p:
        k = tp_d // tp_p
        heads_d = 1 if mla else total_heads // tp_d
        step = 0 if mla else heads_d  # MLA: every D worker gets the whole latent
        return [HeadSlice(p_rank * k + s, s * step, 0, heads_d) for s in range(k)]
    k = tp_p // tp_d
    if mla:
        return [HeadSlice(p_rank // k, 0, 0, 1)] if p_rank % k == 0 else []
    return [HeadSlice(p_rank // k, 0, (p_rank % k) * heads_p, heads_p)]


def sources(tp_p: int, tp_d: int, d_rank: int, total_heads: int, mla: bool) -> list[int]:
    """The P workers that write D worker ``d_rank`` (each sends its own DONE)."""
    check(tp_p, tp_d, total_heads, mla)
    _check_rank(d_rank, tp_d, "D")
    if tp_p <= tp_d:
        return [d_rank // (tp_d // tp_p)]
    k = tp_p // tp_d
    return [d_rank * k] if mla else list(range(d_rank * k, (d_rank + 1) * k))


def byte_part(
    s: HeadSlice, head_bytes: int, src_block_bytes: int, dst_block_bytes: int
) -> tuple[int, int, int] | None:
    """``(src offset, dst offset, length)`` in bytes of slice ``s`` inside one block, whose heads
    are ``head_bytes`` apart (the head axis outermost in a block); None when the slice is both
    blocks whole (equal sizes, or MLA's latent): the whole-block WRITE of old."""
    length = s.heads * head_bytes
    if s.src_head == s.dst_head == 0 and length == src_block_bytes == dst_block_bytes:
        return None
    return s.src_head * head_bytes, s.dst_head * head_bytes, length


def _check_rank(rank: int, size: int, side: str) -> None:
    if not 0 <= rank < size:
        raise TpMapError(f"{side} rank {rank} out of range for tensor-parallel size {size}")


def pair_mismatches(
    mine: Compat, peer: Compat, me: str, them: str, my_head_bytes: int, peer_head_bytes: int
) -> list[str]:
    """What keeps two workers' caches from being paired, labelled like ``Compat.mismatches``
    (empty: they pair). Equal TP sizes compare every field; unequal ones compare all but the
    per-worker fields (TP size, KV heads, block bytes) and instead require a mappable ratio,
    the same KV heads in all and bytes per head, and, unless MLA, heads outermost in a block
    on both (``head_bytes``: an HND layout, no kernel blocks)."""
    if mine.tp_size == peer.tp_size:
        return mine.mismatches(peer, me, them)
    bad = mine.mismatches(
        replace(
            peer, tp_size=mine.tp_size, num_kv_heads=mine.num_kv_heads, block_bytes=mine.block_bytes
        ),
        me,
        them,
    )
    if mine.use_mla != peer.use_mla:
        return bad
    mla = mine.use_mla
    total = 1 if mla else mine.num_kv_heads * mine.tp_size
    total_peer = 1 if mla else peer.num_kv_heads * peer.tp_size
    try:
        check(mine.tp_size, peer.tp_size, total, mla, mine.pp_size, peer.pp_size)
    except TpMapError as exc:
        bad.append(f"tp_size: {me}={mine.tp_size} {them}={peer.tp_size}: {exc}")
    if total != total_peer:
        bad.append(
            f"KV heads in all (per worker x TP): {me}={total} {them}={total_peer}"
            " (replicated heads map only between equal tensor-parallel sizes)"
        )
    if mine.block_bytes * peer.num_kv_heads != peer.block_bytes * mine.num_kv_heads:
        bad.append(
            f"bytes per KV head of a block: {me}={mine.block_bytes // mine.num_kv_heads}"
            f" {them}={peer.block_bytes // peer.num_kv_heads}"
        )
    if not mla and not (my_head_bytes and peer_head_bytes):
        bad.append(
            f"head slices: {me}={my_head_bytes} {them}={peer_head_bytes}: unequal tensor-parallel"
            " sizes write runs of heads, which needs the head axis outermost in a block on both"
            " engines (VLLM_KV_CACHE_LAYOUT=LBHNC or BLHNC, no kernel blocks)"
        )
    return bad
