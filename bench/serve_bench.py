#!/usr/bin/env python3
"""vLLM's own ``vllm bench serve`` through pd-router, one stack per mode: the push study's table.

For each mode (``agg1``: one engine on one core, ``agg2``: one engine on both cores, ``pull``,
``push``, ``pipelined``) a stack is started (SmolLM2-135M-Instruct by default), warmed up, and
``vllm bench serve --backend vllm --dataset-name random --ignore-eos`` runs against the router at
every input length and QPS. ``--repeats`` runs the whole sweep again with the mode order rotated;
the table shows the median over repeats and, for each ratio, its range over repeats.

Around every point, the router's and the engines' own Prometheus histograms are scraped before
and after; their mean per request is the TTFT breakdown (the second table): P's queue and
prefill, the KV transfer (D's READs in pull, P's WRITEs in push and pipelined), D's queue and
first step, D's own TTFT, the router's TTFT, and what the client adds on top.

    .venv/bin/python bench/serve_bench.py                        # the default sweep
    .venv/bin/python bench/serve_bench.py --modes agg1,pipelined --inputs 1536 --qps 1 --repeats 1
    .venv/bin/python bench/serve_bench.py --modes 'agg1,pipelined,pipelined*' --qps 1,3
                                          # pipelined*: the adaptive rule (docs/policy.md)

Not a test: it asserts nothing; tables (Markdown) go to stdout, progress to stderr, and every
``vllm bench serve`` result (per-request detail included) is kept under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.stack import Stack
from router.stack.engines import vllm_python_path
from router.stack.metrics import MetricsPage, scrape
from router.stack.model import DEFAULT_VARIANT, ensure_model

# name -> (stack mode, CPUs of the aggregated engine)
MODES: dict[str, tuple[str, str | None]] = {
    "agg1": ("aggregated", None),
    "agg2": ("aggregated", "0-1"),
    "pull": ("pull", None),
    "push": ("push", None),
    "pipelined": ("pipelined", None),
}
# Engine flag sets a mode can name after '@' (pipelined@compiled): settings compared in one run.
ENGINE_FLAGS: dict[str, list[str]] = {
    # vLLM's own default on CPU: torch.compile with inductor. ~45 s more to start (the stack's
    # tests run eager for that), then 0.72-0.77x the eager TTFT and 0.8x the TPOT on one core.
    "compiled": ["--no-enforce-eager"],
    "eager": [],  # the stack's default
}
METRICS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "request_throughput")


@dataclass(frozen=True)
class Point:
    input_len: int
    qps: float


@dataclass
class Result:
    """One mode at one point, over repeats: the client's figures and the breakdown."""

    client: list[dict[str, float]] = field(default_factory=list)
    breakdown: list[dict[str, float]] = field(default_factory=list)

    def median(self, key: str) -> float:
        values = [r[key] for r in self.client if key in r]
        return statistics.median(values) if values else float("nan")

    def breakdown_median(self, key: str) -> float:
        values = [b[key] for b in self.breakdown if key in b]
        return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    modes = args.modes.split(",")
    points = [Point(n, q) for n in _ints(args.inputs) for q in _floats(args.qps)]
    out = Path(args.out or tempfile.mkdtemp(prefix="serve-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    model_path = ensure_model(args.variant, args.cache_dir)
    results: dict[tuple[str, Point], Result] = {}
    for rep in range(args.repeats):
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]  # rotated per repeat
        for mode in order:
            with _stack(mode, args) as stack:
                _warm_up(stack, model_path, args, out / f"warmup-{mode}-{rep}")
                for point in points:
                    res = results.setdefault((mode, point), Result())
                    before = _snapshot(stack)
                    client = _bench(stack, model_path, point, args, out / f"{mode}-{rep}", rep)
                    res.client.append(client)
                    res.breakdown.append(_breakdown(before, _snapshot(stack), stack))
                    _say(f"{mode} {point}: mean TTFT {client['mean_ttft_ms']:.0f} ms")
    _print_tables(results, modes, points, args)
    print(f"\nraw results: {out}")
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--modes",
        default="agg1,agg2,pull,push,pipelined",
        help=f"of {list(MODES)}; ':worker' pins only the forward pass (the control); "
        "'pipelined+step' posts the connector's WRITEs once per step; "
        "'pipelined~2' serves a request on D alone when P already runs 2 prefills; "
        "'pipelined*' runs the adaptive rule (docs/policy.md) with the SLO of --adaptive-*; "
        f"'@name' adds engine flags, name of {list(ENGINE_FLAGS)}",
    )
    p.add_argument("--inputs", default="512,1536", help="prompt lengths in tokens")
    p.add_argument("--qps", default="0.25,0.5,1", help="request rates (Poisson)")
    p.add_argument("--output-len", type=int, default=64, help="tokens per answer (ignore_eos)")
    p.add_argument("--prompts", type=int, default=20, help="requests per point")
    p.add_argument("--repeats", type=int, default=2, help="sweeps, mode order rotated")
    p.add_argument("--variant", default=DEFAULT_VARIANT, help="stack model")
    p.add_argument("--cache-dir", default=None, help="default $PD_ROUTER_CACHE or ~/.cache")
    p.add_argument("--out", default=None, help="folder for vllm bench serve's results")
    p.add_argument("--prefix-caching", action="store_true", help="on in every engine")
    p.add_argument("--engine", default="compiled", choices=list(ENGINE_FLAGS), help="flag set")
    # bf16 by default: the prompts are random tokens and the answers are not read
    # (--ignore-eos), and bf16 is what deployments compute in. The stack serves SmolLM2 in fp32
    # because vLLM 0.32's CPU bf16 path answers it wrongly, and fp32 costs 4x the time here.
    p.add_argument("--dtype", default="bfloat16", help="what the engines compute in")
    p.add_argument("--adaptive-ttft-ms", type=float, default=1500.0, help="'*' modes' SLO")
    p.add_argument("--adaptive-tpot-ms", type=float, default=40.0, help="'*' modes' SLO")
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _say(text: str) -> None:
    print(f"[serve-bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


@contextmanager
def _stack(mode: str, args: argparse.Namespace) -> Iterator[Stack]:
    """``mode`` is a name of ``MODES``, or one with ``:worker``: vLLM's own pinning (only the
    forward pass on the engine's core), the control for the stack's whole-engine pinning."""
    base, _, pin = mode.partition(":")
    adaptive = base.endswith("*")  # pipelined*: the adaptive rule on
    base = base.removesuffix("*")
    base, _, busy = base.partition("~")  # pipelined~2: disagg_max_prefill_queue
    base, _, flags = base.partition("@")  # agg1@compiled: more engine flags
    base, _, batch = base.partition("+")  # pipelined+step: the connector's write_batch
    stack_mode, cpus = MODES[base]
    caching = ["--enable-prefix-caching"] if args.prefix_caching else []
    caching += ENGINE_FLAGS[flags or args.engine]
    overrides: dict[str, Any] = {"disagg_max_prefill_queue": int(busy)} if busy else {}
    if adaptive:
        slo = {"ttft_ms": args.adaptive_ttft_ms, "tpot_ms": args.adaptive_tpot_ms}
        overrides["adaptive"] = {"enabled": True, **slo}
    names = ["aggregated-0"] if stack_mode == "aggregated" else ["prefill-0", "decode-0"]
    with Stack(
        mode=stack_mode,
        variant=args.variant,
        cache_dir=args.cache_dir,
        aggregated_cpus=cpus,
        pin=pin or "engine",
        dtype=args.dtype,
        connector_extra={"write_batch": batch} if batch else None,
        engine_args={name: caching for name in names},
        model_overrides=overrides or None,
    ) as stack:
        _say(f"{mode}: stack up at {stack.router_url}")
        yield stack


def _bench_argv(
    stack: Stack, model_path: Path, point: Point, args: argparse.Namespace, prompts: int, seed: int
) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "vllm",
        "--base-url", stack.router_url,
        "--endpoint", "/v1/completions",
        "--model", stack.model_name,
        "--tokenizer", str(model_path),
        "--dataset-name", "random",
        "--random-input-len", str(point.input_len),
        "--random-output-len", str(args.output_len),
        "--ignore-eos",
        "--num-prompts", str(prompts),
        "--request-rate", str(point.qps),
        "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--ready-check-timeout-sec", "0",
        "--disable-tqdm",
    ]  # fmt: skip


