#!/usr/bin/env python3
"""Where the engines' time goes under load: py-spy samples every process of every engine
(API server, EngineCore, worker) while ``vllm bench serve`` runs through the router.

One stack per mode in turn (the modes of ``bench/serve_bench.py``), one load point. For each
engine process it prints the share of samples per activity: the forward pass, the scheduler,
the KV connector (NIXL posting, polling, handshakes), output processing, the API server's
HTTP/tokenizer work, idle waiting, and the rest; then the functions with the most samples of
their own. Threads are sampled idle too (``--idle``), so the shares add up to 100% of each
thread's wall time; a process's threads are summed, so a process with a busy thread and an
idle one shows both.

    .venv/bin/python bench/profile_engines.py --modes pull,pipelined --input 1536 --qps 1

Needs ``py-spy`` (``pip install py-spy``) and permission to ptrace the engines (root, or
``kernel.yama.ptrace_scope=0``). Not a test: it asserts nothing. The raw collapsed stacks stay
under ``--out`` for flame graphs (``inferno-flamegraph`` or speedscope read them).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import serve_bench as sb  # the stacks and the client of bench/serve_bench.py
from stacks import py_spy, read_stacks, thread_cpu_seconds

from router.stack import Stack
from router.stack.model import ensure_model

# (activity, substrings of a sampled stack that put it there), first match wins. A stack is
# "frame;frame;..." from the thread's root down to the sampled frame.
ACTIVITIES: list[tuple[str, tuple[str, ...]]] = [
    ("kv connector", ("kv_connector", "nixl", "connector/", "Connector")),
    ("forward pass", ("execute_model", "model_runner", "forward", "_C.", "torch/")),
    ("scheduler", ("core/sched/", "kv_cache_manager", "block_pool")),
    ("output processing", ("output_processor", "detokenizer", "logprobs")),
    ("api server", ("entrypoints/", "uvicorn", "starlette", "fastapi", "tokeniz")),
    ("engine loop / ipc", ("zmq", "msgspec", "serial_utils", "core_client", "engine/core.py")),
]
# Where a sampled thread waits (the sampled function, its last dotted part): blocked in a
# queue, a socket, a selector or a lock; a thread-pool worker with no work item is in
# ``_worker`` itself, and an asyncio loop in its native poll shows as ``Runner.run``.
IDLE_FUNCTIONS = frozenset(
    {"select", "poll", "wait", "_recv", "recv", "recv_multipart", "sleep", "acquire", "epoll",
     "_worker", "get", "dequeue", "recv_into", "_wait_for_tstate_lock"}
)  # fmt: skip
IDLE_STACK_LEAVES = ("Runner.run",)
# Busy-waiting: vLLM's shared-memory broadcast spins on sched_yield for the next message.
SPIN_LEAVES = ("sched_yield", "memory_fence")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.read:  # the raw stacks of an earlier run, analysed again
        for folder in sorted(p for p in Path(args.read).iterdir() if p.is_dir()):
            files = {f.stem.replace("_", "/", 1): f for f in sorted(folder.glob("*-*.txt"))}
            _print(folder.name, sb.Point(args.input, args.qps), files, args.top, args.rate)
        return 0
    if not args.cpu_only and py_spy() is None:
        print("py-spy not found: pip install py-spy", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="pdr-profile-"))
    model_path = ensure_model(args.variant, args.cache_dir)
    point = sb.Point(args.input, args.qps)
    for mode in args.modes.split(","):
        with sb._stack(mode, args) as stack:
            warm = sb._bench_argv(stack, model_path, sb.Point(args.input, 1000.0), args, 4, 999)
            sb._run_bench(warm, out / f"warm-{mode}.json")
            before, t0 = _cpu_seconds(stack), time.monotonic()
            profiles = _profile(stack, model_path, point, args, out / mode)
            used = _cpu_seconds(stack) - before
            wall = time.monotonic() - t0
        if profiles:
            _print(mode, point, profiles, args.top, args.rate)
        _print_cpu(mode, point, used, wall, args.top)
    print(f"\nraw stacks: {out}")
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--modes", default="pull,push,pipelined", help="serve_bench's mode names")
    p.add_argument("--input", type=int, default=1536, help="prompt length in tokens")
    p.add_argument("--qps", type=float, default=1.0, help="request rate (Poisson)")
    p.add_argument("--prompts", type=int, default=30, help="requests profiled")
    p.add_argument("--output-len", type=int, default=64, help="tokens per answer (ignore_eos)")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=8, help="functions listed per process")
    p.add_argument("--variant", default=sb.DEFAULT_VARIANT, help="stack model")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default=None, help="folder for the raw stacks")
    p.add_argument("--read", default=None, help="analyse the raw stacks of an earlier --out")
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument(
        "--cpu-only", action="store_true", help="CPU time per thread only, without py-spy"
    )
    p.add_argument("--engine", default="compiled", choices=list(sb.ENGINE_FLAGS))
    p.add_argument("--dtype", default="bfloat16")
    return p.parse_args(argv)


def _profile(
    stack: Stack, model_path: Path, point: sb.Point, args: argparse.Namespace, out: Path
) -> dict[str, Path]:
    """py-spy on every engine process for the length of one bench run: ``label -> raw file``."""
    out.mkdir(parents=True, exist_ok=True)
    spy = py_spy() or "py-spy"  # main() has refused to start without it
    recorders, files = [], {}
    for spec in [] if args.cpu_only else stack.engines:
        for pid in stack.engine_pids(spec.name):
            label = f"{spec.name}/{_process_name(pid)}-{pid}"
            files[label] = path = out / f"{label.replace('/', '_')}.txt"
            argv = [spy, "record", "--pid", str(pid), "--rate", str(args.rate), "--idle"]
            argv += ["--nonblocking", "--format", "raw", "--output", str(path)]
            recorders.append(
                subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
    try:
        bench = sb._bench_argv(stack, model_path, point, args, args.prompts, 7)
        sb._run_bench(bench, out / "bench.json")
    finally:
        for rec in recorders:
            rec.send_signal(2)  # py-spy writes its output on SIGINT
        for rec in recorders:
            rec.wait(timeout=60)
    return {label: path for label, path in files.items() if path.exists()}


def _cpu_seconds(stack: Stack) -> Counter[str]:
    """CPU seconds (user + system) so far of every thread of every engine process, by
    ``engine/process thread-name``: what the threads cost, not how long they were sampled."""
    used: Counter[str] = Counter()
    groups = [(spec.name, stack.engine_pids(spec.name)) for spec in stack.engines]
    for group, pids in [*groups, ("router", stack.router_pids())]:
        for pid in pids:
            process = _process_name(pid)
            for comm, seconds in thread_cpu_seconds(pid):
                used[f"{group}/{process} {comm}"] += seconds
    # The load generator (``vllm bench serve``, a child of this script, waited for); without
    # --cpu-only the py-spy recorders are children too and count here.
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    used["client/vllm-bench-serve all"] += children.ru_utime + children.ru_stime
    return used


def _print_cpu(mode: str, point: sb.Point, used: Counter[str], wall: float, top: int) -> None:
    """CPU time over the run, as a share of one core: per engine, the router and the load
    generator, per process, and its busiest threads (vLLM names its threads; Python threads
    show as ``python``). The machine's cores bound the sum."""
    print(f"\n### {mode}: CPU time, input {point.input_len}, QPS {point.qps:g}, {wall:.0f} s\n")
    print("| engine/process | thread | % of one core |")
    print("|---|---|---|")
    processes: Counter[str] = Counter()
    for key, seconds in used.items():
        processes[key.split(" ", 1)[0]] += seconds
    for process, seconds in sorted(processes.items()):
        print(f"| {process} | all | {100 * seconds / wall:.0f}% |")
        threads = [(k, v) for k, v in used.items() if k.split(" ", 1)[0] == process]
        for key, secs in sorted(threads, key=lambda kv: -kv[1])[:top]:
            if secs / wall >= 0.01 and key.split(" ", 1)[1] != "all":
                print(f"| {process} | {key.split(' ', 1)[1]} | {100 * secs / wall:.0f}% |")


