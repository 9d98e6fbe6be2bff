"""The planner's model (router/plan.py) and ``pd-router plan``: the queueing formulas against
their closed forms, the search for the fewest engines, the inputs refused with a reason."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from router import cli, plan

T = plan.Timings(
    prefill_fixed_s=0.05,
    prefill_s_per_token=0.001,
    step_fixed_s=0.03,
    step_per_stream_s=0.002,
    handoff_s=0.02,
)


def _load(rate: float, prompt: int = 500, output: int = 100) -> plan.Load:
    return plan.steady_load(rate, prompt, output)


def test_erlang_c_matches_its_closed_forms() -> None:
    assert plan.erlang_c(1, 0.6) == pytest.approx(0.6)  # M/M/1: the utilization
    assert plan.erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert plan.erlang_c(3, 3.0) == 1.0  # saturated: everyone waits


def test_one_p_is_pollaczek_khinchine() -> None:
    """One server, Poisson arrivals, every prompt alike (cs² = 0): W = r S² / (2 (1 - rho))."""
    load = _load(1.2)
    s = T.prefill_s(500)  # 0.55 s
    rho = 1.2 * s
    wait = 1.2 * s**2 / (2 * (1 - rho))
    got = plan.disaggregated(load, T, 1, 1, 0.9)
    step = got.tpot_s
    assert got.prefill_utilization == pytest.approx(rho)
    assert got.ttft_mean_s == pytest.approx(wait + s + T.handoff_s + step)
    # The tail: C = rho wait at all, exponential beyond: the p90 is (W / rho) ln(rho / 0.1).
    assert got.ttft_quantile_s == pytest.approx(
        wait / rho * math.log(rho / 0.1) + s + T.handoff_s + step
    )


def test_burstier_arrivals_and_mixed_prompts_wait_longer() -> None:
    alike = plan.Load(rate=1.0, prompts=(500,), outputs=(100,))
    mixed = plan.Load(rate=1.0, prompts=(100, 900), outputs=(100,))  # same mean, cs² > 0
    bursty = plan.Load(rate=1.0, prompts=(500,), outputs=(100,), arrival_cv2=4.0)
    base = plan.disaggregated(alike, T, 1, 1, 0.9).ttft_mean_s
    assert plan.disaggregated(mixed, T, 1, 1, 0.9).ttft_mean_s > base
    assert plan.disaggregated(bursty, T, 1, 1, 0.9).ttft_mean_s > base


def test_d_holds_the_streams_littles_law_gives() -> None:
    """B = r O step(B): solved, and the TPOT is the step at that batch."""
    load = _load(2.0, output=100)
    got = plan.disaggregated(load, T, 4, 2, 0.9)
    r = 1.0  # 2 req/s over 2 D
    assert got.streams_per_decode == pytest.approx(r * 100 * got.tpot_s)
    assert got.tpot_s == pytest.approx(T.step_s(got.streams_per_decode))
    assert got.streams_per_decode == pytest.approx(r * 100 * 0.03 / (1 - r * 100 * 0.002))


def test_a_load_beyond_capacity_is_infinite_and_misses() -> None:
    slo = plan.Slo(ttft_s=10.0, tpot_s=1.0)
    over_p = plan.disaggregated(_load(2.0), T, 1, 4, 0.9)  # 2 x 0.55 s of prompt a second
    assert math.isinf(over_p.ttft_mean_s) and not over_p.meets(slo)
    over_d = plan.disaggregated(_load(6.0), T, 8, 1, 0.9)  # r O s1 = 6 x 100 x 0.002 > 1
    assert math.isinf(over_d.tpot_s) and not over_d.meets(slo)
    capped = plan.Timings(0.05, 0.001, 0.03, 0.002, max_streams=4)
    assert math.isinf(plan.disaggregated(_load(2.0), capped, 4, 1, 0.9).tpot_s)


def test_an_aggregated_engine_shares_its_time_between_prompts_and_streams() -> None:
    load = _load(1.0)
    got = plan.aggregated(load, T, 1, 0.9)
    busy = T.prefill_s(500)  # 1 req/s x 0.55 s
    step = T.step_s(got.streams_per_decode)
    assert got.tpot_s == pytest.approx(step / (1 - busy))
    assert got.streams_per_decode == pytest.approx(1.0 * 100 * got.tpot_s)
    # Its streams decode slower than a D's at the same load.
    assert got.tpot_s > plan.disaggregated(load, T, 1, 1, 0.9).tpot_s


def test_plan_picks_the_fewest_engines_that_meet_the_slo() -> None:
    load = _load(6.0)  # 3.3 s of prompt a second: 4 P at least
    slo = plan.Slo(ttft_s=1.5, tpot_s=0.06)
    result = plan.plan(load, T, slo)
    pd = result.disaggregated
    assert pd is not None and pd.meets(slo)
    fewer_p = plan.disaggregated(load, T, pd.prefill_engines - 1, pd.decode_engines, 0.9)
    fewer_d = plan.disaggregated(load, T, pd.prefill_engines, pd.decode_engines - 1, 0.9)
    assert not fewer_p.meets(slo) and not fewer_d.meets(slo)
    agg = result.aggregated
    assert agg is not None and agg.meets(slo)
    assert not plan.aggregated(load, T, agg.engines - 1, 0.9).meets(slo)
    best = "disaggregated" if pd.engines < agg.engines else "aggregated"
    assert result.recommended == best


def test_a_target_below_one_prompts_time_is_met_by_no_count() -> None:
    result = plan.plan(_load(0.1, prompt=16_000), T, plan.Slo(ttft_s=2.0, tpot_s=0.1), 64)
    assert result.recommended == "none" and result.disaggregated is None
    assert "no count meets the SLO" in plan.render_text(result, _load(0.1, 16_000), T)


def test_a_trace_gives_the_rate_lengths_and_burstiness() -> None:
    lines = [
        json.dumps({"arrival_s": t, "prompt_tokens": 100 * (i + 1), "output_tokens": 10})
        for i, t in enumerate([0.0, 1.0, 2.0, 3.0])
    ]
    load = plan.load_from_trace(["", *reversed(lines)])  # any order, blank lines skipped
    assert load.rate == pytest.approx(1.0)
    assert load.arrival_cv2 == 0.0  # evenly spaced
    assert load.prompt_mean == 250 and load.output_mean == 10


@pytest.mark.parametrize(
    ("lines", "says"),
    [
        (['{"arrival_s": 0, "prompt_tokens": 5}'], "line 1"),
        (["not json"], "line 1"),
        (['{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 0}'], "out of range"),
        (['{"arrival_s": 1, "prompt_tokens": 5, "output_tokens": 3}'], "at least two"),
    ],
)
def test_a_bad_trace_is_refused_with_the_reason(lines: list[str], says: str) -> None:
    with pytest.raises(plan.PlanError, match=says):
        plan.load_from_trace(lines)


def test_timings_are_fitted_from_measured_points() -> None:
    got = plan.timings_from_json(
        json.dumps({
            "prefill_s_by_tokens": {"100": 0.15, "1000": 1.05},
            "step_s_by_streams": {"1": 0.032, "2": 0.034, "9": 0.048},
            "handoff_s": 0.1,
            "max_streams": 64,
        })
    )  # fmt: skip
    assert got.prefill_fixed_s == pytest.approx(0.05)
    assert got.prefill_s_per_token == pytest.approx(0.001)
    assert got.step_s(5) == pytest.approx(0.040)
    assert got.max_streams == 64 and got.handoff_s == 0.1


@pytest.mark.parametrize(
    "doc",
    [{"prefill_fixed_s": 0.1}, {"prefill_s_by_tokens": {"5": 1}}, "[]", {"step_s_by_streams": 3}],
)
def test_incomplete_timings_are_refused(doc: object) -> None:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    with pytest.raises(plan.PlanError):
        plan.timings_from_json(text)


def test_the_rate_is_read_from_two_scrapes_of_the_router() -> None:
    def page(ok: int, other: int) -> str:
        return (  # as prometheus-client writes a counter
            "# TYPE pdrouter_requests_total counter\n"
            f'pdrouter_requests_total{{model="m",mode="pull",outcome="ok"}} {ok}\n'
            f'pdrouter_requests_total{{model="n",mode="pull",outcome="ok"}} {other}\n'
        )

    assert plan.rate_from_scrapes(page(10, 0), page(40, 30), 60, "m") == pytest.approx(0.5)
    assert plan.rate_from_scrapes(page(10, 0), page(40, 30), 60, None) == pytest.approx(1.0)
    with pytest.raises(plan.PlanError, match="restarted"):
        plan.rate_from_scrapes(page(40, 0), page(1, 0), 60, "m")


def _timings_file(tmp_path: Path) -> Path:
    path = tmp_path / "timings.json"
    doc = {k: getattr(T, k) for k in ("prefill_fixed_s", "prefill_s_per_token", "handoff_s")}
    doc |= {"step_s_by_streams": {"1": 0.032, "11": 0.052}}
    path.write_text(json.dumps(doc))
    return path


def test_the_command_prints_a_plan_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps({"arrival_s": i * 0.25, "prompt_tokens": 500, "output_tokens": 100})
            for i in range(41)
        )
    )  # 4 req/s, evenly
    argv = ["plan", "--trace", str(trace), "--timings", str(_timings_file(tmp_path))]
    argv += ["--ttft-ms", "1500", "--tpot-ms", "60", "--at", "1P1D", "--json"]
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["load"]["rate"] == pytest.approx(4.0)
    assert doc["recommended"] in ("disaggregated", "aggregated")
    pd = doc["disaggregated"]
    assert pd["prefill_engines"] >= 3  # 4 x 0.55 s of prompt a second
    assert pd["ttft_quantile_s"] <= 1.5 and pd["tpot_s"] <= 0.06
    assert doc["at"][0]["prefill_engines"] == 1
    assert doc["at"][0]["ttft_mean_s"] is None  # one P cannot keep up: infinite, null in JSON


def test_the_command_prints_text_from_a_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--rate", "1", "--prompt-tokens", "500", "--output-tokens", "100"]
    argv += ["--timings", str(_timings_file(tmp_path)), "--ttft-ms", "2000", "--tpot-ms", "80"]
    assert cli.main([*argv, "--at", "2A"]) == 0
    out = capsys.readouterr().out
    assert "recommended: " in out and "1P1D" in out and "at 2 aggregated" in out


def test_the_command_refuses_bad_input_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timings = str(_timings_file(tmp_path))
    base = ["plan", "--timings", timings, "--ttft-ms", "1000", "--tpot-ms", "50"]
    assert cli.main([*base, "--prompt-tokens", "5", "--output-tokens", "5"]) == 2
    assert "--rate" in capsys.readouterr().err
    args = ["--rate", "1", "--prompt-tokens", "5", "--output-tokens", "5", "--at", "xPyD"]
    assert cli.main([*base, *args]) == 2
    assert "1P1D" in capsys.readouterr().err
    assert cli.main([*base, "--trace", str(tmp_path / "missing.jsonl")]) == 2
    args = ["--rate", "1", "--prompt-tokens", "5", "--output-tokens", "5", "--quantile", "1"]
    assert cli.main([*base, *args]) == 2
    assert "--quantile" in capsys.readouterr().err


def test_three_lengths_fit_attentions_square_and_long_prompts_feel_it() -> None:
    def seconds(n: int) -> float:
        return 0.05 + 0.001 * n + 2e-8 * n * n

    points = {str(n): seconds(n) for n in (128, 512, 1024, 2048)}
    got = plan.timings_from_json(json.dumps({"prefill_s_by_tokens": points, **STEP}))
    assert got.prefill_s_per_token2 == pytest.approx(2e-8)
    assert got.prefill_s(16_000) == pytest.approx(seconds(16_000))
    # Points on a line: no square, the line itself.
    line = {str(n): 0.05 + 0.001 * n for n in (128, 512, 1024)}
    flat = plan.timings_from_json(json.dumps({"prefill_s_by_tokens": line, **STEP}))
    assert flat.prefill_s_per_token2 == pytest.approx(0.0, abs=1e-12)
    assert flat.prefill_s_per_token == pytest.approx(0.001)


STEP = {"step_fixed_s": 0.03, "step_per_stream_s": 0.002}


def test_a_shapes_capacity_is_the_rate_where_it_stops_meeting_the_slo() -> None:
    slo = plan.Slo(ttft_s=1.5, tpot_s=0.06)
    load = _load(1.0)
    predict = plan.shape("2P1D")
    rate = plan.max_rate(load, lambda x: predict(x, T, 0.9), slo)
    assert 0 < rate < 2 / T.prefill_s(500)  # below two P's saturation
    at = plan.disaggregated(plan.steady_load(rate, 500, 100), T, 2, 1, 0.9)
    above = plan.disaggregated(plan.steady_load(rate * 1.01, 500, 100), T, 2, 1, 0.9)
    assert at.meets(slo) and not above.meets(slo)


def test_the_best_split_of_a_budget_carries_at_least_every_other_split() -> None:
    slo = plan.Slo(ttft_s=1.5, tpot_s=0.04)
    load = _load(1.0, output=400)  # long answers: D matters too
    p, d, rate = plan.best_split(load, T, slo, 6)
    assert p + d == 6
    for other in range(1, 6):

        def predict(x: plan.Load, other: int = other) -> plan.Prediction:
            return plan.disaggregated(x, T, other, 6 - other, 0.9)

        assert plan.max_rate(load, predict, slo) <= rate * 1.002


@pytest.mark.parametrize("text", ["0P1D", "P1D", "1P", "xA", "0A", ""])
def test_a_bad_shape_is_refused(text: str) -> None:
    with pytest.raises(plan.PlanError, match="1P1D"):
        plan.shape(text)


def test_the_command_prints_capacities_and_the_best_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--rate", "1", "--prompt-tokens", "500", "--output-tokens", "100"]
    argv += ["--timings", str(_timings_file(tmp_path)), "--ttft-ms", "2000", "--tpot-ms", "80"]
    argv += ["--capacity", "2p2d", "--budget", "4", "--json"]
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    split = doc["best_split"]
    assert split["prefill"] + split["decode"] == 4
    assert split["rate"] >= doc["capacity"]["2p2d"] > 0


@pytest.mark.parametrize(
    "path",
    sorted((Path(__file__).parents[2] / "configs" / "timings").glob("*.json")),
    ids=lambda p: p.name,
)
def test_the_shipped_timings_files_are_read(path: Path) -> None:
    timings = plan.timings_from_json(path.read_text())
    assert timings.prefill_s(1000) > 0 and timings.step_s(1) > 0


def test_poisson_quantiles() -> None:
    assert plan.poisson_quantile(0.0, 0.9) == 0
    assert plan.poisson_quantile(1.0, 0.5) == 1  # P(X <= 0) = 0.37, P(X <= 1) = 0.74
    assert plan.poisson_quantile(1.0, 0.9) == 2  # P(X <= 2) = 0.92
    assert plan.poisson_quantile(10_000.0, 0.9) == pytest.approx(10_000 + 1.2816 * 100, abs=1)
    assert math.isinf(plan.poisson_quantile(math.inf, 0.9))


def test_an_aggregated_streams_tpot_quantile_counts_the_prompts_it_meets() -> None:
    load = _load(1.0)
    got = plan.aggregated(load, T, 2, 0.9)
    rate = 0.5
    met = plan.poisson_quantile(rate * 100 * got.tpot_s, 0.9)
    step = T.step_s(got.streams_per_decode)
    assert got.tpot_quantile_s == pytest.approx(step + met * T.prefill_s(500) / 100)
    assert got.tpot_quantile_s > got.tpot_s  # the mean hides the streams a prompt stalls
    d = plan.disaggregated(load, T, 2, 1, 0.9)
    assert d.tpot_quantile_s == pytest.approx(
        T.step_s(plan.poisson_quantile(d.streams_per_decode, 0.9))
    )


def test_erlang_c_holds_for_large_fleets() -> None:
    """A thousand servers at 98% (an offered load whose powers overflow a float)."""
    got = plan.erlang_c(1000, 980.0)
    assert 0 < got < 1
    load = plan.steady_load(400.0, 500, 100)
    assert plan.disaggregated(load, T, 240, 150, 0.9).ttft_mean_s < 2.0


def test_ds_admissions_stall_its_streams() -> None:
    """D reading each new request's KV (``admit``) takes r E[admit] of its time from its
    streams: TPOT = step(B) / (1 - r E[admit]), B = r O TPOT; TTFT holds one admission."""
    admitting = plan.Timings(0.05, 0.001, 0.03, 0.002, handoff_s=0.02, admit_fixed_s=0.1)
    load = _load(2.0)
    got = plan.disaggregated(load, admitting, 4, 1, 0.9)
    busy = 2.0 * 0.1
    step = admitting.step_s(got.streams_per_decode)
    assert got.tpot_s == pytest.approx(step / (1 - busy))
    assert got.streams_per_decode == pytest.approx(2.0 * 100 * got.tpot_s)
    plain = plan.disaggregated(load, T, 4, 1, 0.9)
    assert got.tpot_s > plain.tpot_s and got.ttft_mean_s > plain.ttft_mean_s + 0.1
    parsed = plan.timings_from_json(
        json.dumps({**STEP, "prefill_fixed_s": 0.05, "prefill_s_per_token": 0.001,
                    "admit_s_by_tokens": {"100": 0.02, "1100": 0.12}})
    )  # fmt: skip
    assert parsed.admit_s(600) == pytest.approx(0.07)
