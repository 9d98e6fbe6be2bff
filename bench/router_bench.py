"""Router benchmark: this router (pull, push, aggregated) vs vllm-router vs D direct.

One run starts one fake P and one fake D (``bench/fake_engine.py``) and, for
every concurrency level and round, measures each target with a fresh router
process and a separate load-generator process (``bench/loadgen.py``):

* ``direct``: the client calls D itself (the floor; also the load generator's
  own ceiling: if direct is far above a router, the client is not the limit);
* ``pull`` / ``push`` / ``aggregated``: ``python -m router serve --config ...``;
* ``vllm-router``: ``vllm-router --vllm-pd-disaggregation --prefill P --decode D``
  when found (``--vllm-router-bin`` or PATH); it has a single P/D flow (pull).

Routers are started under ``taskset -c --router-cpus`` when given; both routers
then get exactly the same cores (default: no pinning, i.e. the whole machine
for both). Targets are interleaved within a round so machine noise hits them
alike; with ``--rounds N`` the median of each figure is reported.

Figures: requests/s, streamed SSE events/s, client TTFT and end-to-end p50/p99,
errors, router RSS (idle and peak; per open stream at the highest
concurrency), router CPU-ms per request (robust on a noisy machine), and each
router's throughput and added TTFT as ratios to vllm-router and to direct.

Example::

    .venv/bin/python bench/router_bench.py --concurrency 32,256,2000 --rounds 2
"""

from __future__ import annotations

import argparse
import http.server
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from stacks import py_spy

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ROUTER_MODES = ("pull", "push", "aggregated")
CLK_TCK = os.sysconf("SC_CLK_TCK")
ADAPTER = "fake-lora"  # the LoRA adapter both fake engines list (the +lora targets' model)


@dataclass
class Target:
    name: str
    argv: list[str] | None  # None: the client calls D directly
    port: int
    ready_path: str = "/health"
    cwd: Path = ROOT


@dataclass
class Sample:
    result: dict[str, Any]
    rss_idle_mb: float = float("nan")
    rss_peak_mb: float = float("nan")
    cpu_ms_per_req: float = float("nan")
    requests_total: float = float("nan")  # warm-up included: what the CPU (and cProfile) saw


@dataclass
class Stats:
    samples: list[Sample] = field(default_factory=list)

    def med(self, key: str) -> float:
        vals = [s.result[key] for s in self.samples]
        return statistics.median(vals) if vals else float("nan")

    def med_attr(self, key: str) -> float:
        vals = [getattr(s, key) for s in self.samples]
        return statistics.median(vals) if vals else float("nan")

    def errors(self) -> int:
        return sum(int(s.result["errors"]) for s in self.samples)


# -- processes ---------------------------------------------------------------


