"""End-to-end through the router's ``pipelined`` mode: real engines with this connector.

The router dispatches both legs at once; the client sees only the router.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from router.stack.launcher import _router_env
from router.stack.ports import pick_ports
from router.stack.procs import ManagedProcess, stop_all
from tests.connector.engines import (
    HTTP_PORTS,
    Engine,
    engine_pair,
    frozen_core,
    local,
    wait_busy,
    wait_idle,
)

pytestmark = pytest.mark.e2e
CHUNKED = ("--max-num-batched-tokens", "256")
LONG = "All work and no play makes Jack a dull boy. " * 170  # about 3400 tokens
PROMPTS = [
    "def fibonacci(n):\n    return ",
    "The quick brown fox " * 40,
    "Once upon a time, " * 150,
]


def router_config(p: Engine, d: Engine, port: int) -> dict[str, object]:
    def inst(e: Engine) -> dict[str, object]:
        return {
            "url": e.url,
            "engine_id": e.identity.engine_id,
            "kv_host": e.identity.host,
            "kv_port": e.identity.port,
        }

    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [
            {
                "name": "tiny",
                "mode": "pipelined",
                "prefill": [inst(p)],
                "decode": [{**inst(d), "slots": 16}],
            }
        ],
    }


def start_router(run_dir: Path, p: Engine, d: Engine) -> tuple[ManagedProcess, str]:
    port = pick_ports(1, HTTP_PORTS, exclude={p.spec.port, d.spec.port})[0]
    cfg = run_dir / "router.yaml"
    cfg.write_text(yaml.safe_dump(router_config(p, d, port)))
    proc = ManagedProcess(
        "router",
        [sys.executable, "-m", "router", "serve", "--config", str(cfg)],
        _router_env(os.environ),
        run_dir / "router.log",
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_all([proc])
    raise RuntimeError(f"router not ready:\n{proc.log_tail()}")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Engine, Engine, str]]:
    with engine_pair(tmp_path, engine_args=CHUNKED) as (p, d):
        proc, url = start_router(tmp_path, p, d)
        try:
            yield p, d, url
        finally:
            stop_all([proc])


def complete(url: str, prompt: str, max_tokens: int = 16, timeout: float = 60) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        timeout=timeout,
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )


def test_through_router(stack: tuple[Engine, Engine, str]) -> None:
    """Greedy equality and bytes moved, then a client disconnect, then a killed P."""
    p, d, url = stack
    assert complete(url, "warm up").status_code == 200
    for prompt in PROMPTS:
        r = complete(url, prompt, 24)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == local(d, prompt, 24)
    assert p.metrics().total("vllm:pdr_bytes_written_total") > 0
    assert d.metrics().total("vllm:pdr_bytes_received_total") > 0

    # Client disconnects mid-prefill: both engines back to idle within 2 s. P's core is frozen
    # so that the prefill cannot finish inside the client's 0.1 s (P's prefix cache would make
    # a repeated prompt's prefill near-instant otherwise).
    with frozen_core(p), pytest.raises(httpx.TimeoutException):
        complete(url, LONG, 32, timeout=0.1)
    assert wait_idle(p, 2.0) and wait_idle(d, 2.0)

    # P killed mid-prefill: the client gets an error within 2 s, D keeps no blocks. The frozen
    # core holds the prefill; D holding the request shows that both legs are under way.
    with cf.ThreadPoolExecutor(1) as pool, frozen_core(p):
        fut = pool.submit(complete, url, LONG + "Again. ", 32)
        assert wait_busy(d, 10.0), "the decode leg never reached D"
        p.proc.signal_group(signal.SIGKILL)
        killed = time.monotonic()
        r = fut.result(timeout=30)
        took = time.monotonic() - killed
    assert r.status_code >= 500, r.text
    assert took < 2.0
    assert wait_idle(d, 2.0)
