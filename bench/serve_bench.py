#!/usr/bin/env python3
"""Goodput at equal hardware: vLLM's own ``vllm bench serve`` through pd-router, one stack per mode.

Each mode is a deployment of the same two cores: ``dp2`` (two aggregated engines, one per core,
the router over both: the baseline), ``pull``, ``push``, ``pipelined`` (one P and one D),
``pipelined~1`` (the busy rule: D serves a request alone when P already prefills one),
``pipelined*`` (the adaptive rule of docs/policy.md, with the first SLO), and the older study's
``agg1`` (one engine on one core) and ``agg2`` (one engine on both). For each, a stack is
started (SmolLM2-135M-Instruct, as the stack serves it, by default), warmed up, and ``vllm bench
serve --backend vllm --dataset-name random --ignore-eos`` runs against the router at every input
length and QPS. ``--repeats`` runs the whole sweep again with the mode order rotated; the tables
show medians over repeats and, for each ratio to ``dp2``, its range over repeats.

Goodput (requests per second that met an SLO's TTFT and TPOT bounds, vLLM's formula) is computed
for every ``--slo`` from the per-request detail (bench/serve_tables.py). Around every point, the
router's and the engines' own Prometheus histograms are scraped before and after; their mean per
request is the TTFT breakdown (the second table): P's queue and prefill, the KV transfer (D's
READs in pull, P's WRITEs in push and pipelined), D's queue and first step, D's own TTFT, the
router's TTFT, and what the client adds on top.

    .venv/bin/python bench/serve_bench.py --plot goodput.png        # the default sweep
    .venv/bin/python bench/serve_bench.py --modes dp2,pull,pipelined --inputs 512 --qps 0.2 \
        --repeats 1                                                 # one point, three modes
    .venv/bin/python bench/serve_bench.py --replot DIR/results.json --plot goodput.png

Not a test: it asserts nothing; tables (Markdown) go to stdout, progress to stderr, and every
``vllm bench serve`` result (per-request detail included) is kept under ``--out``. ``--plot``
needs the ``bench`` extra (matplotlib).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import serve_tables as tables
from serve_tables import Point, Result, Slo

from router.stack import Stack
from router.stack.engines import vllm_python_path
from router.stack.metrics import MetricsPage, scrape
from router.stack.model import DEFAULT_VARIANT, ensure_model

# name -> (stack mode, CPUs of the aggregated engine, aggregated engines)
MODES: dict[str, tuple[str, str | None, int]] = {
    "dp2": ("aggregated", None, 2),  # two whole engines, one per core: the P/D pair's hardware
    "agg1": ("aggregated", None, 1),
    "agg2": ("aggregated", "0-1", 1),
    "pull": ("pull", None, 1),
    "push": ("push", None, 1),
    "pipelined": ("pipelined", None, 1),
}
# Engine flag sets a mode can name after '@' (pipelined@compiled): settings compared in one run.
ENGINE_FLAGS: dict[str, list[str]] = {
    # vLLM's own default on CPU: torch.compile with inductor. ~45 s more to start (the stack's
    # tests run eager for that), then 0.72-0.77x the eager TTFT and 0.8x the TPOT on one core.
    "compiled": ["--no-enforce-eager"],
    "eager": [],  # the stack's default
}
DEFAULT_SLOS = ("chat:2500:75", "batch:8000:250")  # why: README.md, docs/goodput.md


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    modes = args.modes.split(",")
    slos = [Slo.parse(text) for text in args.slo or DEFAULT_SLOS]
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # Found out before the sweep, not after its half hour of measuring.
        raise SystemExit("--plot needs the `bench` extra: pip install 'pd-router[bench]'")
    if args.replot:
        results, meta = tables.load(Path(args.replot))
        _report(results, meta["modes"], _points_of(results), slos, meta, args.plot)
        return 0
    points = _points(args.inputs, args.qps)
    out = Path(args.out or tempfile.mkdtemp(prefix="serve-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    model_path = ensure_model(args.variant, args.cache_dir)
    results: tables.Results = {}
    meta = {"modes": modes, "argv": sys.argv[1:], "slos": [s.label() for s in slos]}
    for rep in range(args.repeats):
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]  # rotated per repeat
        for mode in order:
            with _stack(mode, args, slos[0]) as stack:
                _warm_up(stack, model_path, args, out / f"warmup-{mode}-{rep}")
                for point in points:
                    res = results.setdefault((mode, point), Result())
                    before = _snapshot(stack)
                    where = out / f"{mode}-{rep}"
                    client = _bench(stack, model_path, point, args, where, rep, slos)
                    res.client.append(client)
                    res.breakdown.append(_breakdown(before, _snapshot(stack), stack))
                    _say(f"{mode} {point}: mean TTFT {client['mean_ttft_ms']:.0f} ms")
            tables.save(results, out / "results.json", meta)  # a stopped sweep keeps its points
    _report(results, modes, points, slos, meta, args.plot)
    print(f"\nraw results: {out} (tables again: --replot {out / 'results.json'})")
    return 0


def _points_of(results: tables.Results) -> list[Point]:
    return sorted({p for _, p in results}, key=lambda p: (p.input_len, p.qps))


def _report(
    results: tables.Results,
    modes: list[str],
    points: list[Point],
    slos: list[Slo],
    meta: dict[str, Any],
    plot_path: str | None,
) -> None:
    print(f"\n`vllm bench serve` through pd-router: {' '.join(meta['argv'])}")
    print("goodput in req/s, times in ms, medians over repeats; ratios: median (range) over")
    print(f"repeats of each repeat's ratio to {tables.BASELINE} in the same repeat\n")
    tables.print_goodput_table(results, modes, points, slos)
    tables.print_breakdown(results, modes, points)
    if plot_path:
        tables.plot(results, modes, points, slos, Path(plot_path))
        print(f"\ngoodput against QPS: {plot_path}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--modes",
        default="dp2,pull,push,pipelined,pipelined~1,pipelined*",
        help=f"of {list(MODES)}; ':worker' pins only the forward pass (the control); "
        "'pipelined+step' posts the connector's WRITEs once per step; "
        "'pipelined~2' serves a request on D alone when P already runs 2 prefills; "
        "'pipelined*' runs the adaptive rule (docs/policy.md) with the first --slo, "
        "'pipelined*either' with single_engine: either (default decode); "
        f"'@name' adds engine flags, name of {list(ENGINE_FLAGS)}",
    )
    p.add_argument("--inputs", default="256,768", help="prompt lengths in tokens")
    p.add_argument(
        "--qps",
        default="256=0.3,1.5,3;768=0.2,0.6,1.2",
        help="request rates (Poisson): 'A,B' at every input, or 'N=A,B;M=C,D' per input",
    )
    p.add_argument("--output-len", type=int, default=64, help="tokens per answer (ignore_eos)")
    p.add_argument("--prompts", type=int, default=16, help="requests per point")
    p.add_argument("--repeats", type=int, default=2, help="sweeps, mode order rotated")
    p.add_argument("--variant", default=DEFAULT_VARIANT, help="stack model")
    p.add_argument("--cache-dir", default=None, help="default $PD_ROUTER_CACHE or ~/.cache")
    p.add_argument("--out", default=None, help="folder for vllm bench serve's results")
    p.add_argument("--prefix-caching", action="store_true", help="on in every engine")
    p.add_argument("--engine", default="eager", choices=list(ENGINE_FLAGS), help="flag set")
    p.add_argument("--dtype", default=None, help="what the engines compute in (model's default)")
    # Each engine's KV cache holds 8 sequences of this length: 2,048 starts a real-model stack
    # ~20 s sooner than the stack's 4,096 and still holds ~19 streams of 768 + 64 tokens.
    p.add_argument("--max-model-len", type=int, default=2048, help="each engine's")
    p.add_argument(
        "--slo",
        action="append",
        help=f"NAME:TTFT_MS:TPOT_MS, repeatable (default: {' '.join(DEFAULT_SLOS)})",
    )
    p.add_argument("--plot", default=None, help="draw goodput against QPS to this PNG")
    p.add_argument("--replot", default=None, help="tables (and --plot) from a results.json")
    return p.parse_args(argv)


def _points(inputs: str, qps: str) -> list[Point]:
    """``--qps 0.2,1`` at every input length, or per length: ``256=0.3,3;768=0.2,1.2``."""
    if "=" not in qps:
        return [Point(n, q) for n in _ints(inputs) for q in _floats(qps)]
    per_input = dict(part.split("=") for part in qps.split(";"))
    return [Point(n, q) for n in _ints(inputs) for q in _floats(per_input[str(n)])]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _say(text: str) -> None:
    print(f"[serve-bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


@contextmanager
def _stack(mode: str, args: argparse.Namespace, slo: Slo) -> Iterator[Stack]:
    """``mode`` is a name of ``MODES``, or one with ``:worker``: vLLM's own pinning (only the
    forward pass on the engine's core), the control for the stack's whole-engine pinning."""
    base, _, pin = mode.partition(":")
    base, adaptive, single = base.partition("*")  # pipelined*: the adaptive rule on,
    # pipelined*either: with its single_engine (who may serve alone; default decode)
    base, _, busy = base.partition("~")  # pipelined~2: disagg_max_prefill_queue
    base, _, flags = base.partition("@")  # agg1@compiled: more engine flags
    base, _, batch = base.partition("+")  # pipelined+step: the connector's write_batch
    stack_mode, cpus, replicas = MODES[base]
    caching = ["--enable-prefix-caching"] if args.prefix_caching else []
    caching += ENGINE_FLAGS[flags or args.engine]
    overrides: dict[str, Any] = {"disagg_max_prefill_queue": int(busy)} if busy else {}
    if adaptive:
        rule = {"enabled": True, "ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}
        overrides["adaptive"] = rule | ({"single_engine": single} if single else {})
    if stack_mode != "aggregated":
        names = ["prefill-0", "decode-0"]
    else:
        names = [f"aggregated-{i}" for i in range(replicas)]
    with Stack(
        mode=stack_mode,
        variant=args.variant,
        cache_dir=args.cache_dir,
        aggregated_cpus=cpus,
        aggregated_replicas=replicas,
        pin=pin or "engine",
        dtype=args.dtype,
        max_model_len=args.max_model_len,
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
    stack: Stack,
    model_path: Path,
    point: Point,
    args: argparse.Namespace,
    where: Path,
    rep: int,
    slos: list[Slo],
) -> dict[str, float]:
    name = f"in{point.input_len}-qps{point.qps}.json"
    # The same seed for every mode of a repeat: the same prompts, arriving at the same times.
    data = _run_bench(_bench_argv(stack, model_path, point, args, args.prompts, rep), where / name)
    if data.get("failed"):
        _say(f"{stack.mode.value} {point}: {data['failed']} failed: {data.get('errors', [])[:3]}")
    return tables.client_figures(data, slos)


# -- the breakdown ----------------------------------------------------------------------------


def _snapshot(stack: Stack) -> dict[str, MetricsPage]:
    snap = {spec.name: stack.engine_metrics(spec.name) for spec in stack.engines}
    snap["router"] = scrape(stack.router_url)
    return snap


def _mean_ms(
    before: dict[str, MetricsPage], after: dict[str, MetricsPage], nodes: list[str], histogram: str
) -> float:
    """Mean of the observations ``nodes`` made between two snapshots, in ms (NaN if none)."""
    count = total = 0.0
    for node in nodes:
        count += after[node].total(f"{histogram}_count") - before[node].total(f"{histogram}_count")
        total += after[node].total(f"{histogram}_sum") - before[node].total(f"{histogram}_sum")
    return 1000 * total / count if count > 0 else float("nan")


def _breakdown(
    before: dict[str, MetricsPage], after: dict[str, MetricsPage], stack: Stack
) -> dict[str, float]:
    """Mean per request of each stage, from the router's and the engines' own histograms."""

    def mean(nodes: list[str], histogram: str) -> float:
        return _mean_ms(before, after, nodes, histogram)

    decisions = "pdrouter_disagg_decisions_total"
    r0, r1 = before["router"], after["router"]

    def share(*served: str) -> float:
        """Of the requests dispatched, those with one of these decisions, in %."""
        n = sum(r1.total(decisions, decision=d) - r0.total(decisions, decision=d) for d in served)
        dispatched = r1.total(decisions) - r0.total(decisions)
        return 100 * n / dispatched if dispatched else float("nan")

    router = ["router"]
    out = {
        # Requests served by D alone because P was busy (disagg_max_prefill_queue) or by the
        # adaptive rule's choice, and by P alone (the rule's), in %.
        "d_alone_pct": share("decode_only_busy", "decode_alone"),
        "p_alone_pct": share("prefill_alone"),
        "router_ttft": mean(router, "pdrouter_ttft_seconds"),
        "router_prefill": mean(router, "pdrouter_prefill_duration_seconds"),
        "router_handoff": mean(router, "pdrouter_handoff_seconds"),
    }
    aggregated = [s.name for s in stack.engines if s.role == "aggregated"]
    if aggregated:  # every engine serves whole requests
        out["p_queue"] = mean(aggregated, "vllm:request_queue_time_seconds")
        out["p_prefill"] = mean(aggregated, "vllm:request_prefill_time_seconds")
        out["d_ttft"] = mean(aggregated, "vllm:time_to_first_token_seconds")
        return out
    p, d = ["prefill-0"], ["decode-0"]
    out["p_queue"] = mean(p, "vllm:request_queue_time_seconds")
    out["p_prefill"] = mean(p, "vllm:request_prefill_time_seconds")
    out["d_queue"] = mean(d, "vllm:request_queue_time_seconds")
    out["d_first_step"] = mean(d, "vllm:request_prefill_time_seconds")
    out["d_ttft"] = mean(d, "vllm:time_to_first_token_seconds")
    if stack.mode.value == "pull":  # D READs; P WRITEs in the push modes
        out["kv_xfer"] = mean(d, "vllm:nixl_xfer_time_seconds")
    elif stack.mode.value == "push":
        out["kv_xfer"] = mean(p, "vllm:nixl_xfer_time_seconds")
    else:
        # From P's last step, not the first WRITE: that one spans every chunk after it.
        out["kv_xfer"] = mean(p, "vllm:pdr_request_write_tail_seconds")
    return out


if __name__ == "__main__":
    sys.exit(main())
