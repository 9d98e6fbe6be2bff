"""The head map between P and D of different tensor-parallel sizes (connector/tp_map.py)."""

from __future__ import annotations

import pytest

from connector.tp_map import HeadSlice, TpMapError, byte_part, check, sources, targets


def test_equal_sizes_write_whole_blocks_to_the_same_rank() -> None:
    assert targets(2, 2, 1, 8, False) == [HeadSlice(1, 0, 0, 4)]
    assert sources(2, 2, 1, 8, False) == [1]
    assert byte_part(HeadSlice(1, 0, 0, 4), 64, 256, 256) is None


def test_larger_decode_splits_each_prefill_workers_heads() -> None:
    # P TP1 holds 8 heads; D TP2's workers hold 4 each: worker 0 heads 0-3, worker 1 heads 4-7.
    assert targets(1, 2, 0, 8, False) == [HeadSlice(0, 0, 0, 4), HeadSlice(1, 4, 0, 4)]
    assert sources(1, 2, 1, 8, False) == [0]
    # P TP2 -> D TP8 (8 heads): P worker 1 holds heads 4-7, one per D worker 4..7.
    assert targets(2, 8, 1, 8, False) == [HeadSlice(4 + i, i, 0, 1) for i in range(4)]
    assert byte_part(HeadSlice(1, 4, 0, 4), 64, 512, 256) == (256, 0, 256)


def test_larger_prefill_fills_each_decode_worker_from_several() -> None:
    assert targets(2, 1, 0, 8, False) == [HeadSlice(0, 0, 0, 4)]
    assert targets(2, 1, 1, 8, False) == [HeadSlice(0, 0, 4, 4)]
    assert sources(2, 1, 0, 8, False) == [0, 1]
    assert sources(4, 2, 1, 8, False) == [2, 3]
    assert byte_part(HeadSlice(0, 0, 4, 4), 64, 256, 512) == (0, 256, 256)


def test_mla_latent_is_written_whole_by_one_prefill_worker_per_decode_worker() -> None:
    assert targets(1, 2, 0, 1, True) == [HeadSlice(0, 0, 0, 1), HeadSlice(1, 0, 0, 1)]
    assert targets(2, 1, 0, 1, True) == [HeadSlice(0, 0, 0, 1)]
    assert targets(2, 1, 1, 1, True) == []  # worker 0 holds the same latent
    assert sources(2, 1, 0, 1, True) == [0]
    assert sources(1, 4, 3, 1, True) == [0]
    assert byte_part(HeadSlice(1, 0, 0, 1), 576, 576, 576) is None


@pytest.mark.parametrize(
    ("tp_p", "tp_d"), [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 8), (8, 2), (4, 4)]
)
@pytest.mark.parametrize("mla", [False, True])
def test_every_decode_head_is_written_exactly_once_by_its_sources(
    tp_p: int, tp_d: int, mla: bool
) -> None:
    heads = 8
    got: dict[int, list[tuple[int, int]]] = {d: [] for d in range(tp_d)}
    for p in range(tp_p):
        for s in targets(tp_p, tp_d, p, heads, mla):
            got[s.d_rank].append((p, s.dst_head))
            # the source heads exist on P and are the same model heads as the target's
            first_model_head_p = 0 if mla else p * heads // tp_p + s.src_head
            first_model_head_d = 0 if mla else s.d_rank * heads // tp_d + s.dst_head
            assert first_model_head_p == first_model_head_d
            assert s.src_head + s.heads <= (1 if mla else heads // tp_p)
    heads_d = 1 if mla else heads // tp_d
    for d, writes in got.items():
        assert sorted({p for p, _ in writes}) == sources(tp_p, tp_d, d, heads, mla)
        covered = sorted(
            h
            for p, _ in writes
            for s in targets(tp_p, tp_d, p, heads, mla)
            if s.d_rank == d
            for h in range(s.dst_head, s.dst_head + s.heads)
        )
        assert covered == list(range(heads_d))  # each of D's heads once, none twice


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((2, 3, 12, False), "not a whole ratio"),
        ((1, 4, 2, False), "do not divide among 4 workers"),
        ((1, 2, 8, False, 1, 2), "pipeline-parallel"),
        ((0, 2, 8, False), "must be positive"),
    ],
)
def test_unmappable_sizes_are_refused_saying_why(args: tuple[int, ...], words: str) -> None:
    with pytest.raises(TpMapError, match=words):
        check(*args)  # type: ignore[arg-type]


def test_a_rank_outside_its_engine_is_refused() -> None:
    with pytest.raises(TpMapError, match="P rank 2 out of range"):
        targets(2, 1, 2, 8, False)
    with pytest.raises(TpMapError, match="D rank 1 out of range"):
        sources(2, 1, 1, 8, False)
