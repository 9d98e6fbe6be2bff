"""The GPU owner's worker check (scripts/gpu_check), in its CPU form, with real NIXL agents.

On CPU, ``SimKernels`` writes each layer's KV after P's hooks returned, and after every WRITE
the connector had posted by then completed. So the check is deterministic: with the readiness
gate every byte D holds when it reports the receive is P's final byte; with the gate off (the
negative control) some never are, which shows the check can see the race at all.
"""

from __future__ import annotations

import pytest

from scripts.gpu_check import kv
from scripts.gpu_check.kernels import SimKernels, write
from scripts.gpu_check.steps import CASES
from scripts.gpu_check.worker_check import MODES, Row, render, run
from tests.needs import need_module

torch = need_module("torch")
need_module("nixl")

# One xdist worker runs the real-NIXL modules (kv-ports): their agents pick ports from one
# range, and two workers probing it at once could both pick the same one.
pytestmark = pytest.mark.xdist_group("kv-ports")


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    return run("cpu")


def test_every_case_ran_in_both_modes_with_and_without_the_gate(rows: list[Row]) -> None:
    seen = {(r.write_batch, r.gate, r.case) for r in rows}
    assert seen == {(m, g, c.name) for m in MODES for g in (True, False) for c in CASES}
    assert all(r.error == "" for r in rows), render(rows)


def test_with_the_gate_d_holds_the_final_bytes_and_counts_agree(rows: list[Row]) -> None:
    for r in (r for r in rows if r.gate):
        assert r.differing == 0 and r.stale_on_p == 0, render([r])
        assert r.written == r.received == r.blocks * _block_bytes(), render([r])
        assert r.verdict == "PASS"


def test_negative_control_without_the_gate_d_holds_stale_bytes(rows: list[Row]) -> None:
    for r in (r for r in rows if not r.gate):
        # P's own cache got the final bytes: what D lacks was posted before it landed.
        assert r.stale_on_p == 0 and r.differing > 0, render([r])
        assert r.verdict == "PASS"


def test_a_negative_control_that_shows_no_race_fails_on_cpu_only() -> None:
    quiet = Row("cpu", "LBHNC", "layer", False, "c", blocks=4, written=8, received=8)
    assert quiet.verdict == "FAIL"
    assert Row("cuda", "LBNHC", "layer", False, "c", blocks=4).verdict == "INFO"
    assert Row("cuda", "LBNHC", "layer", True, "c", blocks=4, written=8, received=4).verdict == (
        "FAIL"
    )


def test_sim_kernels_land_late_after_posted_writes_and_marks_follow_the_stream() -> None:
    waits: list[int] = []
    sim = SimKernels(lambda: waits.append(sim.ran))
    dst = torch.zeros(2, 1, 1, 1, dtype=torch.int8)
    index = (torch.tensor([1]), torch.tensor([0]))
    readiness = sim.readiness()
    assert readiness is not None
    before = readiness.mark()  # nothing launched yet: ready at once
    sim.launch(dst, index, torch.ones(1, 1, 1, dtype=torch.int8))
    after = readiness.mark()
    assert before.ready() and not after.ready()
    for _ in range(SimKernels.LAG - 1):
        sim.hook_returned()
    assert not after.ready() and dst.sum() == 0 and waits == []
    sim.hook_returned()
    assert after.ready() and dst[1].item() == 1
    assert waits == [0]  # the posted WRITEs were waited for before the write landed


@pytest.mark.parametrize("layout", sorted(kv.LAYOUTS))
def test_caches_are_vllm_views_of_one_buffer(layout: str) -> None:
    """The views equal those vLLM 0.32 itself builds for the layout (shape, strides, address)."""
    iface = need_module("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    shape = kv.KvShape()
    cache = kv.build(shape, layout, "cpu")
    spec = iface.FullAttentionSpec(
        block_size=shape.block_size,
        num_kv_heads=shape.heads,
        head_size=shape.head_size,
        dtype=torch.bfloat16,
    )
    lay = KVCacheLayout[layout]
    layer_stride, block_stride, *_ = iface.compute_layout_strides(
        spec, shape.blocks, shape.layers, lay
    )
    names = list(cache.views)
    tensor = iface.KVCacheTensor(
        size=cache.buffer.numel(),
        layers=names,
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    theirs = iface.create_kv_cache_views(cache.buffer, spec, shape.blocks, lay, tensor)
    for mine, vllm_view in zip(cache.views.values(), theirs, strict=True):
        assert (mine.shape, mine.stride(), mine.dtype) == (
            vllm_view.shape,
            vllm_view.stride(),
            vllm_view.dtype,
        )
        assert mine.data_ptr() == vllm_view.data_ptr()
    # The check's int8 token-slot views address the same bytes as the dtype views.
    ones = torch.ones(1, shape.heads, shape.content_bytes, dtype=torch.int8)
    write(cache.slots[1], (torch.tensor([3]), torch.tensor([5])), ones)
    assert bool(cache.views[names[1]].view(torch.int8)[3, :, 5].eq(1).all())


def _block_bytes() -> int:
    s = kv.KvShape()
    return s.heads * s.block_size * s.content_bytes


# -- the engine check's parts that need no engine ----------------------------------------------


def test_engine_cases_sit_around_the_block_and_the_step_budget() -> None:
    from scripts.gpu_check.engine_check import cases

    by_name = {c.name: c for c in cases(block=16, budget=128, vocab=1000)}
    first = {name: len(c.waves[0][0].prompt) for name, c in by_name.items()}
    assert first["shorter than a block"] < 16
    assert first["exact multiple of the block"] % 16 == 0
    assert first["chunked prefill"] > 2 * 128
    assert [len(w) for w in by_name["16 concurrent"].waves] == [16]
    twice = by_name["same prompt twice"].waves
    assert twice[0][0].prompt == twice[1][0].prompt
    kept = by_name["kept-turn follow-up"]
    assert kept.pulls and kept.waves[0][0].keep and kept.waves[1][0].follows == 0


def test_a_follow_up_turn_resends_the_kept_turn_with_its_answer() -> None:
    from scripts.gpu_check.client import Output
    from scripts.gpu_check.engine_check import Case, Req, drive

    sent: list[tuple[list[int], str | None]] = []

    def send(req: Req, prompt: list[int], reuse: str | None) -> tuple[Output, str]:
        sent.append((prompt, reuse))
        return Output((100 + len(sent),)), f"tid{len(sent)}"

    case = Case("t", ((Req((1, 2), keep=True),), (Req((3,), follows=0),)))
    outs = drive(case, send)
    assert sent == [([1, 2], None), ([1, 2, 101, 3], "tid1")]
    assert [o.token_ids for o in outs] == [(101,), (102,)]


def test_answers_compare_equal_or_at_a_near_tie_only() -> None:
    from scripts.gpu_check.client import NEAR_TIE, Output, compare

    want = Output((1, 2, 3), ((-0.1, -5.0), (-0.5, -0.5 - NEAR_TIE / 2), (-0.1, -9.0)))
    assert compare(Output((1, 2, 3)), want) == (True, "equal")
    assert compare(Output((1, 7, 9)), want)[0]  # first differs where the reference was a tie
    assert not compare(Output((9, 2, 3)), want)[0]
    assert not compare(Output((1, 2)), want)[0]
    assert not compare(Output(error="HTTP 500"), want)[0]