def _process_name(pid: int) -> str:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    return comm.removeprefix("VLLM::") or "process"


def activity(stack: str) -> str:
    """The activity of one sampled stack: by its sampled frame when that waits or spins,
    else by the first of ``ACTIVITIES`` whose substrings it holds."""
    function = stack.rsplit(";", 1)[-1].split(" (")[0]
    last = function.rsplit(".", 1)[-1]
    if last in SPIN_LEAVES:
        return "spin wait"
    if last in IDLE_FUNCTIONS or function in IDLE_STACK_LEAVES:
        return "idle"
    for name, needles in ACTIVITIES:
        if any(n in stack for n in needles):
            return name
    return "other"


def _print(mode: str, point: sb.Point, profiles: dict[str, Path], top: int, rate: int) -> None:
    """Per process, the time of each activity as a share of one core over the profile: a
    thread sampled busy all along is 100%, so a process's row adds up to its thread count."""
    stacks = {label: read_stacks(path) for label, path in sorted(profiles.items())}
    # The profile's length: the samples of the process sampled longest per thread, taken as
    # the single-threaded one with the most samples (vLLM's resource tracker, an idle API
    # thread): every thread gets ``rate`` samples a second with --idle.
    wall = max((sum(c.values()) for c in stacks.values() if len(_roots(c)) == 1), default=0)
    wall = wall or max(sum(c.values()) for c in stacks.values())
    names = [a for a, _ in ACTIVITIES] + ["spin wait", "idle", "other"]
    print(f"\n### {mode}: input {point.input_len}, QPS {point.qps:g}, {wall / rate:.0f} s\n")
    print("| process | threads | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    tops = {}
    for label, counts in stacks.items():
        shares: Counter[str] = Counter()
        own: Counter[str] = Counter()
        for stack, count in counts.items():
            kind = activity(stack)
            shares[kind] += count
            if kind != "idle":
                own[stack.rsplit(";", 1)[-1]] += count
        cells = " | ".join(f"{100 * shares[n] / wall:.0f}%" for n in names)
        threads = sum(counts.values()) / wall
        print(f"| {label} | {threads:.1f} | {cells} |")
        tops[label] = own.most_common(top)
    for label, functions in tops.items():
        if functions:
            print(f"\n{label}, busiest functions (% of one core):")
        for function, count in functions:
            print(f"  {100 * count / wall:5.1f}%  {function}")


def _roots(counts: Counter[str]) -> set[str]:
    return {stack.split(";", 1)[0] for stack in counts}


if __name__ == "__main__":
    raise SystemExit(main())
