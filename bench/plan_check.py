#!/usr/bin/env python3
"""The planner's model (router/plan.py) against measured runs: one P/D stack at 1P1D, its engine
timings measured, then loads run with ``vllm bench serve`` and each compared with what
``pd-router plan`` predicts for the same requests (their own arrival times and lengths).

1. **Timings** (on the stack, through the router, one request at a time unless said): P's
   prefill time at each ``--calibrate-inputs`` length (P's own ``vllm:request_prefill_time``
   histogram), fitted to ``fixed + per_token * L (+ per_token2 * L²)``; D's step time at
   ``--calibrate-streams`` concurrent streams (the client's mean TPOT with
   ``--max-concurrency B``, short prompts), fitted to ``fixed + per_stream * B``; D's
   admission of a request by prompt length (D's own ``vllm:request_prefill_time``: the KV
   read and the first token); the handoff: the client's TTFT at one request a time minus P's
   prefill, D's admission and one step, averaged over the lengths.
2. **Loads**: ``vllm bench serve`` at each ``--loads`` (P's utilization: the rate is that
   fraction of one over P's measured prefill time at ``--input`` tokens; or ``--qps``),
   ``--output-len`` tokens, Poisson arrivals, ``--prompts`` requests; each load's requests
   become a trace (their start times and lengths) and the model predicts 1P1D for it.
3. **Table**: predicted against measured mean and p90 TTFT, mean and p90 TPOT, and the error
   of each; and the mean TTFT predicted with P's prefill time as P's own histogram had it
   during the load (the queueing model's error apart from the machine's drift since the
   timings were measured: on a shared machine, its speed moves from minute to minute).

    .venv/bin/python bench/plan_check.py --loads 0.3,0.5,0.7 --input 256 --prompts 16 --out DIR

``--replay DIR`` prints the table again from a run's files with this checkout's model.
Not a test: it asserts nothing. The timings (``timings.json``), every trace and every
``vllm bench serve`` result stay under ``--out``; the table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import serve_bench as sb  # the stacks and the client of bench/serve_bench.py
from serve_tables import Point, Slo

from router import plan
from router.stack import Stack
from router.stack.model import ensure_model


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.replay:
        _print(_replay(Path(args.replay), args.quantile), args)
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="plan-check-"))
    out.mkdir(parents=True, exist_ok=True)
    stack_args = sb._parse(
        ["--inputs", args.calibrate_inputs, "--output-len", str(args.output_len)]
    )
    model_path = ensure_model(stack_args.variant, stack_args.cache_dir)
    slo = Slo.parse(f"chat:{args.ttft_ms}:{args.tpot_ms}")
    rows = []
    with sb._stack("pull", stack_args, slo) as stack:
        sb._warm_up(stack, model_path, stack_args, out / "warmup")
        doc = _calibrate(stack, model_path, stack_args, args, out)
        (out / "timings.json").write_text(json.dumps(doc, indent=2))
        timings = plan.timings_from_json(json.dumps(doc))
        sb._say(f"timings: {timings}")
        for qps in _rates(args, timings):
            point = Point(args.input, qps)
            argv = sb._bench_argv(stack, model_path, point, stack_args, args.prompts, 0)
            before = sb._snapshot(stack)
            data = sb._run_bench(argv, out / f"load-qps{qps:.3f}.json")
            # P's own mean prefill time during the load: the model's wait given the service
            # time P really had, apart from how far the machine drifted since calibrating.
            data["p_prefill_s"] = _p_prefill_s(before, sb._snapshot(stack))
            (out / f"load-qps{qps:.3f}.json").write_text(json.dumps(data))
            trace = out / f"trace-qps{qps:.3f}.jsonl"
            rows.append(_compare(data, timings, args.quantile, trace))
            sb._say(f"qps {qps:.3f}: {rows[-1]}")
    _print(rows, args)
    print(f"\nraw results: {out}")
    return 0


def _rates(args: argparse.Namespace, timings: plan.Timings) -> list[float]:
    """``--qps`` as given, else ``--loads``: fractions of P's capacity at ``--input`` tokens
    (one over its prefill time, as measured): the same utilizations on a fast or a busy
    machine."""
    if args.qps:
        return [float(x) for x in args.qps.split(",")]
    capacity = 1 / timings.prefill_s(args.input)
    return [round(float(x) * capacity, 3) for x in args.loads.split(",")]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--loads", default="0.3,0.5,0.7", help="P utilizations compared (Poisson)")
    p.add_argument("--qps", default=None, help="request rates instead of --loads")
    p.add_argument("--input", type=int, default=256, help="prompt tokens of the loads")
    p.add_argument("--output-len", type=int, default=32, help="tokens per answer")
    p.add_argument("--prompts", type=int, default=16, help="requests per load")
    p.add_argument("--calibrate-inputs", default="128,512,1536", help="prompt lengths timed")
    p.add_argument("--calibrate-streams", default="1,4,8", help="D batch sizes timed")
    p.add_argument("--ttft-ms", type=float, default=2500, help="for the stack's adaptive rule")
    p.add_argument("--tpot-ms", type=float, default=75)
    p.add_argument("--quantile", type=float, default=0.9, help="TTFT quantile compared")
    p.add_argument("--out", default=None, help="folder for the results")
    p.add_argument("--replay", default=None, help="the table again from a run's --out folder")
    return p.parse_args(argv)


def _calibrate(
    stack: Stack,
    model_path: Path,
    stack_args: argparse.Namespace,
    args: argparse.Namespace,
    out: Path,
) -> dict[str, Any]:
    """The timings file ``pd-router plan --timings`` reads: the measured points themselves."""
    prefill: dict[str, float] = {}
    admit: dict[str, float] = {}
    ttft: dict[int, float] = {}
    for n in [int(x) for x in args.calibrate_inputs.split(",")]:
        before = sb._snapshot(stack)
        argv = sb._bench_argv(stack, model_path, Point(n, 1000.0), stack_args, 3, 7)
        data = sb._run_bench([*argv, "--max-concurrency", "1"], out / f"cal-prefill-{n}.json")
        after = sb._snapshot(stack)
        p_ms = sb._mean_ms(before, after, ["prefill-0"], "vllm:request_prefill_time_seconds")
        prefill[str(n)] = p_ms / 1000
        # D's own "prefill" of a pull request: reading its KV and computing its first token.
        d_ms = sb._mean_ms(before, after, ["decode-0"], "vllm:request_prefill_time_seconds")
        admit[str(n)] = d_ms / 1000
        ttft[n] = data["mean_ttft_ms"] / 1000
    steps: dict[str, float] = {}
    for b in [int(x) for x in args.calibrate_streams.split(",")]:
        argv = sb._bench_argv(stack, model_path, Point(32, 1000.0), stack_args, max(4, 2 * b), 8)
        data = sb._run_bench([*argv, "--max-concurrency", str(b)], out / f"cal-step-{b}.json")
        steps[str(b)] = data["mean_tpot_ms"] / 1000
    doc: dict[str, Any] = {"prefill_s_by_tokens": prefill, "step_s_by_streams": steps}
    doc["admit_s_by_tokens"] = admit
    fitted = plan.timings_from_json(json.dumps(doc))
    # The handoff: what a lone request's TTFT holds beyond P's prefill, D's admission of it
    # and a step.
    lone = [t - fitted.prefill_s(n) - fitted.admit_s(n) - fitted.step_s(1) for n, t in ttft.items()]
    doc |= {"handoff_s": max(0.0, statistics.mean(lone)), "mode": "pull"}
    doc["measured_ttft_s_alone"] = {str(n): t for n, t in ttft.items()}  # for the record
    return doc


def _p_prefill_s(before: dict[str, Any], after: dict[str, Any]) -> float:
    ms: float = sb._mean_ms(before, after, ["prefill-0"], "vllm:request_prefill_time_seconds")
    return ms / 1000


def _replay(folder: Path, q: float) -> list[dict[str, float]]:
    """The table again from a run's files, with this checkout's model."""
    timings = plan.timings_from_json((folder / "timings.json").read_text())
    rows = []
    for result in sorted(folder.glob("load-qps*.json"), key=lambda p: float(p.stem[8:])):
        data = json.loads(result.read_text())
        trace = folder / result.name.replace("load-", "trace-").replace(".json", ".jsonl")
        rows.append(_compare(data, timings, q, trace))
    return rows


def _quantile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def _compare(data: dict[str, Any], t: plan.Timings, q: float, trace: Path) -> dict[str, float]:
    ok = [i for i, e in enumerate(data["errors"]) if not e]
    lines = [
        json.dumps({
            "arrival_s": data["start_times"][i],
            "prompt_tokens": data["input_lens"][i],
            "output_tokens": data["output_lens"][i],
        })
        for i in ok
    ]  # fmt: skip
    trace.write_text("\n".join(lines) + "\n")
    load = plan.load_from_trace(lines)
    predicted = plan.disaggregated(load, t, 1, 1, q)
    # vLLM's per-request TPOT: the time after the first token over the tokens after it.
    tpots = [
        (data["latencies"][i] - data["ttfts"][i]) / (data["output_lens"][i] - 1)
        for i in ok
        if data["output_lens"][i] > 1
    ]
    in_load = float("nan")
    if "p_prefill_s" in data:  # the same model, P's service time as P had it during the load
        scale = data["p_prefill_s"] / (
            sum(t.prefill_s(n) for n in load.prompts) / len(load.prompts)
        )
        seen = replace(
            t,
            prefill_fixed_s=t.prefill_fixed_s * scale,
            prefill_s_per_token=t.prefill_s_per_token * scale,
            prefill_s_per_token2=t.prefill_s_per_token2 * scale,
        )
        in_load = plan.disaggregated(load, seen, 1, 1, q).ttft_mean_s * 1000
    return {
        "pred_ttft_in_load": in_load,
        "rate": load.rate,
        "pred_ttft_mean": predicted.ttft_mean_s * 1000,
        "meas_ttft_mean": data["mean_ttft_ms"],
        "pred_ttft_q": predicted.ttft_quantile_s * 1000,
        "meas_ttft_q": _quantile([data["ttfts"][i] for i in ok], q) * 1000,
        "pred_tpot": predicted.tpot_s * 1000,
        "meas_tpot": data["mean_tpot_ms"],
        "pred_tpot_q": predicted.tpot_quantile_s * 1000,
        "meas_tpot_q": _quantile(tpots, q) * 1000,
        "utilization": predicted.prefill_utilization,
    }


def _err(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.0f}%"


def _print(rows: list[dict[str, float]], args: argparse.Namespace) -> None:
    qp = f"p{args.quantile * 100:g}"
    print(f"\n1P1D (pull), {args.input}-token prompts, {args.output_len} tokens out, "
          f"{args.prompts} requests a load; times in ms, "
          "error = (predicted - measured) / measured\n")  # fmt: skip
    print(f"| req/s (trace) | P utilization | TTFT mean pred | meas | error | TTFT {qp} pred "
          f"| meas | error | TPOT mean pred | meas | error | TPOT {qp} pred | meas "
          "| error | TTFT mean pred, P's prefill as in the load | error |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['rate']:.2f} | {r['utilization']:.2f} "
            f"| {r['pred_ttft_mean']:.0f} | {r['meas_ttft_mean']:.0f} "
            f"| {_err(r['pred_ttft_mean'], r['meas_ttft_mean'])} "
            f"| {r['pred_ttft_q']:.0f} | {r['meas_ttft_q']:.0f} "
            f"| {_err(r['pred_ttft_q'], r['meas_ttft_q'])} "
            f"| {r['pred_tpot']:.1f} | {r['meas_tpot']:.1f} "
            f"| {_err(r['pred_tpot'], r['meas_tpot'])} "
            f"| {r['pred_tpot_q']:.1f} | {r['meas_tpot_q']:.1f} "
            f"| {_err(r['pred_tpot_q'], r['meas_tpot_q'])} "
            f"| {r['pred_ttft_in_load']:.0f} "
            f"| {_err(r['pred_ttft_in_load'], r['meas_ttft_mean'])} |"
        )


if __name__ == "__main__":
    sys.exit(main())
