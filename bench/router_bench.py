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
import socket
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
    cpu_us_per_token: float = float("nan")  # the same CPU over the streamed SSE events
    kb_per_stream: float = float("nan")  # (peak - idle RSS) / peak open streams
    rss_series: list[tuple[float, float]] = field(default_factory=list)  # (s, MB), --soak


@dataclass
class Stats:
    """One target's samples in one cell, by round (a failed run leaves its round out)."""

    by_round: dict[int, Sample] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return list(self.by_round.values())

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


def _port_free(port: int) -> None:
    """A target's port must be free before it starts: else its readiness check would be
    answered by whatever holds the port (another run's router) and that would be measured."""
    with socket.socket() as sock:
        if sock.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is taken: --port-base elsewhere")


def _wait_serving(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until one streamed completion through the target is answered 200: a gateway that
    finds its workers after it reports ready (smg's discovery) is not measured half-up."""
    body = orjson.dumps({"model": "fake", "prompt": "x", "max_tokens": 2, "stream": True})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process on port {port} exited with {proc.returncode}")
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            body,
            {"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200 and b"[DONE]" in r.read():
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"port {port} did not answer a completion in {timeout}s")


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


# The fake engines' stream shapes (--engine-vllm): 0.32's, and 0.33+'s (--chunk-params).
ENGINE_SHAPES = ("0.32", "0.34")


def _cpu_one(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
    except OSError:
        return float("nan")


class RssSampler(threading.Thread):
    """Peak RSS of one process, sampled every 100 ms; every ``every`` seconds also kept in
    :attr:`series` (the soak's RSS over time)."""

    def __init__(self, pid: int, every: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self._stop_evt = pid, 0.0, threading.Event()
        self.every, self.series = every, list[tuple[float, float]]()

    def run(self) -> None:
        t0 = last = time.monotonic()
        while not self._stop_evt.wait(0.1):
            rss = _rss_mb(self.pid)
            if rss == rss:
                self.peak = max(self.peak, rss)
                now = time.monotonic()
                if self.every and now - last >= self.every:
                    self.series.append((round(now - t0, 1), round(rss, 1)))
                    last = now

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
    migration: bool = True,
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
        "admission: {queue_size: 16384}\n"
        + ("" if migration else "migration: {max_attempts: 0}\n")
        + tracing
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
    router's HTTP/1.1 client: ``bench/httpx_router.py``), ``+nomig`` (mid-stream migration
    off, as the peers have none: D's stream relayed as read, not event by event), ``+lora``
    (LoRA routing on, every request naming the adapter both fake engines list:
    :data:`ADAPTER`) or ``+dp`` (P and D declared data-parallel, size 2:
    :func:`_router_config`) is not part of the mode."""
    for suffix in ("+lora", "+dp", "+traced", "+logged", "+httpx", "+nomig"):
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
                _router_config(
                    mode,
                    port,
                    p_url,
                    d_url,
                    args.log_level,
                    otlp,
                    logged,
                    lora,
                    dp,
                    migration="+nomig" not in name,
                )
            )
            argv = [sys.executable, "-m", "router", "serve", "--config", str(cfg)]
            if spec.endswith("+httpx"):
                argv = [sys.executable, str(HERE / "httpx_router.py"), "--config", str(cfg)]
            if workers > 1:
                argv += ["--workers", str(workers)]
            out.append(Target(name, argv, port, "/ready", cwd))
            port += 1
        elif name == "vllm-router":
            # Its push is Mooncake's (a bootstrap server per P), not NIXL's: pull only here.
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
        elif name == "smg":
            target = _smg_target(args, tmp, port, p_url, d_url)
            if target is not None:
                out.append(target)
                port += 1
    return out


def _smg_target(
    args: argparse.Namespace, tmp: Path, port: int, p_url: str, d_url: str
) -> Target | None:
    """SGLang's gateway in vLLM's pull flow: it has no vLLM switch; it takes a worker for vLLM
    from ``owned_by: vllm`` in ``/v1/models`` and the flow from each worker's KV connector,
    which only a discovery file (or its worker API) names. With plain ``--prefill/--decode``
    its flow would be "passthrough" (no ``kv_transfer_params`` to P)."""
    binary = args.smg_bin or shutil.which("smg")
    if not binary:
        print("smg not found: skipped (--smg-bin)", file=sys.stderr)
        return None
    workers = tmp / "smg-workers.json"
    pair = [("prefill-0", p_url, "prefill"), ("decode-0", d_url, "decode")]
    doc = {
        "version": 1,
        "workers": [
            {"id": i, "url": u, "worker_type": t, "kv_connector": "NixlConnector"}
            for i, u, t in pair
        ],
    }
    workers.write_bytes(orjson.dumps(doc))
    level = {"warning": "warn", "critical": "error"}.get(args.log_level, args.log_level)
    argv = [binary, "launch", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--pd-disaggregation", "--discovery-provider", "file"]
    argv += ["--discovery-file", str(workers), "--policy", "round_robin"]
    argv += ["--prometheus-port", str(port + 500), "--log-level", level]
    return Target("smg", argv, port, "/readiness")


@dataclass(frozen=True)
class Cell:
    """One point of the matrix: closed loop at ``conc`` streams, or open loop at ``rate``
    requests per second (``rate`` > 0); ``soak``: one long closed-loop run, RSS over time."""

    conc: int
    prompt: int  # prompt bytes (characters)
    tokens: int  # answer tokens (max_tokens)
    rate: float = 0.0
    soak: bool = False

    @property
    def label(self) -> str:
        load = f"q{self.rate:g}" if self.rate else f"c{self.conc}"
        return f"{load}-p{self.prompt}-t{self.tokens}" + ("-soak" if self.soak else "")


def _profiler(
    args: argparse.Namespace, target: Target, cell: Cell, proc: subprocess.Popen[bytes] | None
) -> subprocess.Popen[bytes] | None:
    """py-spy on the router for the length of the load (``--profile DIR``): raw stacks, one
    file per target, cell and round, for ``bench/profile_diff.py``."""
    python = target.argv is not None and target.argv[0] == sys.executable
    if args.profile is None or proc is None or not python:  # py-spy reads Python only
        return None
    spy = py_spy()
    if spy is None:
        raise RuntimeError("--profile needs py-spy (pip install py-spy)")
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    n = len(list(out.glob(f"{target.name}-{cell.label}-*.txt")))
    path = out / f"{target.name}-{cell.label}-{n}.txt"
    argv = [spy, "record", "--pid", str(proc.pid), "--rate", str(args.profile_rate)]
    argv += ["--nonblocking", "--subprocesses", "--format", "raw", "--output", str(path)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _cprofiled(args: argparse.Namespace, target: Target, cell: Cell) -> list[str] | None:
    """The target's command under ``bench/cprofile_run.py`` (``--cprofile DIR``): one pstats
    file per target, cell and round, for ``bench/call_diff.py``."""
    if args.cprofile is None or target.argv is None or target.argv[0] != sys.executable:
        return target.argv
    out = Path(args.cprofile).resolve()
    out.mkdir(parents=True, exist_ok=True)
    n = len(list(out.glob(f"{target.name}-{cell.label}-*.prof")))
    path = out / f"{target.name}-{cell.label}-{n}.prof"
    return [sys.executable, str(HERE / "cprofile_run.py"), str(path), *target.argv[1:]]


def _loadgen_argv(
    args: argparse.Namespace, target: Target, cell: Cell, duration: float
) -> list[str]:
    lg = [sys.executable, str(HERE / "loadgen.py"), "--port", str(target.port)]
    lg += ["--concurrency", str(cell.conc), "--duration", str(duration)]
    lg += ["--warmup", str(args.warmup), "--max-tokens", str(cell.tokens)]
    lg += ["--prompt-chars", str(cell.prompt)]
    if cell.rate:
        lg += ["--rate", str(cell.rate)]
    if "+lora" in target.name:
        lg += ["--model", ADAPTER]
    if args.client_cpus:
        lg = ["taskset", "-c", args.client_cpus, *lg]
    return lg


def _duration(args: argparse.Namespace, cell: Cell) -> float:
    if cell.soak:
        return 60.0 * args.soak_minutes
    return args.duration_2000 if cell.conc >= 1000 and not cell.rate else args.duration


def _measure(args: argparse.Namespace, target: Target, cell: Cell, logdir: Path) -> Sample:
    proc = None
    argv = _cprofiled(args, target, cell)
    if argv is not None:
        _port_free(target.port)
        proc = _spawn(argv, args.router_cpus, logdir / f"{target.name}.log", target.cwd)
        try:
            _wait_http(target.port, target.ready_path, proc, 60)
            _wait_serving(target.port, proc, 60)
        except BaseException:
            _stop(proc)  # never left running: the next arm would measure it
            raise
        if argv is not target.argv:
            proc.send_signal(signal.SIGUSR1)  # start-up left out of the profile
        time.sleep(0.3)
    sampler = RssSampler(proc.pid, args.soak_sample if cell.soak else 0.0) if proc else None
    idle = _rss_mb(proc.pid) if proc else float("nan")
    cpu0 = _cpu_s(proc.pid) if proc else float("nan")
    if sampler:
        sampler.start()
    duration = _duration(args, cell)
    lg = _loadgen_argv(args, target, cell, duration)
    spy = None
    try:
        spy = _profiler(args, target, cell, proc)
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
    result = {k: NAN if v is None else v for k, v in result.items()}  # JSON has no NaN
    # The CPU counts the warm-up too: scale the window's requests and tokens to the whole run.
    scale = (duration + args.warmup) / duration
    total_reqs, total_tokens = result["requests"] * scale, result["chunks"] * scale
    cpu_ms = 1e3 * (cpu1 - cpu0) / total_reqs if total_reqs else float("nan")
    cpu_us_tok = 1e6 * (cpu1 - cpu0) / total_tokens if total_tokens else float("nan")
    streams = result["inflight_max"]
    per_stream = (peak - idle) * 1024 / streams if streams else float("nan")
    series = sampler.series if sampler else []
    return Sample(result, idle, peak, cpu_ms, total_reqs, cpu_us_tok, per_stream, series)


# -- report ------------------------------------------------------------------

PEERS = ("vllm-router", "smg")
NAN = float("nan")


def _fmt(v: float, digits: int = 1) -> str:
    return "-" if v != v else f"{v:.{digits}f}"


def _ratio(a: float, b: float) -> str:
    return "-" if not b or a != a or b != b else f"{a / b:.2f}x"


def _spread(vals: list[float], digits: int = 1, unit: str = "") -> str:
    """Median [min-max] over rounds."""
    vals = [v for v in vals if v == v]
    if not vals:
        return "-"
    med = statistics.median(vals)
    if len(vals) == 1:
        return f"{med:.{digits}f}{unit}"
    return f"{med:.{digits}f}{unit} [{min(vals):.{digits}f}-{max(vals):.{digits}f}]"


def _per_round(a: Stats, b: Stats | None, fa: Any, fb: Any = None, op: str = "-") -> list[float]:
    """``fa(a's sample)`` minus (or over) ``fb(b's sample)`` within each round both ran."""
    fb = fb or fa
    if b is None:
        return [fa(s) for s in a.samples] if op == "-" else []
    out = []
    for rnd, s in a.by_round.items():
        t = b.by_round.get(rnd)
        if t is None:
            continue
        x, y = fa(s), fb(t)
        out.append(x - y if op == "-" else (x / y if y else NAN))
    return out


def _res(key: str) -> Any:
    return lambda s: s.result[key]


def _report(table: dict[Cell, dict[str, Stats]], args: argparse.Namespace) -> str:
    """Throughput table: medians over rounds, ratios of medians."""
    lines = []
    head = (
        "| cell | target | req/s | events/s | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 | errors "
        "| open streams avg/max | RSS idle→peak MB | KB/stream | CPU ms/req | client CPU% "
        "| req/s vs vllm-router "
        "| req/s vs direct | added TTFT p50 (ms) vs vllm-router's |"
    )
    lines += [head, "|" + "---|" * 17]
    for cell, by_target in table.items():
        if cell.rate or cell.soak:
            continue
        direct = by_target.get("direct")
        vr = by_target.get("vllm-router")
        d_ttft = direct.med("ttft_p50_ms") if direct and direct.samples else NAN
        vr_added = vr.med("ttft_p50_ms") - d_ttft if vr and vr.samples else NAN
        for name, st in by_target.items():
            if not st.samples:
                continue
            rps, idle, peak = st.med("rps"), st.med_attr("rss_idle_mb"), st.med_attr("rss_peak_mb")
            added = st.med("ttft_p50_ms") - d_ttft if name != "direct" else NAN
            lines.append(
                f"| {cell.label} | {name} | {_fmt(rps)} | {_fmt(st.med('chunks_per_s'), 0)} "
                f"| {_fmt(st.med('ttft_p50_ms'))} | {_fmt(st.med('ttft_p99_ms'))} "
                f"| {_fmt(st.med('e2e_p50_ms'))} | {_fmt(st.med('e2e_p99_ms'))} | {st.errors()} "
                f"| {_fmt(st.med('inflight_avg'), 0)}/{_fmt(st.med('inflight_max'), 0)} "
                f"| {_fmt(idle, 0)}→{_fmt(peak, 0)} | {_fmt(st.med_attr('kb_per_stream'))} "
                f"| {_fmt(st.med_attr('cpu_ms_per_req'), 2)} | {_fmt(st.med('client_cpu_pct'), 0)} "
                f"| {_ratio(rps, vr.med('rps')) if vr and vr.samples else '-'} "
                f"| {_ratio(rps, direct.med('rps')) if direct and direct.samples else '-'} "
                f"| {_fmt(added)} vs {_fmt(vr_added)} |"
            )
    return "\n".join(lines)


def _cost_report(table: dict[Cell, dict[str, Stats]]) -> str:
    """Added latency (minus direct, within each round) and the router's cost, each as the
    median [min-max] over rounds; CPU ratios to each peer taken within each round."""
    head = (
        "| cell | target | added TTFT p50 ms | added TTFT p99 ms | added e2e p50 ms "
        "| added e2e p99 ms | CPU ms/req | CPU us/token | KB/stream | errors "
        "| CPU/req vs vllm-router | CPU/req vs smg | CPU/req vs its @base |"
    )
    lines = [head, "|" + "---|" * 13]
    cpu = lambda s: s.cpu_ms_per_req  # noqa: E731
    for cell, by_target in table.items():
        if cell.rate or cell.soak:
            continue
        direct = by_target.get("direct")
        for name, st in by_target.items():
            if name == "direct" or not st.samples:
                continue
            added = [
                _spread(_per_round(st, direct, _res(k))) if direct else "-"
                for k in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms")
            ]
            vs = [
                _spread(_per_round(st, by_target.get(peer), cpu, op="/"), 2, "x")
                if peer in by_target and peer != name
                else "-"
                for peer in (*PEERS, f"{name}@base")
            ]
            lines.append(
                f"| {cell.label} | {name} | {' | '.join(added)} "
                f"| {_spread([s.cpu_ms_per_req for s in st.samples], 3)} "
                f"| {_spread([s.cpu_us_per_token for s in st.samples], 1)} "
                f"| {_spread([s.kb_per_stream for s in st.samples], 1)} | {st.errors()} "
                f"| {' | '.join(vs)} |"
            )
    return "\n".join(lines)


def _ceiling_report(table: dict[Cell, dict[str, Stats]], limit_ms: float) -> str:
    """Open loop: added TTFT and e2e p95 at each offered rate; a target's ceiling is the
    highest rate below the first one whose median added TTFT p95 passes ``limit_ms``."""
    cells = [c for c in table if c.rate]
    if not cells:
        return ""
    head = "| rate/s | target | req/s done | added TTFT p95 ms | added e2e p95 ms | errors |"
    lines = [head, "|" + "---|" * 6]
    ceiling: dict[str, float] = {}
    passed: set[str] = set()
    for cell in sorted(cells, key=lambda c: c.rate):
        direct = table[cell].get("direct")
        for name, st in table[cell].items():
            if name == "direct" or not st.samples:
                continue
            ttft = _per_round(st, direct, _res("ttft_p95_ms"))
            e2e = _per_round(st, direct, _res("e2e_p95_ms"))
            lines.append(
                f"| {cell.rate:g} | {name} | {_fmt(st.med('rps'))} | {_spread(ttft)} "
                f"| {_spread(e2e)} | {st.errors()} |"
            )
            med = statistics.median(ttft) if ttft else NAN
            if name in passed:
                continue
            if med == med and med <= limit_ms and st.errors() == 0:
                ceiling[name] = cell.rate
            else:
                passed.add(name)
    lines.append("")
    for name in sorted({n for c in cells for n in table[c] if n != "direct"}):
        top = ceiling.get(name)
        state = "" if name in passed else " (never passed: raise the top rate)"
        lines.append(
            f"* ceiling ({name}): {'-' if top is None else f'{top:g}'} req/s with added "
            f"TTFT p95 <= {limit_ms:g} ms{state}"
        )
    return "\n".join(lines)


def _soak_report(table: dict[Cell, dict[str, Stats]], tolerance: float) -> str:
    """Soak: requests, errors and RSS over time; flat when the last third's median RSS is
    within ``tolerance`` of the middle third's."""
    lines = []
    for cell, by_target in table.items():
        if not cell.soak:
            continue
        lines += [
            f"soak {cell.label}:",
            "| target | requests | errors | open streams avg/max | RSS first→middle→last MB "
            "| CPU ms/req | flat |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, st in by_target.items():
            for s in st.samples:
                rss = [mb for _, mb in s.rss_series]
                third = max(1, len(rss) // 3)
                mid = statistics.median(rss[third : 2 * third]) if len(rss) >= 3 else NAN
                last = statistics.median(rss[2 * third :]) if len(rss) >= 3 else NAN
                flat = (
                    "-" if mid != mid else ("yes" if abs(last - mid) <= tolerance * mid else "NO")
                )
                first = rss[0] if rss else NAN
                r = s.result
                lines.append(
                    f"| {name} | {r['requests']} | {r['errors']} {r['error_kinds'] or ''} "
                    f"| {_fmt(r['inflight_avg'], 0)}/{r['inflight_max']} "
                    f"| {_fmt(first)}→{_fmt(mid)}→{_fmt(last)} "
                    f"| {_fmt(s.cpu_ms_per_req, 3)} | {flat} |"
                )
    return "\n".join(lines)


# -- main --------------------------------------------------------------------


def _start_engines(args: argparse.Namespace, logdir: Path) -> list[subprocess.Popen[bytes]]:
    # Engines answer max(--answers) tokens, fewer when a request's max_tokens asks for fewer.
    common = [
        "--tokens",
        str(max(2, *args.answers)),
        "--itl-ms",
        str(args.itl_ms),
        "--prefill-us-per-token",
        str(args.prefill_us_per_token),
        "--kv-transfer-ms",
        str(args.kv_transfer_ms),
        "--adapters",
        ADAPTER,
        # As vLLM 0.32 does: id fields null, each event its ids where return_token_ids is
        # asked (a migrating router asks; without them it could never continue an answer).
        "--token-ids",
        *(["--chunk-params"] if args.engine_vllm != ENGINE_SHAPES[0] else []),
    ]
    procs = []
    for i, role in ((1, "prefill"), (2, "decode")):
        argv = [sys.executable, str(HERE / "fake_engine.py"), "--port", str(args.port_base + i)]
        procs.append(_spawn(argv + common, args.engine_cpus, logdir / f"{role}.log"))
    for i, proc in zip((1, 2), procs, strict=True):
        _wait_http(args.port_base + i, "/health", proc, 30)
    return procs


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x and x != "none"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", default="32,256,2000", help="closed loop; 'none': skip it")
    p.add_argument("--targets", default="direct,vllm-router,pull,push,aggregated")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    p.add_argument("--duration-2000", type=float, default=8.0, help="... at concurrency >= 1000")
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--tokens", type=int, default=16, help="answer tokens (without --answers)")
    p.add_argument("--answers", help="matrix: answer token counts, e.g. 1,64 (default --tokens)")
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument(
        "--engine-vllm",
        choices=ENGINE_SHAPES,
        default=ENGINE_SHAPES[0],
        help="the fake engines' stream shape: 0.34 (0.33 on) ends every chunk with its "
        "kv_transfer_params, null on a token's",
    )
    p.add_argument("--prefill-us-per-token", type=float, default=20.0)
    p.add_argument("--kv-transfer-ms", type=float, default=1.0)
    p.add_argument("--prompt-chars", type=int, default=512, help="prompt bytes (no --prompts)")
    p.add_argument("--prompts", help="matrix: prompt bytes, e.g. 200,2048,16384")
    p.add_argument(
        "--ceiling",
        help="open loop at these request rates, ascending (e.g. 100,200,400): the rate where "
        "p95 added TTFT passes --ceiling-ms; first --prompts and --answers",
    )
    p.add_argument("--ceiling-ms", type=float, default=10.0)
    p.add_argument("--soak-minutes", type=float, default=0.0, help="a soak run per target")
    p.add_argument("--soak-streams", type=int, default=2000)
    p.add_argument("--soak-sample", type=float, default=10.0, help="RSS every N seconds")
    p.add_argument("--soak-rss-tolerance", type=float, default=0.05)
    p.add_argument("--port-base", type=int, default=10200)
    p.add_argument("--router-cpus", help="taskset list for every router, e.g. 1 or 0,1")
    p.add_argument("--engine-cpus", help="taskset list for the fake engines")
    p.add_argument("--client-cpus", help="taskset list for the load generator")
    p.add_argument(
        "--pin",
        action="store_true",
        help="the peers' way: --router-cpus 1 --engine-cpus 0 --client-cpus 0",
    )
    p.add_argument("--vllm-router-bin", help="vllm-router executable (default: PATH)")
    p.add_argument("--smg-bin", help="SGLang's gateway executable, target 'smg' (default: PATH)")
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
    args.concurrency = _ints(args.concurrency)
    args.targets = args.targets.split(",")
    args.prompts = _ints(args.prompts) if args.prompts else [args.prompt_chars]
    args.answers = _ints(args.answers) if args.answers else [args.tokens]
    args.ceiling = [float(r) for r in args.ceiling.split(",")] if args.ceiling else []
    if args.pin:
        args.router_cpus = args.router_cpus or "1"
        args.engine_cpus = args.engine_cpus or "0"
        args.client_cpus = args.client_cpus or "0"
    return args


def _cells(args: argparse.Namespace) -> list[Cell]:
    cells = [Cell(c, p, t) for c in args.concurrency for p in args.prompts for t in args.answers]
    return cells + [Cell(0, args.prompts[0], args.answers[0], rate) for rate in args.ceiling]


def _log_line(target: str, cell: Cell, rnd: int, s: Sample) -> str:
    r = s.result
    return (
        f"{cell.label} round={rnd} {target}: {_fmt(r['rps'], 0)} req/s "
        f"ttft p50 {_fmt(r['ttft_p50_ms'])} p95 {_fmt(r['ttft_p95_ms'])} ms "
        f"errors {r['errors']} open {_fmt(r['inflight_avg'], 0)}/{r['inflight_max']} "
        f"connect p99 {_fmt(r['connect_p99_ms'], 0)} ms "
        f"{r['error_kinds'] or ''} cpu {_fmt(s.cpu_ms_per_req, 3)} ms/req"
    )


def _run_one(
    args: argparse.Namespace, t: Target, cell: Cell, rnd: int, tmp: Path, stats: Stats
) -> None:
    try:
        s = _measure(args, t, cell, tmp)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:  # one arm lost, not the run
        print(f"{cell.label} round={rnd} {t.name}: FAILED {exc}", file=sys.stderr, flush=True)
        return
    stats.by_round[rnd] = s
    print(_log_line(t.name, cell, rnd, s), file=sys.stderr, flush=True)


def _raw(table: dict[Cell, dict[str, Stats]]) -> dict[str, Any]:
    return {
        c.label: {n: {r: s.__dict__ for r, s in st.by_round.items()} for n, st in bt.items()}
        for c, bt in table.items()
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    engines = _start_engines(args, tmp)
    try:
        p_url, d_url = (f"http://127.0.0.1:{args.port_base + i}" for i in (1, 2))
        targets = _targets(args, tmp, p_url, d_url)
        cells = _cells(args)
        table: dict[Cell, dict[str, Stats]] = {c: {t.name: Stats() for t in targets} for c in cells}
        for rnd in range(args.rounds):
            # Arms interleaved, and the order rotated each round: no target is always first.
            order = targets[rnd % len(targets) :] + targets[: rnd % len(targets)]
            for cell in cells:
                for t in order:
                    _run_one(args, t, cell, rnd, tmp, table[cell][t.name])
        if args.soak_minutes:
            soak = Cell(args.soak_streams, args.prompts[0], args.answers[0], soak=True)
            # direct too when listed: the control (the fake engines and the client alone).
            table[soak] = {t.name: Stats() for t in targets}
            for t in targets:
                _run_one(args, t, soak, 0, tmp, table[soak][t.name])
        pace = (
            f"fake engines: {args.itl_ms:g} ms between tokens, prefill "
            f"{args.prefill_us_per_token:g} us a prompt token (4 bytes), KV transfer "
            f"{args.kv_transfer_ms:g} ms; pinning: router {args.router_cpus or '-'}, engines "
            f"{args.engine_cpus or '-'}, client {args.client_cpus or '-'}"
        )
        print(f"\ncommand: {' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}")
        print(f"{pace}\nlogs: {tmp}\n")
        print(_report(table, args))
        print("\nAdded latency (minus direct in the same round) and cost, median [min-max]:\n")
        print(_cost_report(table))
        if args.ceiling:
            print(f"\nOpen loop, p{args.prompts[0]}-t{args.answers[0]}:\n")
            print(_ceiling_report(table, args.ceiling_ms))
        if args.soak_minutes:
            print()
            print(_soak_report(table, args.soak_rss_tolerance))
        if args.json:
            Path(args.json).write_bytes(orjson.dumps(_raw(table), option=orjson.OPT_NON_STR_KEYS))
    finally:
        for e in engines:
            _stop(e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