def _spawn(
    argv: list[str], cpus: str | None, log: Path, cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    if cpus:
        argv = ["taskset", "-c", cpus, *argv]
    out = log.open("ab")
    # Own process group: stopping it also stops anything the target forked.
    return subprocess.Popen(
        argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait_http(port: int, path: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"port {port} not ready in {timeout}s")


def _tree(pid: int) -> list[int]:
    """``pid`` and its children (the workers of ``--workers N``)."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    return [pid, *(int(k) for k in kids)]


def _rss_mb(pid: int) -> float:
    return sum(_rss_one(p) for p in _tree(pid))


def _cpu_s(pid: int) -> float:
    return sum(_cpu_one(p) for p in _tree(pid))


def _rss_one(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _cpu_one(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
    except OSError:
        return float("nan")


class RssSampler(threading.Thread):
    """Peak RSS of one process, sampled every 100 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self._stop_evt = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self._stop_evt.wait(0.1):
            rss = _rss_mb(self.pid)
            if rss == rss:
                self.peak = max(self.peak, rss)

    def stop(self) -> float:
        self._stop_evt.set()
        self.join()
        return self.peak


# -- targets -----------------------------------------------------------------


def _router_config(
    mode: str,
    port: int,
    p_url: str,
    d_url: str,
    log_level: str,
    otlp: str | None = None,
    access_log: bool = False,
    lora: bool = False,
    dp: int = 1,
) -> str:
    """``dp``: P and D declared as ``--data-parallel-size dp`` engines (each rank routed as an
    engine of its own, every leg pinned by its header; the fake engines ignore it), the decode
    slots split between the ranks."""
    sized = f", data_parallel_size: {dp}" if dp > 1 else ""
    prefill = (
        f'[{{url: "{p_url}", engine_id: "fake-p", kv_host: 127.0.0.1, kv_port: 12000{sized}}}]'
    )
    tracing = f'tracing: {{endpoint: "{otlp}"}}\n' if otlp else ""
    tracing += "logging: {access: true}\n" if access_log else ""
    return (
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"log_level: {log_level}\n"
        "models:\n"
        f"  - name: fake\n    mode: {mode}\n"
        + ("    lora: {enabled: true}\n" if lora else "")
        + f"    prefill: {prefill}\n"
        f'    decode: [{{url: "{d_url}", slots: {16384 // dp}{sized}}}]\n'
        "admission: {queue_size: 16384}\n" + tracing
    )


class _OtlpSink(http.server.BaseHTTPRequestHandler):
    """Takes the traced targets' OTLP exports and drops them (an OTLP/HTTP 200)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _otlp_sink(port: int) -> str:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _OtlpSink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{port}/v1/traces"


def _split_workers(spec: str) -> tuple[str, int]:
    """``"pull-w2"`` -> ``("pull", 2)``; a plain mode -> ``(mode, 1)``; a ``+traced``
    suffix (tracing on, exported to a sink in this process), ``+logged`` (access log on,
    into the target's log file), ``+httpx`` (engine calls through httpx instead of the
    router's HTTP/1.1 client: ``bench/httpx_router.py``), ``+lora`` (LoRA routing on, every
    request naming the adapter both fake engines list: :data:`ADAPTER`) or ``+dp`` (P and D
    declared data-parallel, size 2: :func:`_router_config`) is not part of the mode."""
    for suffix in ("+lora", "+dp", "+traced", "+logged", "+httpx"):
        spec = spec.replace(suffix, "")
    mode, sep, n = spec.rpartition("-w")
    return (mode, int(n)) if sep and n.isdigit() else (spec, 1)


def _targets(args: argparse.Namespace, tmp: Path, p_url: str, d_url: str) -> list[Target]:
    port = args.port_base + 10
    out: list[Target] = []
    sink: str | None = None  # one OTLP sink for every traced target
    for name in args.targets:
        if name == "direct":
            out.append(Target("direct", None, args.port_base + 2))
        elif _split_workers(name.partition("@")[0])[0] in ROUTER_MODES:
            # "pull@base": the same mode from the checkout at --baseline-root (before/after);
            # "pull-w2": the router with --workers 2.
            spec, _, base = name.partition("@")
            mode, workers = _split_workers(spec)
            cwd = Path(args.baseline_root).resolve() if base else ROOT
            cfg = tmp / f"{name}.yaml"
            otlp = None
            if name.endswith("+traced"):
                sink = sink or _otlp_sink(args.port_base + 9)
                otlp = sink
            logged = name.endswith("+logged")
            lora = "+lora" in name
            dp = 2 if "+dp" in name else 1
            cfg.write_text(
                _router_config(mode, port, p_url, d_url, args.log_level, otlp, logged, lora, dp)
            )
            argv = [sys.executable, "-m", "router", "serve", "--config", str(cfg)]
            if spec.endswith("+httpx"):
                argv = [sys.executable, str(HERE / "httpx_router.py"), "--config", str(cfg)]
            if workers > 1:
                argv += ["--workers", str(workers)]
            out.append(Target(name, argv, port, "/ready", cwd))
            port += 1
        elif name == "vllm-router":
            binary = args.vllm_router_bin or shutil.which("vllm-router")
            if not binary:
                print("vllm-router not found: skipped (--vllm-router-bin)", file=sys.stderr)
                continue
            argv = [
                binary,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--vllm-pd-disaggregation",
                "--prefill",
                p_url,
                "--decode",
                d_url,
                "--prometheus-port",
                str(port + 500),
                "--log-level",
                args.log_level,
            ]
            out.append(Target("vllm-router", argv, port, "/readiness"))
            port += 1
    return out


def _profiler(
    args: argparse.Namespace, target: Target, conc: int, proc: subprocess.Popen[bytes] | None
) -> subprocess.Popen[bytes] | None:
    """py-spy on the router for the length of the load (``--profile DIR``): raw stacks, one
    file per target, concurrency and round, for ``bench/profile_diff.py``."""
    if args.profile is None or proc is None:
        return None
    spy = py_spy()
    if spy is None:
        raise RuntimeError("--profile needs py-spy (pip install py-spy)")
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    n = len(list(out.glob(f"{target.name}-c{conc}-*.txt")))
    path = out / f"{target.name}-c{conc}-{n}.txt"
    argv = [spy, "record", "--pid", str(proc.pid), "--rate", str(args.profile_rate)]
    argv += ["--nonblocking", "--subprocesses", "--format", "raw", "--output", str(path)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _cprofiled(args: argparse.Namespace, target: Target, conc: int) -> list[str] | None:
    """The target's command under ``bench/cprofile_run.py`` (``--cprofile DIR``): one pstats
    file per target, concurrency and round, for ``bench/call_diff.py``."""
    if args.cprofile is None or target.argv is None or target.name == "vllm-router":
        return target.argv
    out = Path(args.cprofile).resolve()
    out.mkdir(parents=True, exist_ok=True)
    n = len(list(out.glob(f"{target.name}-c{conc}-*.prof")))
    path = out / f"{target.name}-c{conc}-{n}.prof"
    return [sys.executable, str(HERE / "cprofile_run.py"), str(path), *target.argv[1:]]


def _measure(args: argparse.Namespace, target: Target, conc: int, logdir: Path) -> Sample:
    proc = None
    argv = _cprofiled(args, target, conc)
    if argv is not None:
        proc = _spawn(argv, args.router_cpus, logdir / f"{target.name}.log", target.cwd)
        _wait_http(target.port, target.ready_path, proc, 60)
        if argv is not target.argv:
            proc.send_signal(signal.SIGUSR1)  # start-up left out of the profile
        time.sleep(0.3)
    sampler = RssSampler(proc.pid) if proc else None
    idle = _rss_mb(proc.pid) if proc else float("nan")
    cpu0 = _cpu_s(proc.pid) if proc else float("nan")
    if sampler:
        sampler.start()
    duration = args.duration_2000 if conc >= 1000 else args.duration
    lg = [
        sys.executable,
        str(HERE / "loadgen.py"),
        "--port",
        str(target.port),
        "--concurrency",
        str(conc),
        "--duration",
        str(duration),
        "--warmup",
        str(args.warmup),
        "--max-tokens",
        str(args.tokens),
        "--prompt-chars",
        str(args.prompt_chars),
    ]
    if "+lora" in target.name:
        lg += ["--model", ADAPTER]
    if args.client_cpus:
        lg = ["taskset", "-c", args.client_cpus, *lg]
    spy = _profiler(args, target, conc, proc)
    try:
        done = subprocess.run(lg, capture_output=True, timeout=duration + args.warmup + 120)
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            spy.wait(timeout=60)
        peak = sampler.stop() if sampler else float("nan")
        cpu1 = _cpu_s(proc.pid) if proc else float("nan")
        if proc:
            _stop(proc)
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed: {done.stderr.decode()[-2000:]}")
    result = orjson.loads(done.stdout.splitlines()[-1])
    total_reqs = result["requests"] * (duration + args.warmup) / duration
    cpu_ms = 1e3 * (cpu1 - cpu0) / total_reqs if total_reqs else float("nan")
    return Sample(result, idle, peak, cpu_ms, total_reqs)


# -- report ------------------------------------------------------------------


def _fmt(v: float, digits: int = 1) -> str:
    return "-" if v != v else f"{v:.{digits}f}"


def _ratio(a: float, b: float) -> str:
    return "-" if not b or a != a or b != b else f"{a / b:.2f}x"


def _report(table: dict[int, dict[str, Stats]], args: argparse.Namespace) -> str:
    lines = []
    head = (
        "| conc | target | req/s | events/s | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 | errors "
        "| open streams avg/max | RSS idle→peak MB | KB/stream | CPU ms/req | client CPU% "
        "| req/s vs vllm-router "
        "| req/s vs direct | added TTFT p50 (ms) vs vllm-router's |"
    )
    lines += [head, "|" + "---|" * 17]
    for conc, by_target in table.items():
        direct = by_target.get("direct")
        vr = by_target.get("vllm-router")
        d_ttft = direct.med("ttft_p50_ms") if direct else float("nan")
        vr_added = vr.med("ttft_p50_ms") - d_ttft if vr else float("nan")
        for name, st in by_target.items():
            rps, idle, peak = st.med("rps"), st.med_attr("rss_idle_mb"), st.med_attr("rss_peak_mb")
            open_streams = st.med("inflight_max")
            per_stream = (peak - idle) * 1024 / open_streams if conc >= 1000 else float("nan")
            added = st.med("ttft_p50_ms") - d_ttft if name != "direct" else float("nan")
            lines.append(
                f"| {conc} | {name} | {_fmt(rps)} | {_fmt(st.med('chunks_per_s'), 0)} "
                f"| {_fmt(st.med('ttft_p50_ms'))} | {_fmt(st.med('ttft_p99_ms'))} "
                f"| {_fmt(st.med('e2e_p50_ms'))} | {_fmt(st.med('e2e_p99_ms'))} | {st.errors()} "
                f"| {_fmt(st.med('inflight_avg'), 0)}/{_fmt(open_streams, 0)} "
                f"| {_fmt(idle, 0)}→{_fmt(peak, 0)} | {_fmt(per_stream)} "
                f"| {_fmt(st.med_attr('cpu_ms_per_req'), 2)} | {_fmt(st.med('client_cpu_pct'), 0)} "
                f"| {_ratio(rps, vr.med('rps')) if vr else '-'} "
                f"| {_ratio(rps, direct.med('rps')) if direct else '-'} "
                f"| {_fmt(added)} vs {_fmt(vr_added)} |"
            )
    return "\n".join(lines)


# -- main --------------------------------------------------------------------


def _start_engines(args: argparse.Namespace, logdir: Path) -> list[subprocess.Popen[bytes]]:
    common = [
        "--tokens",
        str(args.tokens),
        "--itl-ms",
        str(args.itl_ms),
        "--prefill-us-per-token",
        str(args.prefill_us_per_token),
        "--kv-transfer-ms",
        str(args.kv_transfer_ms),
        "--adapters",
        ADAPTER,
    ]
    procs = []
    for i, role in ((1, "prefill"), (2, "decode")):
        argv = [sys.executable, str(HERE / "fake_engine.py"), "--port", str(args.port_base + i)]
        procs.append(_spawn(argv + common, args.engine_cpus, logdir / f"{role}.log"))
    for i, proc in zip((1, 2), procs, strict=True):
        _wait_http(args.port_base + i, "/health", proc, 30)
    return procs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", default="32,256,2000")
    p.add_argument("--targets", default="direct,vllm-router,pull,push,aggregated")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    p.add_argument("--duration-2000", type=float, default=8.0, help="... at concurrency >= 1000")
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--prefill-us-per-token", type=float, default=20.0)
    p.add_argument("--kv-transfer-ms", type=float, default=1.0)
    p.add_argument("--prompt-chars", type=int, default=512)
    p.add_argument("--port-base", type=int, default=10200)
    p.add_argument("--router-cpus", help="taskset list for every router, e.g. 1 or 0,1")
    p.add_argument("--engine-cpus", help="taskset list for the fake engines")
    p.add_argument("--client-cpus", help="taskset list for the load generator")
    p.add_argument("--vllm-router-bin", help="vllm-router executable (default: PATH)")
    p.add_argument("--log-level", default="info", help="both routers' log level")
    p.add_argument(
        "--baseline-root", help="another checkout of this repo; targets 'pull@base' etc. run it"
    )
    p.add_argument("--json", help="also write the raw samples here")
    p.add_argument("--profile", help="py-spy every router run into this folder (raw stacks)")
    p.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument(
        "--cprofile", help="cProfile every router run (not -wN) into this folder (call_diff.py)"
    )
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.targets = args.targets.split(",")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    engines = _start_engines(args, tmp)
    try:
        p_url, d_url = (f"http://127.0.0.1:{args.port_base + i}" for i in (1, 2))
        targets = _targets(args, tmp, p_url, d_url)
        table: dict[int, dict[str, Stats]] = {}
        for conc in args.concurrency:
            table[conc] = {t.name: Stats() for t in targets}
            for rnd in range(args.rounds):
                for t in targets:
                    s = _measure(args, t, conc, tmp)
                    table[conc][t.name].samples.append(s)
                    r = s.result
                    print(
                        f"c={conc} round={rnd} {t.name}: {r['rps']:.0f} req/s "
                        f"ttft p50 {r['ttft_p50_ms']:.1f} ms errors {r['errors']} "
                        f"open {r['inflight_avg']:.0f}/{r['inflight_max']} "
                        f"connect p99 {r['connect_p99_ms']:.0f} ms "
                        f"{r['error_kinds'] or ''} cpu {s.cpu_ms_per_req:.2f} ms/req",
                        file=sys.stderr,
                        flush=True,
                    )
        print(f"\ncommand: {' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}")
        print(f"logs: {tmp}\n")
        print(_report(table, args))
        if args.json:
            raw = {
                c: {n: [s.__dict__ for s in st.samples] for n, st in bt.items()}
                for c, bt in table.items()
            }
            Path(args.json).write_bytes(orjson.dumps(raw, option=orjson.OPT_NON_STR_KEYS))
    finally:
        for e in engines:
            _stop(e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
