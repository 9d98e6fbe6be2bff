"""Chaos soak: steady client traffic through the router while fake engines are killed and
restarted, or frozen and thawed, at random moments. Not a test: it prints figures.

    .venv/bin/python bench/chaos.py --minutes 3 --rate 5 --seed 1
    .venv/bin/python bench/chaos.py --mode push --faults stop --down 2-8 --interval 15-30

What it measures: how much traffic the router's *defaults* (health checks, breakers,
retries, timeouts: none shortened here) lose around an engine fault, and how long after
the engine is back the router serves every request again.

Processes: the router (``pd-router serve`` from a YAML config written to a temporary
file), fake engines (``python -m tests.fakes.run_fake``, ``tests/fakes/fake_vllm.py``) and
this process, which sends ``--rate`` streaming completions per second, open loop (each
request is a task of its own, so slow or hung requests never hold up the next ones), each
bounded by ``--client-timeout`` seconds in all.

In both modes (``--mode pull``, the default, and ``--mode push``) P and D are fake engines
in processes of their own, so each can be faulted alone. In push mode the D's behaviour
names the P's URL (``kv_peer``): a push D leg waits for "the KV" by polling
``GET /kv/<request id>`` on the P process until the P leg with the same ``X-Request-Id``
has run there, so a dead or frozen P leaves it waiting, as a real push D waits for a WRITE
that never comes.

Faults (``--faults``), one at a time, ``--interval`` seconds apart (from the previous
engine being back, or from the start of traffic), on a role picked from ``--roles``:

* ``kill``: SIGKILL, then after ``--down`` seconds a new process on the same ports;
* ``stop``: SIGSTOP, then after ``--down`` seconds SIGCONT.

A fault's window runs from the signal until the engine is back: the new process answers
``/health`` with 200 (kill), or SIGCONT is sent (stop). No fault starts unless its engine
will be back ``--tail`` seconds before traffic ends, so the last one's recovery is seen.

Every request is recorded (``--records FILE`` writes them out, one JSON line each): start,
end, HTTP status, outcome (or the exception), the numbers of the fault windows it
overlapped. "ok" means HTTP 200 with a complete stream (``[DONE]``, no SSE error event); a
200 whose stream broke or carried an error event is a failure of its own kind. Reported at
the end:

* availability: % ok among requests started outside every fault window and outside every
  recovery period; and % ok among all requests started outside fault windows (recovery
  periods counted). Requests that were in flight when a fault began count in both: a
  stream cut by a killed D cannot be saved by any router, so they are also shown apart;
* per fault: recovery time = start of the first request from which on every request
  started before the next fault (or the end) is ok, minus the moment the engine was back
  (0 when none failed); requests still in flight at the next fault's signal are left
  out (that fault may be what failed them); a fault after which the last request still
  failed, or none finished, is "not recovered"; recovery p50 and max;
* every failure kind, with counts by where it started (fault window, recovery, elsewhere)
  and its first error body;
* invariants, a PASS/FAIL line each; the exit status is 1 if any fails: every request clear
  of all faults (started outside windows and recovery periods, not in flight at a signal)
  is ok, since the fakes inject no faults of their own; every fault recovered; the router
  is still running; and, after traffic stops, every engine is back and up to ``--settle``
  seconds have passed, the router's decode slots in use (``pdrouter_decode_slots_in_use``
  summed) and the fake engines' open requests (``vllm:num_requests_running``, which counts
  the requests they are serving) are both 0.

``--router-yaml-extra JSON`` is merged into the router's config (mappings key by key, lists
of mappings element by element), e.g. ``'{"health": {"interval": 1}}'`` or
``'{"models": [{"decode": [{"slots": 16}]}]}'``. ``--router-root DIR`` runs the router
package from another checkout (a before/after comparison, or a run that edits in progress
in this one cannot disturb).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.soak import _metric_sum  # noqa: E402
from tests.fakes.router_proc import free_port  # noqa: E402

MODEL = "tiny"
OK = "ok"


@dataclasses.dataclass
class Request:
    start: float  # seconds since traffic began
    end: float | None = None
    status: int | None = None  # HTTP status, None if no response head came
    outcome: str = "unfinished"
    body: str = ""  # when not ok: what tells the failure apart (see _excerpt)
    faults: list[int] = dataclasses.field(default_factory=list)  # numbers of windows overlapped


@dataclasses.dataclass
class Fault:
    kind: str  # kill | stop
    role: str  # prefill | decode
    signal_at: float
    back_at: float | None = None
    restart_s: float | None = None  # kill: from starting the new process to /health 200


class Engine:
    """One fake-engine process serving one role on ``ports``."""

    def __init__(self, role: str, ports: list[int], behaviour: dict[str, Any]) -> None:
        self.role = role
        self.ports = ports
        self.urls = [f"http://127.0.0.1:{p}" for p in ports]
        self.behaviour = behaviour
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.fakes.run_fake",
                ",".join(map(str, self.ports)),
                json.dumps(self.behaviour),
            ],
            cwd=ROOT,
            # Its own session: a Ctrl-C in the terminal reaches only this driver, which
            # then cleans up; otherwise the engines would die first and look like a fault.
            start_new_session=True,
        )

    async def wait_ready(self, client: httpx.AsyncClient, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for url in self.urls:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(url + "/health", timeout=2)).status_code == 200:
                        break
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"fake {self.role} exited with {self.proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fake {self.role} not ready after {timeout:.0f} s")
                await asyncio.sleep(0.05)

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        # SIGKILL also ends a SIGSTOPped process (SIGTERM would wait for a SIGCONT).
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _range(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition("-")
    a, b = float(lo), float(hi or lo)
    if a < 0 or b < a:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH seconds, got {text!r}")
    return a, b


def _choices(allowed: set[str]) -> Any:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items or set(items) - allowed:
            raise argparse.ArgumentTypeError(f"expected a comma list of {sorted(allowed)}")
        return items

    return parse


def _merge(base: Any, extra: Any) -> Any:
    """``extra`` over ``base``: mappings key by key, lists of mappings element by element
    (so one model's decode slots can be changed without restating the whole model)."""
    if isinstance(base, dict) and isinstance(extra, dict):
        return {**base, **{k: _merge(base[k], v) if k in base else v for k, v in extra.items()}}
    if (
        isinstance(base, list)
        and isinstance(extra, list)
        and all(isinstance(x, dict) for x in extra)
    ):
        merged = [_merge(b, e) for b, e in zip(base, extra, strict=False)]
        return merged + base[len(extra) :] + extra[len(base) :]
    return extra


def _router_config(args: argparse.Namespace, p_url: str, d_url: str, port: int) -> dict[str, Any]:
    prefill: dict[str, Any] = {"url": p_url}
    if args.mode == "push":
        prefill |= {"engine_id": "chaos-p", "kv_host": "127.0.0.1", "kv_port": 5600}
    # Only what the router cannot default. Health, breaker, retry, timeout and admission
    # settings are the product's defaults on purpose: they are what this measures.
    cfg: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "log_level": "warning",
        "models": [
            {"name": MODEL, "mode": args.mode, "prefill": [prefill], "decode": [{"url": d_url}]}
        ],
    }
    merged: dict[str, Any] = _merge(cfg, args.router_yaml_extra)
    return merged