def _run_bench(argv: list[str], result: Path) -> dict[str, Any]:
    result.parent.mkdir(parents=True, exist_ok=True)
    argv = [*argv, "--save-result", "--save-detailed"]
    argv += ["--result-dir", str(result.parent), "--result-filename", result.name]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # vLLM's CLI asks for the version of a distribution named "vllm"; the CPU build has another
    # name, and the engines' run-time fixes folder answers for it.
    env["PYTHONPATH"] = vllm_python_path(env)
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-3000:]}")
    data: dict[str, Any] = json.loads(result.read_text())
    return data


def _warm_up(stack: Stack, model_path: Path, args: argparse.Namespace, where: Path) -> None:
    """NIXL handshakes, allocator, thread pools and (compiled) every prompt shape: paid before
    any point is measured."""
    for n in _ints(args.inputs):
        argv = _bench_argv(stack, model_path, Point(n, 1000.0), args, 3, 999)
        _run_bench(argv, where / f"warmup-{n}.json")


def _bench(
    stack: Stack, model_path: Path, point: Point, args: argparse.Namespace, where: Path, rep: int
) -> dict[str, float]:
    name = f"in{point.input_len}-qps{point.qps}.json"
    # The same seed for every mode of a repeat: the same prompts, arriving at the same times.
    data = _run_bench(_bench_argv(stack, model_path, point, args, args.prompts, rep), where / name)
    if data.get("failed"):
        _say(f"{stack.mode.value} {point}: {data['failed']} failed: {data.get('errors', [])[:3]}")
    return {key: float(data[key]) for key in METRICS if key in data}


