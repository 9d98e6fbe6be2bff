"""A router's CPU work per request as machine instructions: repeatable on a noisy machine.

CPU milliseconds per request (``bench/router_bench.py``) move 10-20% between rounds on a
shared 2-core machine, as large as the differences sought (a refactor's cost, a peer's
margin). Instructions do not depend on what else the machine runs. Each target is run under
``valgrind --tool=callgrind`` (every thread counted: the Rust peers' too), warmed up, its
counters zeroed (``callgrind_control -z``), then sent exactly ``--requests`` streamed
completions by a client of ``--concurrency`` connections, and dumped (``callgrind_control
-d``) once every answer has ended with ``[DONE]``: instructions per request are the total
over the requests. The same counters over ``--idle`` seconds with no request give what the
target does on its own (health checks, timers), reported per second beside.

Targets and fake engines are ``router_bench.py``'s (``pull``, ``push``, ``pull@base`` with
``--baseline-root``, ``vllm-router``, ``smg``); the engines run outside valgrind. Under
valgrind a target runs 30-100x slower, so latency here means nothing: only the counts do.
What still varies between runs: how many SSE events one read carries (a slow router reads
several at once), the garbage collector's timing, the peers' thread scheduling; the rounds'
spread says how much.

Example::

    .venv/bin/python bench/instructions.py --targets pull,pull@base --baseline-root BASE \\
        --requests 300 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import router_bench as rb

VALGRIND = ["valgrind", "--tool=callgrind", "--collect-atstart=yes", "--trace-children=no"]


def _totals(dump: Path) -> int:
    """The instructions a callgrind dump counted (its ``summary:`` or ``totals:`` line)."""
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dump}")


def _control(flag: str, pid: int, outdir: Path) -> Path | None:
    """``callgrind_control`` on ``pid``; with ``-d`` the dump it wrote."""
    before = set(outdir.glob("cg.*"))
    subprocess.run(["callgrind_control", flag, str(pid)], check=True, capture_output=True)
    if flag != "-d":
        return None
    for _ in range(600):
        new = sorted(set(outdir.glob("cg.*")) - before, key=lambda p: p.stat().st_mtime)
        if new and new[-1].stat().st_size > 0 and "totals:" in new[-1].read_text(errors="ignore"):
            return new[-1]
        time.sleep(0.1)
    raise RuntimeError("callgrind wrote no dump")


async def _requests(port: int, n: int, concurrency: int, tokens: int, prompt: str) -> int:
    """Send ``n`` streamed completions over ``concurrency`` connections; the errors (a non-200
    answer or a stream without ``[DONE]``)."""
    body = {"model": "fake", "prompt": prompt, "max_tokens": tokens, "stream": True}
    left, errors = n, 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            nonlocal left, errors
            while left > 0:
                left -= 1
                url = f"http://127.0.0.1:{port}/v1/completions"
                async with client.stream("POST", url, json=body) as r:
                    data = b"".join([c async for c in r.aiter_raw()])
                errors += r.status_code != 200 or b"[DONE]" not in data

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return errors


def _measure(args: argparse.Namespace, target: rb.Target, outdir: Path) -> tuple[float, float]:
    """(instructions per request, idle instructions per second) of one run of ``target``."""
    assert target.argv is not None
    rb._port_free(target.port)
    out = f"--callgrind-out-file={outdir}/cg.%p"
    proc = rb._spawn(
        [*VALGRIND, out, *target.argv], None, outdir / f"{target.name}.log", target.cwd
    )
    try:
        rb._wait_http(target.port, target.ready_path, proc, 600)
        rb._wait_serving(target.port, proc, 600)
        prompt = "x" * args.prompt_chars
        asyncio.run(_requests(target.port, args.warmup, args.concurrency, args.tokens, prompt))
        _control("-z", proc.pid, outdir)
        time.sleep(args.idle)
        idle = _control("-d", proc.pid, outdir)
        _control("-z", proc.pid, outdir)
        errors = asyncio.run(
            _requests(target.port, args.requests, args.concurrency, args.tokens, prompt)
        )
        busy = _control("-d", proc.pid, outdir)
        assert idle is not None and busy is not None
        if errors:
            raise RuntimeError(f"{target.name}: {errors} requests failed")
        return _totals(busy) / args.requests, _totals(idle) / args.idle
    finally:
        rb._stop(proc)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--targets", default="pull,vllm-router,smg")
    p.add_argument("--baseline-root", help="another checkout; targets 'pull@base' etc. run it")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--prompt-chars", type=int, default=512)
    p.add_argument("--idle", type=float, default=5.0, help="seconds counted with no request")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port-base", type=int, default=16300)
    p.add_argument("--vllm-router-bin")
    p.add_argument("--smg-bin")
    p.add_argument("--engine-vllm", choices=rb.ENGINE_SHAPES, default=rb.ENGINE_SHAPES[0])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="router-instructions-"))
    bench = rb.parse_args(
        [
            "--targets",
            args.targets,
            "--port-base",
            str(args.port_base),
            "--tokens",
            str(args.tokens),
            "--log-level",
            "warning",
            "--engine-vllm",
            args.engine_vllm,
            *(["--baseline-root", args.baseline_root] if args.baseline_root else []),
            *(["--vllm-router-bin", args.vllm_router_bin] if args.vllm_router_bin else []),
            *(["--smg-bin", args.smg_bin] if args.smg_bin else []),
        ]
    )
    engines = rb._start_engines(bench, tmp)
    per_req: dict[str, list[float]] = {}
    idle: dict[str, list[float]] = {}
    try:
        p_url, d_url = (f"http://127.0.0.1:{args.port_base + i}" for i in (1, 2))
        targets = [t for t in rb._targets(bench, tmp, p_url, d_url) if t.argv is not None]
        for rnd in range(args.rounds):
            for t in targets[rnd % len(targets) :] + targets[: rnd % len(targets)]:
                ir, quiet = _measure(args, t, tmp)
                per_req.setdefault(t.name, []).append(ir)
                idle.setdefault(t.name, []).append(quiet)
                print(f"round {rnd} {t.name}: {ir / 1e6:.2f} M instructions/request", flush=True)
    finally:
        for e in engines:
            rb._stop(e)
    print(f"\ncommand: {' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}")
    print(f"{args.requests} requests of {args.tokens} tokens, {args.prompt_chars}-char prompts, ")
    print(f"{args.concurrency} connections; logs and dumps: {tmp}\n")
    first = next(iter(per_req), None)
    print(f"| target | M instructions/request, median [min-max] | vs {first} | idle M/s |")
    print("|---|---|---|---|")
    for name, vals in per_req.items():
        med = statistics.median(vals)
        base = statistics.median(per_req[first]) if first else med
        spread = f"{med / 1e6:.2f} [{min(vals) / 1e6:.2f}-{max(vals) / 1e6:.2f}]"
        quiet = statistics.median(idle[name]) / 1e6
        print(f"| {name} | {spread} | {med / base:.2f}x | {quiet:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
