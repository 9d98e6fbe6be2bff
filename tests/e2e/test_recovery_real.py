"""Recovery on real engines: D, then P, restarted under a steady ``openai`` SDK load.

The shared push and pull stacks (tests/engine_stacks.py) through their own routers, which run
the default health, outlier-detection and retry settings; after the other tests of those
stacks and before the fault tests (which kill P). A background thread starts a streamed
completion every ``1 / RATE`` s with the ``openai`` SDK (no SDK retries: every failure
shows) and records its start, end and outcome. Each engine in turn is stopped and started
again with the same ports (``Stack.restart_engine``, which returns once the new engine's
``/health`` answers); from that moment the test waits until QUIET_S pass with no failed
request, and reports the recovery time: from the engine being back to the first request
after which every request succeeded. It must stay within one health interval + the ejection
time + 2 s, measured from the restarted engine's readiness, with no other engine starting.
Requests that fail while the engine is down must fail fast (no queue wait). Afterwards no
decode slot is held and both engines are idle.

A restarted P is a new incarnation with a fresh engine id, which the stack gives the router
by a config reload (``Stack.restart_engine``): with P's old id reused, D kept the NIXL agent
it had cached for it and failed every request on a READ from the dead agent
(``NIXL_ERR_REMOTE_DISCONNECT``, HTTP 500) until D restarted too.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import openai
import pytest

from router.config import BreakerConfig, HealthConfig
from router.stack import Stack
from tests.e2e import helpers as h
from tests.engine_stacks import Running

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(1200),
    pytest.mark.destructive(order=0),
    pytest.mark.parametrize("engine_stack", ["push", "pull"], indirect=True),
]

MODEL = "tiny"
P, D = "prefill-0", "decode-0"
RATE = 2.0
QUIET_S = 5.0
BOUND_S = HealthConfig().interval + BreakerConfig().open_seconds + 2.0
FAST_S = 5.0
GRACE_S = 5.0  # an engine stopped with SIGTERM may finish its requests meanwhile
STEADY_S = 30.0  # for the load to run (requests succeeding) before the restart
JOIN_S = 180.0  # the load's last requests end within their own timeouts


@dataclass
class Outcome:
    started: float
    ended: float
    ok: bool
    error: str = ""


@dataclass
class Load:
    """Steady open-loop load: a new request every ``1 / RATE`` s on a thread pool."""

    url: str
    results: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        client = h.client_for(self.url)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            while not self._stop.wait(1 / RATE):
                pool.submit(self._one, client)

    def _one(self, client: openai.OpenAI) -> None:
        t0 = time.monotonic()
        try:
            out = h.complete(client, MODEL, "The capital of France is", stream=True, max_tokens=8)
            ok, error = out.finish_reason is not None, ""
        except openai.APIError as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"[:200]
        with self._lock:
            self.results.append(Outcome(t0, time.monotonic(), ok, error))

    def successes(self) -> int:
        with self._lock:
            return sum(r.ok for r in self.results)

    def failures_since(self, t: float) -> list[Outcome]:
        with self._lock:
            return [r for r in self.results if r.started >= t and not r.ok]

    def stop(self) -> None:
        self._stop.set()


@pytest.fixture
def loaded(engine_stack: Running) -> Iterator[tuple[Stack, Load]]:
    """The stack under a steady load that already succeeds; afterwards nothing is left."""
    stack: Stack = engine_stack.stack
    load = Load(stack.router_url)
    thread = threading.Thread(target=load.run, daemon=True)
    thread.start()
    try:
        steady = 2 * int(RATE)
        ok, what, _ = h.wait_until(
            lambda: (load.successes() >= steady, f"{load.successes()} of {steady} succeeded"),
            STEADY_S,
        )
        assert ok, f"the load never ran steadily: {what}; {load.failures_since(0.0)[-3:]}"
        yield stack, load
    finally:
        load.stop()
        thread.join(timeout=JOIN_S)
    assert not thread.is_alive(), f"the load's requests still running after {JOIN_S} s"
    ok, what, _ = h.wait_until(lambda: _nothing_left(stack), 15.0, every_s=0.25)
    assert ok, what


def _nothing_left(stack: Stack) -> tuple[bool, str]:
    """No decode slot held, nothing running or waiting on either engine."""
    slots = stack.router_metrics().total("pdrouter_decode_slots_in_use")
    busy = {
        name: stack.engine_metrics(name).total("vllm:num_requests_running")
        + stack.engine_metrics(name).total("vllm:num_requests_waiting")
        for name in (P, D)
    }
    return slots == 0 and not any(busy.values()), f"slots {slots}, engines {busy}"


def _quiet_after(load: Load, back: float) -> float:
    """Wait until QUIET_S pass with no failure among requests started since ``back``;
    returns the recovery moment (``back`` if none failed)."""
    deadline = back + BOUND_S + QUIET_S + 60  # requests of the moment may take a while
    while True:
        failed = [r.started for r in load.failures_since(back)]
        last = max(failed, default=back)
        if time.monotonic() - last >= QUIET_S and _settled(load, last):
            break
        assert time.monotonic() < deadline, f"no recovery: {load.failures_since(back)[-5:]}"
        time.sleep(0.5)
    if not failed:
        return back
    with load._lock:
        return min(r.started for r in load.results if r.started > last)


def _settled(load: Load, since: float) -> bool:
    """Requests started in the quiet window have ended (a slow one could still fail)."""
    with load._lock:
        ended = [r for r in load.results if r.started > since]
    return len(ended) >= (QUIET_S - 1) * RATE


@pytest.mark.parametrize("name", [D, P])
def test_engine_restart_under_load_recovers(loaded: tuple[Stack, Load], name: str) -> None:
    stack, load = loaded
    mode = stack.mode.value
    stopped = time.monotonic()
    took = stack.restart_engine(name, grace_s=GRACE_S)
    back = time.monotonic()
    recovered = _quiet_after(load, back)
    down = load.failures_since(stopped)
    print(
        f"{mode}: {name} restarted ({took:.1f}s to start); recovered "
        f"{recovered - back:.2f}s after it was back; {len(down)} requests failed meanwhile"
    )
    assert recovered - back <= BOUND_S
    # From the old process's end (its grace for in-flight requests is over) to its return.
    dead = stopped + GRACE_S + 1.0
    slow = [r for r in down if r.ended - r.started > FAST_S and dead < r.started < back]
    assert slow == [], f"requests waited while {name} was down: {slow[:3]}"