# -- the breakdown ----------------------------------------------------------------------------


def _snapshot(stack: Stack) -> dict[str, MetricsPage]:
    snap = {spec.name: stack.engine_metrics(spec.name) for spec in stack.engines}
    snap["router"] = scrape(stack.router_url)
    return snap


def _mean_ms(before: MetricsPage, after: MetricsPage, histogram: str) -> float:
    """Mean of the observations made between two snapshots, in ms (NaN if none)."""
    count = after.total(f"{histogram}_count") - before.total(f"{histogram}_count")
    total = after.total(f"{histogram}_sum") - before.total(f"{histogram}_sum")
    return 1000 * total / count if count > 0 else float("nan")


def _breakdown(
    before: dict[str, MetricsPage], after: dict[str, MetricsPage], stack: Stack
) -> dict[str, float]:
    """Mean per request of each stage, from the router's and the engines' own histograms."""

    def mean(node: str, histogram: str) -> float:
        return _mean_ms(before[node], after[node], histogram)

    decisions = "pdrouter_disagg_decisions_total"
    r0, r1 = before["router"], after["router"]

    def share(*served: str) -> float:
        """Of the requests dispatched, those with one of these decisions, in %."""
        n = sum(r1.total(decisions, decision=d) - r0.total(decisions, decision=d) for d in served)
        dispatched = r1.total(decisions) - r0.total(decisions)
        return 100 * n / dispatched if dispatched else float("nan")

    out = {
        # Requests served by D alone because P was busy (disagg_max_prefill_queue) or by the
        # adaptive rule's choice, and by P alone (the rule's), in %.
        "d_alone_pct": share("decode_only_busy", "decode_alone"),
        "p_alone_pct": share("prefill_alone"),
        "router_ttft": mean("router", "pdrouter_ttft_seconds"),
        "router_prefill": mean("router", "pdrouter_prefill_duration_seconds"),
        "router_handoff": mean("router", "pdrouter_handoff_seconds"),
    }
    first = "aggregated-0" if "aggregated-0" in before else "prefill-0"
    out["p_queue"] = mean(first, "vllm:request_queue_time_seconds")
    out["p_prefill"] = mean(first, "vllm:request_prefill_time_seconds")
    if first == "aggregated-0":
        out["d_ttft"] = mean(first, "vllm:time_to_first_token_seconds")
        return out
    out["d_queue"] = mean("decode-0", "vllm:request_queue_time_seconds")
    out["d_first_step"] = mean("decode-0", "vllm:request_prefill_time_seconds")
    out["d_ttft"] = mean("decode-0", "vllm:time_to_first_token_seconds")
    if stack.mode.value == "pull":  # D READs; P WRITEs in the push modes
        out["kv_xfer"] = mean("decode-0", "vllm:nixl_xfer_time_seconds")
    elif stack.mode.value == "push":
        out["kv_xfer"] = mean("prefill-0", "vllm:nixl_xfer_time_seconds")
    else:
        out["kv_xfer"] = mean("prefill-0", "vllm:pdr_request_write_seconds")
    return out