def _outcome(status: int, text: str) -> str:
    if status != 200:
        return f"HTTP {status}"
    if '"error"' in text:
        return "200 + SSE error event"
    return OK if "[DONE]" in text else "200 truncated"


def _excerpt(text: str) -> str:
    """What tells a failure apart: an error body's start, a stream's error event or its end."""
    events = [e for e in text.split("\n\n") if e.strip()]
    if text.startswith("data:") and events:
        errors = [e for e in events if '"error"' in e]
        return (errors[0] if errors else "... " + events[-1])[:300]
    return text[:300]


class Run:
    """The shared clock and everything recorded during one run."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        self.down: set[str] = set()  # roles faulted right now (progress lines)

    def now(self) -> float:
        return time.monotonic() - self.t0


async def _one_request(
    client: httpx.AsyncClient, url: str, run: Run, args: argparse.Namespace
) -> None:
    rec = Request(start=run.now())
    run.requests.append(rec)
    body = {"model": MODEL, "prompt": "chaos " * 20, "max_tokens": args.tokens, "stream": True}
    data = b""
    try:
        async with (
            # httpx's timeouts are per read; this bounds the whole request.
            asyncio.timeout(args.client_timeout),
            client.stream("POST", url + "/v1/completions", json=body) as r,
        ):
            rec.status = r.status_code
            async for chunk in r.aiter_bytes():
                data += chunk
        text = data.decode("utf-8", "replace")
        rec.outcome = _outcome(r.status_code, text)
        if rec.outcome != OK:
            rec.body = _excerpt(text)
    except TimeoutError:
        head = f"{rec.status} then " if rec.status is not None else ""
        rec.outcome = f"{head}client timeout ({args.client_timeout:g} s)"
        rec.body = _excerpt(data.decode("utf-8", "replace"))
    except httpx.HTTPError as exc:
        head = f"{rec.status} then " if rec.status is not None else ""
        rec.outcome = f"{head}{type(exc).__name__}"
        rec.body = repr(exc)[:300]
    finally:
        rec.end = run.now()


async def _traffic(
    client: httpx.AsyncClient, url: str, run: Run, args: argparse.Namespace, stop: float
) -> None:
    """Open loop: request i is sent at i / rate whatever the earlier ones are doing."""
    tasks: set[asyncio.Task[None]] = set()
    i = 0
    while (due := i / args.rate) < stop:
        await asyncio.sleep(max(0.0, due - run.now()))
        task = asyncio.create_task(_one_request(client, url, run, args))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
    if tasks:  # each is bounded by --client-timeout
        await asyncio.wait(set(tasks))


async def _inject(
    client: httpx.AsyncClient,
    engines: dict[str, Engine],
    run: Run,
    args: argparse.Namespace,
    rng: random.Random,
    stop: float,
) -> None:
    while True:
        gap, down = rng.uniform(*args.interval), rng.uniform(*args.down)
        if run.now() + gap + down + args.tail > stop:
            return
        await asyncio.sleep(gap)
        kind, role = rng.choice(args.faults), rng.choice(args.roles)
        eng = engines[role]
        fault = Fault(kind, role, signal_at=run.now())
        run.faults.append(fault)
        run.down.add(f"{role} {'killed' if kind == 'kill' else 'stopped'}")
        if kind == "kill":
            eng.signal(signal.SIGKILL)
            assert eng.proc is not None
            await asyncio.to_thread(eng.proc.wait)
            await asyncio.sleep(max(0.0, fault.signal_at + down - run.now()))
            restart = run.now()
            eng.start()
            await eng.wait_ready(client)
            fault.back_at = run.now()
            fault.restart_s = fault.back_at - restart
        else:
            eng.signal(signal.SIGSTOP)
            await asyncio.sleep(down)
            eng.signal(signal.SIGCONT)
            fault.back_at = run.now()
        run.down.clear()
        print(
            f"  fault {len(run.faults)}: {kind} {role} at {fault.signal_at:.1f} s, "
            f"back at {fault.back_at:.1f} s",
            flush=True,
        )


async def _progress(run: Run, args: argparse.Namespace, stop: float) -> None:
    last = 0.0
    while run.now() < stop:
        await asyncio.sleep(args.progress)
        now = run.now()
        done = [r for r in run.requests if r.end is not None and last < r.end <= now]
        last = now
        ok = sum(r.outcome == OK for r in done)
        open_now = sum(r.end is None for r in run.requests)
        state = ", ".join(sorted(run.down)) or "all engines up"
        print(
            f"  t={now:5.0f} s sent {len(run.requests):6d}, open {open_now:4d}, "
            f"finished since the last line: ok {ok}, failed {len(done) - ok} ({state})",
            flush=True,
        )


async def _settle(
    client: httpx.AsyncClient, router_url: str, engine_urls: list[str], settle: float
) -> tuple[float, float]:
    deadline = time.monotonic() + settle
    while True:
        slots = opened = float("nan")
        with contextlib.suppress(httpx.HTTPError):
            slots = await _metric_sum(client, router_url, "pdrouter_decode_slots_in_use{")
            counts = [
                await _metric_sum(client, u, "vllm:num_requests_running") for u in engine_urls
            ]
            opened = sum(counts)
        if (slots == 0 and opened == 0) or time.monotonic() > deadline:
            return slots, opened
        await asyncio.sleep(0.5)


def _start_engines(args: argparse.Namespace) -> dict[str, Engine]:
    behaviour: dict[str, Any] = {
        "tokens": args.tokens,
        "token_delay": args.token_delay,
        "transfer_mode": args.mode,
    }
    prefill = Engine("prefill", [free_port()], behaviour)
    d_behaviour = dict(behaviour)
    if args.mode == "push":
        # A push D in a process of its own polls its P for "the KV" (fake_vllm._poll_kv).
        d_behaviour["kv_peer"] = prefill.urls[0]
    return {"prefill": prefill, "decode": Engine("decode", [free_port()], d_behaviour)}


async def _wait_router(
    client: httpx.AsyncClient, url: str, proc: subprocess.Popen[bytes], log: IO[bytes]
) -> None:
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get(url + "/ready")).status_code == 200:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            log.flush()
            tail = Path(log.name).read_text(errors="replace")[-3000:]
            state = f"exited with {proc.returncode}" if proc.poll() is not None else "not ready"
            raise SystemExit(f"router {state} before it was ready; its stderr ends:\n{tail}")
        await asyncio.sleep(0.1)


async def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    engines = _start_engines(args)
    p_url, d_url = engines["prefill"].urls[0], engines["decode"].urls[0]
    r_port = free_port()
    cfg_file = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)  # noqa: SIM115
    with cfg_file:
        yaml.safe_dump(_router_config(args, p_url, d_url, r_port), cfg_file)
    router: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None  # the router's stderr, shown if it fails to start
    try:
        for eng in engines.values():
            eng.start()
        if args.router_log is not None:
            log = open(args.router_log, "wb")  # noqa: SIM115
        else:
            log = tempfile.NamedTemporaryFile(suffix=".log", delete=True)  # noqa: SIM115
        router = subprocess.Popen(
            [sys.executable, "-m", "router", "serve", "--config", cfg_file.name, "--grace", "2"],
            # ``-m router`` imports the package from the working directory first.
            cwd=args.router_root or ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{r_port}"
        # No pool limit: a pool wait would be time charged to the router.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=args.client_timeout, limits=limits) as client:
            for eng in engines.values():
                await eng.wait_ready(client)
            await _wait_router(client, url, router, log)
            stop = args.minutes * 60
            print(
                f"chaos: mode {args.mode}, {args.minutes:g} min at {args.rate:g} req/s, "
                f"faults {','.join(args.faults)} on {','.join(args.roles)}, "
                f"down {args.down[0]:g}-{args.down[1]:g} s, "
                f"interval {args.interval[0]:g}-{args.interval[1]:g} s, seed {args.seed}",
                flush=True,
            )
            state = Run()
            progress = asyncio.create_task(_progress(state, args, stop))
            await asyncio.gather(
                _traffic(client, url, state, args, stop),
                _inject(client, engines, state, args, rng, stop),
            )
            progress.cancel()
            engine_urls = [u for e in engines.values() for u in e.urls]
            slots, opened = await _settle(client, url, engine_urls, args.settle)
        alive = router.poll() is None
        return _report(state, stop, slots, opened, alive, args.records)
    finally:
        if router is not None and router.poll() is None:
            router.send_signal(signal.SIGTERM)
            try:
                router.wait(30)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait(10)
        for eng in engines.values():
            eng.close()
        if log is not None:
            log.close()
        os.unlink(cfg_file.name)


def _recoveries(run: Run, stop: float) -> list[tuple[float | None, float]]:
    """Per fault: (recovery seconds or None if not recovered, end of its recovery period)."""
    out: list[tuple[float | None, float]] = []
    for k, fault in enumerate(run.faults):
        assert fault.back_at is not None
        last = k + 1 == len(run.faults)
        nxt = stop if last else run.faults[k + 1].signal_at
        # A request still running at the next fault's signal may fail because of that
        # fault: it says nothing about this one's recovery. (If every request since the
        # engine was back is such, there is no evidence of recovery: not recovered.)
        after = sorted(
            (
                r
                for r in run.requests
                if fault.back_at <= r.start < nxt and (last or (r.end or stop) <= nxt)
            ),
            key=lambda r: r.start,
        )
        bad = [i for i, r in enumerate(after) if r.outcome != OK]
        if not after:
            out.append((None, nxt))
        elif not bad:
            out.append((0.0, fault.back_at))
        elif bad[-1] == len(after) - 1:
            out.append((None, nxt))
        else:
            first_good = after[bad[-1] + 1].start
            out.append((first_good - fault.back_at, first_good))
    return out


def _pct(ok: int, n: int) -> str:
    return f"{100 * ok / n:6.2f}% ({ok} of {n})" if n else "n/a (no such requests)"


# Where a request started, relative to the faults; the first that applies.
WINDOW, RECOVERY, CUT, CLEAR = "fault window", "recovery", "in flight at a signal", "clear"
PLACES = (WINDOW, RECOVERY, CUT, CLEAR)


def _report(
    run: Run,
    stop: float,
    slots: float,
    opened: float,
    router_alive: bool,
    records: Path | None,
) -> int:
    reqs = run.requests
    rec = _recoveries(run, stop)
    windows = [(f.signal_at, f.back_at or stop) for f in run.faults]
    for r in reqs:
        r.faults = [
            k for k, (s, b) in enumerate(windows, 1) if r.start <= b and (r.end or stop) >= s
        ]
    if records is not None:
        with records.open("w") as out:
            for r in reqs:
                out.write(json.dumps(dataclasses.asdict(r)) + "\n")
    periods = [(f.back_at or stop, end) for f, (_, end) in zip(run.faults, rec, strict=True)]

    def where(r: Request) -> str:
        if any(s <= r.start < b for s, b in windows):
            return WINDOW
        if any(b <= r.start < e for b, e in periods):
            return RECOVERY
        if any(r.start < s < (r.end or stop) for s, _ in windows):
            return CUT
        return CLEAR

    place = {id(r): where(r) for r in reqs}

    def ok_of(places: set[str]) -> tuple[int, int]:
        some = [r for r in reqs if place[id(r)] in places]
        return sum(r.outcome == OK for r in some), len(some)

    n_ok = sum(r.outcome == OK for r in reqs)
    print(f"\nrequests: {len(reqs)} ({len(reqs) / stop:.1f}/s), ok {n_ok}")
    print(
        "availability, started outside fault windows and recovery periods: "
        + _pct(*ok_of({CLEAR, CUT}))
    )
    print(
        "availability, started outside fault windows (recovery counted):   "
        + _pct(*ok_of({CLEAR, CUT, RECOVERY}))
    )
    print(
        "  of the first figure's, in flight when a fault began (a stream cut by a killed "
        "engine cannot be saved): " + _pct(*ok_of({CUT}))
    )

    print(f"\nfaults: {len(run.faults)}")
    for k, (fault, (secs, _)) in enumerate(zip(run.faults, rec, strict=True), 1):
        assert fault.back_at is not None
        inside = [r for r in reqs if fault.signal_at <= r.start < fault.back_at]
        hit = [r for r in reqs if r.start < fault.signal_at < (r.end or stop)]
        restart = f", restart to /health 200 {fault.restart_s:.1f} s" if fault.restart_s else ""
        if secs is None:
            nxt = run.faults[k].signal_at if k < len(run.faults) else stop
            rtext = f"NOT recovered in the {nxt - fault.back_at:.1f} s to the next fault/end"
        else:
            rtext = f"recovery {secs:.1f} s"
        print(
            f"  #{k} t={fault.signal_at:6.1f} s {fault.kind} {fault.role}: "
            f"window {fault.back_at - fault.signal_at:.1f} s{restart}; in flight at the signal "
            f"{len(hit)} (ok {sum(r.outcome == OK for r in hit)}), started in the window "
            f"{len(inside)} (ok {sum(r.outcome == OK for r in inside)}); {rtext}"
        )
    done = [s for s, _ in rec if s is not None]
    if done:
        print(
            f"recovery p50 {statistics.median(done):.1f} s, max {max(done):.1f} s "
            f"({len(done)} of {len(rec)} recovered)"
        )

    kinds: collections.Counter[str] = collections.Counter(r.outcome for r in reqs)
    if len(kinds) > 1 or OK not in kinds:
        print(f"\nfailures, by where they started ({' / '.join(PLACES)}):")
    for kind, n in kinds.most_common():
        if kind == OK:
            continue
        of_kind = [r for r in reqs if r.outcome == kind]
        by = collections.Counter(place[id(r)] for r in of_kind)
        print(
            f"  {kind:30s} {n:6d}  ({' / '.join(str(by[p]) for p in PLACES)})"
            f"; first: {of_kind[0].body!r}"
        )

    # CLEAR requests met no fault at all and the fakes inject none of their own: all must be ok.
    clear_ok, clear_n = ok_of({CLEAR})
    checks = [
        (clear_ok == clear_n, f"requests clear of every fault all ok: {clear_ok} of {clear_n}"),
        (slots == 0, f"decode slots in use at the end: {slots:g} (must be 0)"),
        (opened == 0, f"requests still open on the fake engines: {opened:g} (must be 0)"),
        (
            all(s is not None for s, _ in rec),
            f"every fault recovered before the next one or the end: "
            f"{sum(s is not None for s, _ in rec)} of {len(rec)}",
        ),
        (router_alive, "router process still running at the end"),
    ]
    print()
    for ok, text in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    if not run.faults:
        print("note: no fault fitted; use more --minutes or a shorter --interval / --tail")
    return 0 if all(ok for ok, _ in checks) else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=["pull", "push"], default="pull")
    p.add_argument("--minutes", type=float, default=3.0, help="of client traffic")
    p.add_argument("--rate", type=float, default=5.0, help="requests per second, open loop")
    p.add_argument("--seed", type=int, default=0, help="for the fault schedule")
    p.add_argument("--down", type=_range, default=(2.0, 8.0), help="seconds an engine stays down")
    p.add_argument(
        "--interval",
        type=_range,
        default=(15.0, 30.0),
        help="seconds from an engine back (or the start) to the next fault",
    )
    p.add_argument("--faults", type=_choices({"kill", "stop"}), default=["kill", "stop"])
    p.add_argument(
        "--roles",
        type=_choices({"prefill", "decode"}),
        default=["prefill", "decode"],
        help="engines to fault",
    )
    p.add_argument(
        "--tail",
        type=float,
        default=20.0,
        help="seconds of traffic kept after the last fault's engine is back",
    )
    p.add_argument("--tokens", type=int, default=8, help="streamed tokens per request")
    p.add_argument("--token-delay", type=float, default=0.05, help="seconds between tokens")
    p.add_argument("--client-timeout", type=float, default=40.0, help="seconds per request")
    p.add_argument("--settle", type=float, default=10.0, help="seconds to wait for 0 at the end")
    p.add_argument("--progress", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument(
        "--router-yaml-extra",
        type=json.loads,
        default={},
        help="JSON merged into the router's config",
    )
    p.add_argument(
        "--router-root",
        type=Path,
        default=None,
        help="run the router package of another checkout (e.g. "
        "git archive HEAD router | tar -x -C DIR), not this one",
    )
    p.add_argument(
        "--records",
        type=Path,
        default=None,
        help="write every request (start, end, status, outcome, fault windows overlapped) "
        "to this file, one JSON object a line",
    )
    p.add_argument(
        "--router-log", type=Path, default=None, help="keep the router's stderr in this file"
    )
    args = p.parse_args()
    raise SystemExit(asyncio.run(_main(args)))


async def _main(args: argparse.Namespace) -> int:
    # SIGTERM cancels the run as Ctrl-C does, so the finally block reaps every process.
    task = asyncio.current_task()
    assert task is not None
    terminated = []

    def on_term() -> None:
        terminated.append(True)
        task.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_term)
    try:
        return await run(args)
    except asyncio.CancelledError:
        print("interrupted: every process stopped, no figures", file=sys.stderr)
        return 143 if terminated else 130


if __name__ == "__main__":
    main()
