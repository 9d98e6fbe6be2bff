"""End-to-end through the router's ``pipelined`` mode: real engines with this connector.

The router dispatches both legs at once; the client sees only the router. The run's connector
pair (tests/engine_stacks.py) with one router in front, started once.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import signal
import sys
import time
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
    frozen_core,
    local,
    logged,
    open_post,
    wait_busy,
    wait_for,
    wait_idle,
)
from tests.engine_stacks import RECEIVE_TIMEOUT_S, Running

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.parametrize("engine_stack", ["connector-pair"], indirect=True),
]
LONG = "All work and no play makes Jack a dull boy. " * 170  # about 3400 tokens
# Well before D's receive timeout (RECEIVE_TIMEOUT_S): an engine idle again by then was
# freed by the failure the test caused, not by the timeout (whose counter is checked too).
BEFORE_TIMEOUT_S = 0.6 * RECEIVE_TIMEOUT_S
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
def stack(
    engine_stack: Running, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Engine, Engine, str]:
    """The run's connector pair with a router in front (started once, stopped before the
    engines)."""
    p, d = engine_stack.pair

    def make(exits: contextlib.ExitStack) -> str:
        proc, url = start_router(tmp_path_factory.mktemp("router"), p, d)
        exits.callback(stop_all, [proc])
        return url

    url: str = engine_stack.shared("router", make)
    return p, d, url


def complete(url: str, prompt: str, max_tokens: int = 16, timeout: float = 60) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        timeout=timeout,
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )


def test_through_router(stack: tuple[Engine, Engine, str]) -> None:
    """Greedy equality and bytes moved."""
    p, d, url = stack
    written, received = (
        p.metrics().total("vllm:pdr_bytes_written_total"),
        d.metrics().total("vllm:pdr_bytes_received_total"),
    )
    for prompt in PROMPTS:
        r = complete(url, prompt, 24)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == local(d, prompt, 24)
    assert p.metrics().total("vllm:pdr_bytes_written_total") > written
    assert d.metrics().total("vllm:pdr_bytes_received_total") > received


def test_client_disconnect_mid_prefill_through_router(stack: tuple[Engine, Engine, str]) -> None:
    """The client leaves while P holds the prefill: both engines idle again, D freed by P's
    notice, not by its receive timeout. P's core is frozen before the request and thawed once
    P's API server has sent it the request and then the abort (the router closed P's leg): P
    cannot finish the prefill first, however fast, nor see the abort before the request."""
    p, d, url = stack
    added, aborted = logged(p, "Added request"), logged(p, "Aborted request")
    timeouts0 = recv_timeouts(d)
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 32, "temperature": 0}
    with frozen_core(p):
        with open_post(f"{url}/v1/completions", body, {}):
            assert wait_busy(d, 10.0), "the decode leg never reached D"
            wait_for("P sent its core the request", lambda: logged(p, "Added request") > added)
        wait_for("P sent its core the abort", lambda: logged(p, "Aborted request") > aborted)
    assert wait_idle(p, BEFORE_TIMEOUT_S) and wait_idle(d, BEFORE_TIMEOUT_S)
    assert recv_timeouts(d) == timeouts0


@pytest.mark.destructive(order=1)
def test_prefill_killed_mid_prefill(stack: tuple[Engine, Engine, str]) -> None:
    """P killed mid-prefill: the client gets the router's upstream error at once (not after a
    timeout), D keeps no blocks (vLLM's own push connector leaks them here). The frozen core
    holds the prefill; D holding the request shows that both legs are under way. Last on the
    pair: P stays dead."""
    p, d, url = stack
    timeouts0 = recv_timeouts(d)
    with cf.ThreadPoolExecutor(1) as pool, frozen_core(p):
        fut = pool.submit(complete, url, LONG + "Again. ", 32)
        assert wait_busy(d, 10.0), "the decode leg never reached D"
        p.proc.signal_group(signal.SIGKILL)
        killed = time.monotonic()
        r = fut.result(timeout=BEFORE_TIMEOUT_S)
        took = time.monotonic() - killed
    assert r.status_code == 502, r.text
    assert r.json()["error"]["type"] == "upstream_error", r.text
    assert took < BEFORE_TIMEOUT_S  # the router's prefill timeout is 120 s
    assert wait_idle(d, BEFORE_TIMEOUT_S)
    assert recv_timeouts(d) == timeouts0


def recv_timeouts(d: Engine) -> float:
    return d.metrics().total("vllm:pdr_failures_total", kind="recv_timeout")