# -- the tables -------------------------------------------------------------------------------


def _ratio_text(results: dict[tuple[str, Point], Result], mode: str, base: str, p: Point) -> str:
    """Median ratio of mean TTFT over repeats, with its range: ``0.52 (0.48-0.57)``."""
    mine, theirs = results.get((mode, p)), results.get((base, p))
    if mine is None or theirs is None:
        return "-"
    pairs = zip(mine.client, theirs.client, strict=False)
    ratios = [a["mean_ttft_ms"] / b["mean_ttft_ms"] for a, b in pairs if b["mean_ttft_ms"] > 0]
    if not ratios:
        return "-"
    med = statistics.median(ratios)
    return f"{med:.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else f"{med:.2f}"


def _print_tables(
    results: dict[tuple[str, Point], Result],
    modes: list[str],
    points: list[Point],
    args: argparse.Namespace,
) -> None:
    print(
        f"\n`vllm bench serve` through pd-router, model {args.variant} ({args.engine}, "
        f"{args.dtype}), "
        f"{args.prompts} prompts "
        f"per point, {args.output_len} output tokens, median of {args.repeats} repeat(s); "
        "ratios are of mean TTFT (range over repeats)\n"
    )
    print(
        "| mode | input | output | QPS | mean TTFT ms | median TTFT ms | p99 TTFT ms "
        "| mean TPOT ms | req/s | TTFT vs pull | TTFT vs agg1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for p in points:
        for mode in modes:
            r = results.get((mode, p))
            if r is None:
                continue
            cells = [f"{r.median(k):.0f}" for k in METRICS[:4]] + [f"{r.median(METRICS[4]):.2f}"]
            ratios = [_ratio_text(results, mode, base, p) for base in ("pull", "agg1")]
            print(f"| {mode} | {p.input_len} | {args.output_len} | {p.qps:g} | ", end="")
            print(" | ".join(cells + ratios) + " |")
    keys = [
        "router_ttft", "p_queue", "p_prefill", "kv_xfer", "d_queue", "d_first_step", "d_ttft",
        "router_prefill", "router_handoff", "d_alone_pct", "p_alone_pct",
    ]  # fmt: skip
    print("\nTTFT breakdown, mean ms per request (router's and engines' own histograms)\n")
    print("| mode | input | QPS | client TTFT | " + " | ".join(keys) + " |")
    print("|---|---|---|---|" + "---|" * len(keys))
    for p in points:
        for mode in modes:
            r = results.get((mode, p))
            if r is None:
                continue
            cells = [_ms(r.median("mean_ttft_ms"))] + [_ms(r.breakdown_median(k)) for k in keys]
            print(f"| {mode} | {p.input_len} | {p.qps:g} | " + " | ".join(cells) + " |")


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.0f}"  # NaN: no observation


if __name__ == "__main__":
    sys.exit(main())
