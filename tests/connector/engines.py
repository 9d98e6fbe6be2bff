"""Real vLLM CPU engines running this connector, for the e2e tests and the benchmark.

``EnginePair`` starts a P and a D engine (each pinned to its own core, with the stack's run-time
fixes) and drives a pipelined request the way the router does: both legs at once, one
``X-Request-Id``, a fresh ``transfer_id``, each leg naming the other engine. A request without
``kv_transfer_params`` is an ordinary local request on that engine: the aggregated reference.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from connector.address import NixlAddress
from router.pd.pipelined_params import decode_params, prefill_params
from router.stack import engines as eng
from router.stack import model as tiny_model
from router.stack.metrics import MetricsPage, scrape
from router.stack.ports import pick_ports
from router.stack.procs import ManagedProcess, live_group_members, stop_all
from tests.frozen import FrozenCore, frozen

HTTP_PORTS = range(9100, 9300)
KV_PORTS = range(6600, 6800)


@dataclass
class Engine:
    spec: eng.EngineSpec
    proc: ManagedProcess
    identity: NixlAddress

    @property
    def url(self) -> str:
        return self.spec.url

    def metrics(self) -> MetricsPage:
        return scrape(self.url)


def connector_config(
    role: str,
    engine_id: str,
    kv_port: int,
    connector: str = "PipelinedPushConnector",
    extra: dict[str, Any] | None = None,
) -> str:
    cfg: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "engine_id": engine_id,
    }
    if connector == "PipelinedPushConnector":
        cfg["kv_connector_module_path"] = "connector"
        cfg["kv_connector_extra_config"] = {
            "side_channel_host": eng.LOCALHOST,
            "side_channel_port": kv_port,
            **(extra or {}),
        }
    return json.dumps(cfg)


@contextmanager
def engine_pair(
    run_dir: Path,
    *,
    variant: str = "tiny",
    max_model_len: int = 4096,
    connector: str = "PipelinedPushConnector",
    extra: dict[str, Any] | None = None,
    engine_args: tuple[str, ...] = (),
    startup_timeout_s: float = 420.0,
    tp: tuple[int, int] = (1, 1),
) -> Iterator[tuple[Engine, Engine]]:
    """Start P (core 0) and D (core 1); always stops both (process groups) on exit. ``tp``:
    P's and D's tensor-parallel sizes; an engine at TP 2 runs a worker on each core."""
    model_path = tiny_model.ensure_model(variant)
    per_token = tiny_model.kv_bytes_per_token(model_path)
    opts = eng.EngineOptions(
        model_path=model_path,
        max_model_len=max_model_len,
        kv_cache_bytes=eng.kv_cache_bytes_for(per_token, max_model_len),
    )
    http = pick_ports(2, HTTP_PORTS)
    kv = pick_ports(2, range(KV_PORTS.start, KV_PORTS.stop, 4))  # room for 4 workers each
    tag = uuid.uuid4().hex[:6]
    engines: list[Engine] = []
    try:
        for i, (name, role) in enumerate((("prefill", "kv_producer"), ("decode", "kv_consumer"))):
            engine_id = f"{name}-{tag}"
            cfg = connector_config(role, engine_id, kv[i], connector, extra)
            sizes = ("--tensor-parallel-size", str(tp[i])) if tp[i] > 1 else ()
            spec = eng.EngineSpec(
                f"{name}-0",
                "prefill" if i == 0 else "decode",
                http[i],
                i if tp[i] == 1 else "|".join(str(c) for c in range(tp[i])),
                None,
                kv[i],
                engine_id,
                ("--kv-transfer-config", cfg, *sizes, *engine_args),
            )
            env = eng.engine_env(spec, os.environ)
            proc = ManagedProcess(
                spec.name, eng.engine_argv(spec, opts), env, run_dir / f"{spec.name}.log"
            )
            identity = NixlAddress(engine_id, eng.LOCALHOST, kv[i], tp_size=tp[i])
            engines.append(Engine(spec, proc, identity))
        _wait_healthy(engines, startup_timeout_s)
        yield engines[0], engines[1]
    finally:
        stop_all([e.proc for e in engines], grace_s=10.0)


def _wait_healthy(engines: list[Engine], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(engines)
    while pending:
        for e in list(pending):
            if e.proc.exit_code() is not None:
                raise RuntimeError(f"{e.spec.name} died:\n{e.proc.log_tail()}")
            try:
                if httpx.get(f"{e.url}/health", timeout=2).status_code == 200:
                    pending.remove(e)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            names = [e.spec.name for e in pending]
            raise RuntimeError(f"engines not healthy in {timeout_s}s: {names}")
        time.sleep(0.5)


def completion_body(prompt: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def local(engine: Engine, prompt: str, max_tokens: int = 16) -> str:
    """The aggregated reference: the whole request on one engine, no transfer."""
    r = httpx.post(
        f"{engine.url}/v1/completions", json=completion_body(prompt, max_tokens), timeout=120
    )
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


@dataclass
class PdResult:
    text: str
    status: int
    prefill_status: int
    ttft_s: float
    total_s: float


def pipelined(
    p: Engine,
    d: Engine,
    prompt: str,
    max_tokens: int = 16,
    pool: cf.ThreadPoolExecutor | None = None,
    timeout_s: float = 120,
) -> PdResult:
    """Both legs at once, the way the router's pipelined mode sends them; D streams."""
    xid, tid = uuid.uuid4().hex, f"xfer-{uuid.uuid4().hex}"
    headers = {"X-Request-Id": xid}
    p_params = prefill_params(tid, d.identity, p.identity)  # sizes only where they differ
    p_body = {**completion_body(prompt, 1), "kv_transfer_params": p_params}
    d_body = {
        **completion_body(prompt, max_tokens, stream=True),
        "kv_transfer_params": decode_params(tid, p.identity, d.identity),
    }
    own = pool is None
    pool = pool or cf.ThreadPoolExecutor(1)
    try:
        t0 = time.monotonic()
        fut = pool.submit(
            httpx.post, f"{p.url}/v1/completions", json=p_body, headers=headers, timeout=timeout_s
        )
        text, status, ttft = _stream(f"{d.url}/v1/completions", d_body, headers, t0, timeout_s)
        total = time.monotonic() - t0
        p_status = fut.result().status_code
    finally:
        if own:
            pool.shutdown()
    return PdResult(text, status, p_status, ttft, total)


def warm_up(p: Engine, d: Engine, alone_first: bool = False) -> None:
    """The pair's first pipelined request, which pays the NIXL handshakes; fails, naming the
    connector's log lines, if it did not succeed: a test after a failed warm-up would fail
    for a reason its own assertion cannot show.

    ``alone_first``: each engine first answers two requests of its own (two prompt lengths,
    a prefill and decode steps each), so that its first forwards' one-time work is done
    before any transfer waits on it. vLLM's CPU build compiles its masked-embedding helper
    with ``torch.compile`` on the first forwards of an engine at tensor-parallel size 2 (and
    torch probes the CPU's vector ISA with a compiler run): seconds here, and on a machine
    with a cold inductor cache long enough that a handshake or receive begun meanwhile times
    out, since a worker inside a forward reads no notices."""
    if alone_first:
        for engine in (p, d):
            for prompt in ("warm up", "warm up the engine on its own, " * 8):
                local(engine, prompt, max_tokens=4)
    res = pipelined(p, d, "warm up")
    why = f"warm-up failed: {res.text}\n{connector_lines(p, d)}"
    assert (res.status, res.prefill_status) == (200, 200), why


def _stream(
    url: str, body: dict[str, Any], headers: dict[str, str], t0: float, timeout_s: float
) -> tuple[str, int, float]:
    parts: list[str] = []
    ttft = float("nan")
    with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout_s) as r:
        if r.status_code != 200:
            r.read()
            return r.text, r.status_code, ttft
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return json.dumps(chunk), 500, ttft
            if ttft != ttft:
                ttft = time.monotonic() - t0
            parts.append(chunk["choices"][0].get("text", ""))
    return "".join(parts), 200, ttft


def connector_lines(*engines: Engine, last: int = 25) -> str:
    """The connector's log lines (its links, failures and timeouts) of each engine, for a
    failed assertion's message: a transfer that failed says why only in the engine's log."""
    parts = []
    for e in engines:
        lines = e.proc.log_path.read_text(errors="replace").splitlines()
        mine = [line for line in lines if "pd-connector" in line]
        parts.append(f"--- {e.spec.name} ---\n" + "\n".join(mine[-last:]))
    return "\n".join(parts)


def kv_usage(engine: Engine) -> float:
    return engine.metrics().total("vllm:kv_cache_usage_perc")


def wait_idle(engine: Engine, timeout_s: float = 30.0) -> bool:
    """True once the engine has no running/waiting request and no KV blocks in use."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = engine.metrics()
        busy = m.total("vllm:num_requests_running") + m.total("vllm:num_requests_waiting")
        if busy == 0 and m.total("vllm:kv_cache_usage_perc") == 0:
            return True
        time.sleep(0.1)
    return False


def wait_busy(engine: Engine, timeout_s: float) -> bool:
    """True once the engine holds a running or waiting request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = engine.metrics()
        if m.total("vllm:num_requests_running") + m.total("vllm:num_requests_waiting") > 0:
            return True
        time.sleep(0.05)
    return False


def engine_core_pids(engine: Engine) -> list[int]:
    """Pids of the engine's EngineCore process(es): vLLM titles them ``VLLM::EngineCore...``."""
    pids = []
    for pid in live_group_members(engine.proc.pgid):
        with suppress(OSError):
            if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
    return pids


def frozen_core(engine: Engine, deadline_s: float = 10.0) -> AbstractContextManager[FrozenCore]:
    """SIGSTOP the engine's core (scheduler, connector, model) for the block while its API
    server keeps accepting: requests and aborts queue up and reach the core together on
    SIGCONT (``tests.frozen.frozen``)."""
    return frozen(engine.spec.name, engine_core_pids(engine), deadline_s)


def wait_for(what: str, probe: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``probe`` until it holds; fails the test with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not probe():
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {what}"
        time.sleep(0.02)


def logged(engine: Engine, *parts: str) -> int:
    """How many lines of the engine's log hold every one of ``parts`` (its API server logs
    each request it sent its core, "Added request <id>", and each abort it sent, "Aborted
    request(s) <ids>")."""
    lines = engine.proc.log_path.read_text(errors="replace").splitlines()
    return sum(all(part in line for part in parts) for line in lines)


def finished(engine: Engine) -> float:
    """Requests the engine finished normally (aborted ones are not counted in vLLM 0.32)."""
    return engine.metrics().total("vllm:request_success_total")


@contextmanager
def open_post(url: str, body: dict[str, Any], headers: dict[str, str]) -> Iterator[socket.socket]:
    """A POST sent over a plain socket and never read: closing the socket (on exit, or
    earlier by the test) is a client going away at the moment the test chooses."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    payload = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    request = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
        f"Connection: close\r\nContent-Type: application/json\r\n{head}"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection((parts.hostname, parts.port), timeout=5)
    try:
        sock.sendall(request + payload)
        yield sock
    finally:
        sock.close()
