"""The fault matrix, real-engine half: faults only real vLLM engines show.

vLLM CPU engines with the stock NIXL connectors run behind the router (``router.stack``). Each
fault is injected at a chosen phase of a request: SIGSTOP/SIGCONT freeze and thaw an engine, or
only its EngineCore (scheduler and model) while its API server keeps accepting requests, so a
phase lasts as long as the test needs, however slow the machine; SIGKILL crashes one, and a
prompt too long for P alone makes P reject a request. After each fault the tests check the
client's answer (status, OpenAI error body or SSE error event, time), the router's decode slots,
both engines' running/waiting requests and KV usage, and the router's verdict on D.

Router (``ROUTER``): one attempt per request and no mid-stream migration, so the answer is the
fault's own (retries are covered on fake engines in tests/integration, migration in
tests/e2e/test_migration_real.py), small timeouts, health checks every 0.5 s.

Push (``NixlPushConnector``; P's max_model_len 3200, D's 4096):

* client disconnect while P holds the request (P's core frozen before the request, so P cannot
  answer until the test thaws it) and D waits for its KV: the router keeps P's leg, D and the
  slot until P has written D's KV, then closes D; after P's answer, before D's first byte: D is
  closed at once, the KV still lands. Both engines idle, no leak;
* P rejects the request: P's 400 reaches the client at once;
* P frozen before it runs the request, so D's KV registration is never fulfilled: D's
  first-byte timeout answers 504;
* P SIGKILLed while it holds the request (its core frozen before it computed any of it) and D
  waits for its KV: 502 at once.

No push fault is timed into the middle of P's computation: P's progress shows only through its
API server's ``/metrics``, which on a busy 2-core machine can stay silent for a whole prefill and
cannot tell a request the core still computes from one it has just finished, so such a test
would hinge on a race. The router cannot tell the two apart either: in both it has an open P leg
and no answer, which is the state these tests hold.

In the last three, D is closed while it waits for KV that never comes (each test waits until D
holds the request in that state before it lets the fault happen), and vLLM 0.32 keeps that
request's blocks for good (KV usage above idle with nothing running or waiting; vLLM issue
#48633). The router reads D's metrics, marks it degraded (``/ready`` 503,
``pdrouter_engine_degraded`` 1) and, while another D serves, sends it nothing while its KV
stays above idle; the only D keeps serving (the panic threshold: a leak is no outage). Each
test asserts the outcome its timing decides: a leak where D was closed waiting, none where
the KV landed, judged from D's KV usage when the test began. A test that needs an idle D
restarts a leaked one first (``Stack.restart_engine``; the router puts it back in rotation by
itself); the last two take D with the blocks the one before leaked.

Pull (``NixlConnector``):

* client disconnect while the P leg is open, or between P's answer and D's first byte: both
  engines idle, P keeps no blocks;
* P SIGKILLed after its answer, before D reads the KV: D's READ fails, D streams an SSE error
  event after its 200, and the client gets it; D idle, not degraded.

A pull P killed mid-prefill never involves D: a plain connection failure, covered with SIGKILLed
fake engines in tests/integration/test_fault_matrix.py.

The shared push and pull stacks (tests/engine_stacks.py: P allows fewer tokens than D, both
engines track their API server's load), through a second router with ``ROUTER``'s settings;
last on their stacks (they kill P), after the recovery tests. No restart of the push D in a
whole run: the last two leaking tests take D as the one before left it, leaked blocks included.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from router.stack import ensure_model
from tests.e2e import helpers as h
from tests.e2e.conftest import AnyStack
from tests.engine_stacks import P_MAX_MODEL_LEN, Running

Stack = AnyStack  # the shared stack through this module's router
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.destructive(order=1)]

MODEL = "tiny"
TIMEOUTS = {"connect": 2, "prefill": 10, "decode_first_byte": 6, "idle": 10, "total": 60}
ROUTER: dict[str, Any] = {
    "timeouts": TIMEOUTS,
    "retries": {"max_attempts": 1},
    "health": {"interval": 0.5, "timeout": 1.0},
    "admission": {"max_wait": 2},
    # No mid-stream migration: a D failing after its first byte would be continued on P
    # alone (tests/e2e/test_migration_real.py), and the answer here is the fault's own.
    "migration": {"max_attempts": 0},
}
LONG, TOO_LONG_FOR_P, SHORT = 2900, 3600, 300  # prompt tokens
P, D = "prefill-0", "decode-0"
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE, FINISHED = "vllm:kv_cache_usage_perc", "vllm:request_success_total"
IDLE_KV = 1e-9  # an idle engine holds no KV blocks (no prefix caching)
# Deadlines of waits for something that must happen (each returns as soon as it holds): far
# above what a run takes, so a machine busy with other work cannot decide the outcome. A run
# here takes under a tenth of each (engines idle in 0.1-0.5 s, a phase in 0.1-2 s).
IDLE_DEADLINE_S = 15.0
# After a push drop before P's answer, P (thawed) first prefills and D runs its first step.
SETTLE_DEADLINE_S = 30.0
VERDICT_DEADLINE_S = 15.0  # thirty health intervals: the router has read D's metrics by then
PHASE_DEADLINE_S = 30.0  # for a request to reach a phase (D waiting, P answered, ...)
RESTART_READY_S = 30.0
# A push P killed this long after the request at the latest: the 502 (due within 3 s of the kill)
# then comes before D's first-byte timeout could answer 504.
KILL_BY_S = TIMEOUTS["decode_first_byte"] - 3.0


# -- fixtures ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompts:
    long: str
    too_long_for_p: str
    short: str


@pytest.fixture(scope="module")
def fault_prompts(engines_available: None) -> Prompts:
    model_dir = ensure_model("tiny")
    long, too_long, short = h.prompts_of_lengths(
        model_dir / "tokenizer.json", [LONG, TOO_LONG_FOR_P, SHORT]
    )
    return Prompts(long, too_long, short)


def _faults_router(engine_stack: Running) -> Stack:
    """The shared stack through a router with ``ROUTER``'s settings (started once)."""
    routed: Stack = engine_stack.routed("faults", router_overrides=ROUTER)
    return routed


@pytest.fixture
def push_stack(engine_stack: Running) -> Stack:
    return _faults_router(engine_stack)


@pytest.fixture
def pull_stack(engine_stack: Running) -> Stack:
    return _faults_router(engine_stack)


def _warm_up(stack: Stack) -> None:
    """One request through the router: the NIXL handshakes are done before any fault."""
    h.complete(h.client_for(stack.router_url), MODEL, "warm-up", stream=False, max_tokens=2)


def _serving(stack: Stack, *, leaked_d: bool = False) -> None:
    """Before a test: a D that still holds leaked KV is restarted (vLLM never frees it), then
    both engines must be idle, the router ready, and a request must go through. Returns once
    the router has P's answer to that request too (in push, D's answer can reach the client
    first), so P's counters include it when a test reads them.

    ``leaked_d``: the test takes D as an earlier test left it, leaked blocks and the router's
    degraded verdict included (it judges its own leak from D's KV at its start,
    ``_assert_decode_leak_handled``'s ``kv_before``): no restart; D must run and wait for
    nothing, P be idle and healthy, no slot held."""
    if leaked_d:
        probe = functools.partial(_quiet_beside_a_leak, stack)
    else:
        if _load(stack, D).kv > IDLE_KV or _router(stack).degraded:
            took = stack.restart_engine(D)
            print(f"restarted {D} (leaked KV) in {took:.1f}s")
        probe = functools.partial(_all_idle, stack, need_ready=True)
    ok, what, _ = h.wait_until(probe, RESTART_READY_S, every_s=0.25)
    assert ok, f"stack not back to idle and ready: {what}"
    _warm_up(stack)
    _wait_phase(stack, "P answered the warm-up", lambda: _prefill_legs_open(stack) == 0)


# -- observing engines and router ----------------------------------------------------------


@dataclass(frozen=True)
class Load:
    running: float
    waiting: float
    kv: float

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.kv <= IDLE_KV


def _gauges(stack: Stack, name: str) -> dict[str, float]:
    """The few samples these tests read from an engine's ``/metrics``, summed over labels.

    A line scan, not :meth:`Metrics.parse`: vLLM's page is about 60 KB and a full parse costs
    about 80 ms, too slow for the probes that wait for a phase of a request."""
    wanted = (RUNNING, WAITING, KV_USAGE, FINISHED)
    text = httpx.get(f"{stack.engine(name).url}/metrics", timeout=5).text
    values = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if line.startswith(wanted):
            sample, value = line.rsplit(" ", 1)
            metric = sample.split("{", 1)[0]
            if metric in values:
                values[metric] += float(value)
    return values


def _load(stack: Stack, name: str) -> Load:
    g = _gauges(stack, name)
    return Load(g[RUNNING], g[WAITING], g[KV_USAGE])


def _finished(stack: Stack, name: str) -> float:
    """Requests the engine finished normally (aborted ones are not counted in vLLM 0.32)."""
    return _gauges(stack, name)[FINISHED]


@dataclass(frozen=True)
class RouterView:
    slots_in_use: float
    degraded: float
    ready: int
    instances: dict[str, dict[str, Any]]  # by role: healthy, degraded, ... from /ready

    def describe(self) -> str:
        roles = {r: (i["healthy"], i["degraded"]) for r, i in self.instances.items()}
        return f"slots={self.slots_in_use} degraded={self.degraded} ready={self.ready} {roles}"


def _router(stack: Stack) -> RouterView:
    m = stack.router_metrics()
    ready = httpx.get(f"{stack.router_url}/ready", timeout=5)
    (model,) = ready.json()["models"].values()
    return RouterView(
        m.total("pdrouter_decode_slots_in_use"),
        m.total("pdrouter_engine_degraded"),
        ready.status_code,
        {i["role"]: i for i in model["instances"]},
    )


def _all_idle(
    stack: Stack, *, need_ready: bool = False, engines: tuple[str, ...] = (P, D)
) -> tuple[bool, str]:
    loads = {name: _load(stack, name) for name in engines}
    view = _router(stack)
    idle = all(load.idle for load in loads.values()) and view.slots_in_use == 0
    if need_ready:
        idle = idle and view.ready == 200 and view.degraded == 0
    return idle, f"{loads} router: {view.describe()}"


def _quiet_beside_a_leak(stack: Stack) -> tuple[bool, str]:
    """P idle and healthy in the router's view; D running and waiting for nothing (its KV
    may hold blocks leaked by an earlier test); no slot held."""
    p, d, view = _load(stack, P), _load(stack, D), _router(stack)
    quiet = p.idle and not (d.running or d.waiting or view.slots_in_use)
    healthy = view.instances["prefill"]["healthy"] is True
    return quiet and healthy, f"{P} {p} {D} {d} router {view.describe()}"


def _wait_phase(stack: Stack, what: str, probe: Callable[[], bool]) -> float:
    """Poll until the request reaches a phase; returns the seconds it took."""
    slowest = 0.0
    probes = 0

    def timed() -> tuple[bool, str]:
        nonlocal slowest, probes
        t0 = time.monotonic()
        reached = probe()
        slowest, probes = max(slowest, time.monotonic() - t0), probes + 1
        return reached, what

    ok, _, waited = h.wait_until(timed, PHASE_DEADLINE_S, every_s=0.02)
    if not ok:
        try:
            _, now = _all_idle(stack)
        except httpx.HTTPError as exc:
            now = repr(exc)
        raise AssertionError(
            f"request never reached: {what} ({probes} probes, slowest {slowest:.2f}s); now {now}"
        )
    return waited


def _assert_idle_soon(
    stack: Stack, why: str, engines: tuple[str, ...] = (P, D), deadline_s: float = IDLE_DEADLINE_S
) -> float:
    idle, what, waited = h.wait_until(lambda: _all_idle(stack, engines=engines), deadline_s)
    assert idle, f"not idle {waited:.1f}s after {why}: {what}"
    return waited


def _assert_decode_leak_handled(stack: Stack, *, leaked: bool, kv_before: float = 0.0) -> None:
    """After D's request ended: nothing runs or waits on D, no slot is held, D leaked its KV
    exactly when ``leaked`` says (closed while waiting for KV that never came: vLLM 0.32 keeps
    the blocks: D's KV usage rose above ``kv_before``, its usage when the test began), and the
    router's verdict matches D's own metrics: KV above idle means degraded and out of rotation
    (``/ready`` 503, ``pdrouter_engine_degraded`` 1); idle KV means in rotation."""

    def verdict() -> tuple[bool, str]:
        d, view = _load(stack, D), _router(stack)
        what = f"{D} {d}, router {view.describe()}"
        if d.running or d.waiting or view.slots_in_use:
            return False, what
        if d.kv > IDLE_KV:
            entry = view.instances["decode"]
            return view.degraded == 1 and view.ready == 503 and entry["degraded"] is True, what
        return view.degraded == 0, what

    ok, what, waited = h.wait_until(verdict, VERDICT_DEADLINE_S)
    assert ok, f"router verdict does not match D after {waited:.1f}s: {what}"
    grew = _load(stack, D).kv > kv_before + IDLE_KV
    assert grew is leaked, f"D leaked KV: {not leaked} (usage {kv_before:g} before); {what}"
    print(f"D leaked KV: {leaked}; router verdict after {waited:.1f}s: {what}")


# -- requests ------------------------------------------------------------------------------


def _body(prompt: str) -> dict[str, Any]:
    """A streamed greedy completion of 16 tokens."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 16,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    text: str
    elapsed: float
    ended_at: float  # time.monotonic() when the answer was complete
    headers: dict[str, str]

    def error(self) -> dict[str, Any]:
        """The OpenAI error object of a JSON error answer."""
        assert self.content_type.startswith("application/json"), self
        err = json.loads(self.text)["error"]
        assert isinstance(err, dict) and {"message", "type", "code"} <= err.keys(), self.text
        return err

    def events(self) -> list[str]:
        """The ``data:`` payloads of an SSE answer."""
        return [e.removeprefix("data: ") for e in self.text.split("\n\n") if e.startswith("data: ")]


def _ask(stack: Stack, prompt: str) -> Answer:
    """A streamed completion through the router, read to its end."""
    t0 = time.monotonic()
    with (
        httpx.Client(timeout=TIMEOUTS["total"] + 10) as client,
        client.stream("POST", f"{stack.router_url}/v1/completions", json=_body(prompt)) as r,
    ):
        text = r.read().decode("utf-8", "replace")
    end = time.monotonic()
    return Answer(
        r.status_code, r.headers.get("content-type", ""), text, end - t0, end, dict(r.headers)
    )


class OpenRequest:
    """A completion request over a plain socket, dropped by :meth:`drop` at a chosen moment
    (the client going away; the router sees the connection close)."""

    def __init__(self, base_url: str, body: dict[str, Any]) -> None:
        url = urlsplit(base_url)
        assert url.hostname is not None and url.port is not None
        payload = json.dumps(body).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}:{url.port}\r\n"
            "Connection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        self._sock = socket.create_connection((url.hostname, url.port), timeout=5)
        self._sock.sendall(head.encode() + payload)
        self.received = b""
        self.complete = False

    def poll(self) -> bool:
        """Take what has arrived; True once the whole answer is in (the router closed)."""
        self._sock.setblocking(False)
        try:
            while not self.complete:
                chunk = self._sock.recv(65536)
                self.received += chunk
                self.complete = chunk == b""
        except BlockingIOError:
            pass
        finally:
            self._sock.setblocking(True)
        return self.complete

    def answered(self) -> bool:
        """Whether any byte of the answer arrived (a drop would then be too late)."""
        self.poll()
        return self.received != b""

    def drop(self) -> None:
        self._sock.close()

    def __enter__(self) -> OpenRequest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop()


def _prefill_legs_open(stack: Stack) -> float:
    return stack.router_metrics().total("pdrouter_prefill_in_flight")


def _disconnects(stack: Stack) -> float:
    return stack.router_metrics().total(
        "pdrouter_client_disconnects_total", phase="before_first_byte"
    )


# -- push ----------------------------------------------------------------------------------


class TestPush:
    """Push mode (``NixlPushConnector``), P and D dispatched together."""

    pytestmark = pytest.mark.parametrize("engine_stack", ["push"], indirect=True)

    # The last two leak D's KV on top of the blocks the test before them leaked: each judges
    # its own leak from D's KV at its start, so D is restarted once per run, not before each
    # (a restart costs about 28 s of CI).
    TAKE_D_AS_LEFT = ("test_registration_never_fulfilled", "test_prefill_killed_while_holding")

    @pytest.fixture(autouse=True)
    def _ready(self, push_stack: Stack, request: pytest.FixtureRequest) -> None:
        _serving(push_stack, leaked_d=request.node.name.startswith(self.TAKE_D_AS_LEFT))

    def test_disconnect_while_p_holds_the_request_lets_p_finish_and_leaves_both_idle(
        self, push_stack: Stack, fault_prompts: Prompts
    ) -> None:
        """Dropped while P holds the request and D waits for the KV: the router closes neither
        (closing D would leak its blocks; closing P would abort the request, so the KV would
        never come); it keeps P's leg, D and the slot until P has written the KV.

        P's core is frozen before the request (its API server accepts it), so P cannot answer
        before the test thaws it, after the drop, however slow the machine."""
        st = push_stack
        p_done, drops = _finished(st, P), _disconnects(st)
        with h.frozen_core(st, P, PHASE_DEADLINE_S):
            held = functools.partial(_p_holds_d_waits, st, _p_server_load(st))
            with OpenRequest(st.router_url, _body(fault_prompts.long)) as req:
                took = _wait_phase(st, "P holds the request, D waits for KV", held)
                assert not req.answered()
                req.drop()
                _wait_phase(st, "router saw the disconnect", lambda: _disconnects(st) == drops + 1)
                assert _router(st).slots_in_use == 1
                assert held(), "the router closed P or D while P held the request"
        # Had the router closed P's leg (now or a moment later, while P's core was frozen),
        # P's API server would have aborted the request: P would not finish it, D would leak.
        waited = _assert_idle_soon(st, "the disconnect", deadline_s=SETTLE_DEADLINE_S)
        assert _finished(st, P) == p_done + 1, "P's request was aborted (D would leak)"
        assert _disconnects(st) == drops + 1
        _assert_decode_leak_handled(st, leaked=False)
        print(
            f"push, dropped while P held the request ({took:.2f}s after it was sent): "
            f"idle {waited:.1f}s after P's core resumed"
        )

    def test_disconnect_after_p_answered_leaves_both_idle(
        self, push_stack: Stack, fault_prompts: Prompts
    ) -> None:
        """Dropped after P's answer but before D's first byte: the router closes D at once; the
        KV P wrote still lands, so D frees its blocks. (P is frozen until D has registered its
        blocks, then D until the drop: each phase lasts as long as the test needs.)"""
        st = push_stack
        p_done, drops = _finished(st, P), _disconnects(st)
        st.signal_engine(P, signal.SIGSTOP)
        with OpenRequest(st.router_url, _body(fault_prompts.long)) as req:
            try:
                _wait_phase(st, "D waiting for its KV", lambda: _load(st, D).waiting == 1)
                st.signal_engine(D, signal.SIGSTOP)
                st.signal_engine(P, signal.SIGCONT)
                _wait_phase(st, "P answered", lambda: _finished(st, P) > p_done)
                assert not req.answered()
                req.drop()
                _wait_phase(st, "router released the slot", lambda: _router(st).slots_in_use == 0)
            finally:
                st.signal_engine(P, signal.SIGCONT)
                st.signal_engine(D, signal.SIGCONT)
        waited = _assert_idle_soon(st, "the disconnect")
        assert _disconnects(st) == drops + 1
        _assert_decode_leak_handled(st, leaked=False)
        print(f"push, dropped between P and D: idle {waited:.1f}s after D resumed")

    def test_prefill_rejects_request(self, push_stack: Stack, fault_prompts: Prompts) -> None:
        """Only P rejects the prompt (too long for P's max_model_len): P's own 400 reaches the
        client at once; D, opened at the same time, is closed while it waits for KV, and leaks.

        P is frozen (all of it) until D holds the request waiting for its KV, so P's rejection
        always comes after D registered: the leak is certain, not a race between the two."""
        st = push_stack
        st.signal_engine(P, signal.SIGSTOP)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                future = pool.submit(_ask, st, fault_prompts.too_long_for_p)
                _wait_phase(st, "D waiting for its KV", lambda: _load(st, D).waiting == 1)
                st.signal_engine(P, signal.SIGCONT)
                thawed_at = time.monotonic()
                answer = future.result(timeout=TIMEOUTS["total"])
        finally:
            st.signal_engine(P, signal.SIGCONT)
        assert answer.status == 400, answer
        err = answer.error()
        assert "maximum context length" in err["message"] and str(P_MAX_MODEL_LEN) in err["message"]
        assert err["type"] == "BadRequestError" and err["code"] == 400, err
        assert answer.ended_at - thawed_at < TIMEOUTS["decode_first_byte"], "waited for a timeout"
        print(f"push, P rejects: 400 {answer.ended_at - thawed_at:.2f}s after P resumed")
        _assert_decode_leak_handled(st, leaked=True)
        # Degraded, yet the only D: leaked blocks cost capacity, not correctness, so the
        # router keeps serving on it (panic threshold) rather than refusing every request.
        served = _ask(st, fault_prompts.short)
        assert served.status == 200, served

    def test_registration_never_fulfilled(self, push_stack: Stack, fault_prompts: Prompts) -> None:
        """P's core frozen before it runs the request: D registers its blocks and waits; P never
        writes. D's first-byte timeout (shorter than P's) ends the request with a 504. Only
        the core is frozen: P's API server keeps answering the health checks, so P stays
        healthy and the timeout, not a health verdict, decides the answer."""
        st = push_stack
        assert TIMEOUTS["decode_first_byte"] < TIMEOUTS["prefill"]
        limit = TIMEOUTS["decode_first_byte"]
        kv_before = _load(st, D).kv
        with h.frozen_core(st, P, PHASE_DEADLINE_S):
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                future = pool.submit(_ask, st, fault_prompts.short)
                _wait_phase(st, "D waiting for its KV", lambda: _load(st, D).waiting == 1)
                answer = future.result(timeout=TIMEOUTS["total"])
            assert answer.status == 504, answer
            assert answer.error()["code"] == "decode_first_byte_timeout", answer.text
            # Not before the limit; the upper bound only tells this timeout from the next one
            # (prefill, 10 s): the code names which fired.
            assert limit <= answer.elapsed < TIMEOUTS["prefill"], answer.elapsed
            print(f"push, P's core frozen: 504 after {answer.elapsed:.2f}s")
            _assert_decode_leak_handled(st, leaked=True, kv_before=kv_before)
        # P's core now reads the request and its abort (the router closed P's leg) together,
        # so P never writes: D keeps the blocks and stays flagged degraded. A request of P's
        # own, answered, shows that P's core has read everything before it.
        assert _local_completion(st, P) == 200
        ok, what, _ = h.wait_until(
            lambda: (_router(st).instances["prefill"]["healthy"] is True, "P healthy"),
            IDLE_DEADLINE_S,
        )
        assert ok, what
        view = _router(st)
        assert _load(st, D).kv > kv_before + IDLE_KV and view.ready == 503, view.describe()
        assert view.instances["decode"]["degraded"] is True

    def test_prefill_killed_while_holding_the_request(
        self, push_stack: Stack, fault_prompts: Prompts
    ) -> None:
        """P SIGKILLed while it holds the request and D waits for the KV: the router sees P's
        connection die, closes D and answers 502 at once. Last push test: P stays dead.

        P's core is frozen before the request, so until the kill the request is P's (accepted
        by its API server, not yet computed by its core), however slow the machine; the kill
        takes the whole engine, the frozen core included."""
        st = push_stack
        kv_before = _load(st, D).kv
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with h.frozen_core(st, P, PHASE_DEADLINE_S) as core:
                core_pids = core.pids
                p_load = _p_server_load(st)
                held = functools.partial(_p_holds_d_waits, st, p_load)
                sent_at = time.monotonic()
                future = pool.submit(_ask, st, fault_prompts.long)
                _wait_phase(st, "P holds the request, D waits for KV", held)
                d = _load(st, D)
                assert d.running == 0 and d.waiting == 1, f"D got its KV before the kill: {d}"
                took = time.monotonic() - sent_at
                assert took < KILL_BY_S, f"request took {took:.1f}s to reach P and D"
                st.signal_engine(P, signal.SIGKILL)
                killed_at = time.monotonic()
            answer = future.result(timeout=TIMEOUTS["total"])
        assert answer.status == 502, answer
        assert answer.error()["code"] == "prefill_unreachable"
        # The code says the router saw P's connection die; a timeout would answer 504 with
        # its own code (decode_first_byte_timeout, due KILL_BY_S + 3 s after the kill).
        print(
            f"push, P killed holding the request ({took:.2f}s after it was sent; P's load before "
            f"it {p_load:g}): 502 {answer.ended_at - killed_at:.2f}s after the kill"
        )
        ok, what, _ = h.wait_until(
            lambda: (not any(map(h.alive, core_pids)), f"P's EngineCore {core_pids} alive"),
            IDLE_DEADLINE_S,
        )
        assert ok, what
        _assert_decode_leak_handled(st, leaked=True, kv_before=kv_before)
        ok, what, _ = h.wait_until(
            lambda: (_router(st).instances["prefill"]["healthy"] is False, "P unhealthy"),
            IDLE_DEADLINE_S,
        )
        assert ok, what
        assert _router(st).ready == 503


def _p_server_load(stack: Stack) -> float:
    return _server_load(stack, P)


def _server_load(stack: Stack, name: str) -> float:
    """Requests the engine's API server has taken in and neither answered nor seen their
    client leave (``--enable-server-load-tracking``); callers compare with the count before
    their request."""
    load = httpx.get(f"{stack.engine(name).url}/load", timeout=5).json()["server_load"]
    return float(load)


def _local_completion(stack: Stack, name: str) -> int:
    """A short completion sent to engine ``name`` itself (no KV transfer); its status. Its
    answer means the engine's core has read every request and abort sent before it."""
    body = {"model": MODEL, "prompt": "probe", "max_tokens": 1, "temperature": 0}
    url = f"{stack.engine(name).url}/v1/completions"
    return httpx.post(url, json=body, timeout=TIMEOUTS["total"]).status_code


def _p_holds_d_waits(stack: Stack, p_load_before: float) -> bool:
    """The router's P leg is open and P's API server has the request (P has not answered); D
    has it too and waits for the KV. With P's core frozen, only the test can end this."""
    d = _load(stack, D)
    return (
        _prefill_legs_open(stack) == 1
        and _p_server_load(stack) == p_load_before + 1
        and d.running == 0
        and d.waiting == 1
    )


# -- pull ----------------------------------------------------------------------------------


class TestPull:
    """Pull mode (``NixlConnector``): P to completion, then D READs P's blocks."""

    pytestmark = pytest.mark.parametrize("engine_stack", ["pull"], indirect=True)

    @pytest.fixture(autouse=True)
    def _ready(self, pull_stack: Stack) -> None:
        _serving(pull_stack)

    def test_disconnect_before_p_answers_aborts_p(
        self, pull_stack: Stack, fault_prompts: Prompts
    ) -> None:
        """Dropped while the P leg is open: the router closes it, P aborts the request and keeps
        no blocks (a P that finished would keep them for D until its 30 s lease ends).

        P's core is frozen before the request reaches it, so the phase lasts until the drop;
        its API server holds the request, and the core is thawed once that server has sent it
        the abort: the core reads both together and never computes the request. (As in push,
        no drop is timed into the middle of P's prefill: see the module docstring.)"""
        st = pull_stack
        p_done, d_done, drops = _finished(st, P), _finished(st, D), _disconnects(st)
        p_log = st.log_path(P)
        aborts = h.logged(p_log, h.ABORTED)
        with h.frozen_core(st, P, PHASE_DEADLINE_S):
            p_load = _server_load(st, P)
            with OpenRequest(st.router_url, _body(fault_prompts.long)) as req:
                _wait_phase(
                    st,
                    "P leg open and P's API server holding it",
                    lambda: _prefill_legs_open(st) == 1 and _server_load(st, P) == p_load + 1,
                )
                req.drop()
                _wait_phase(st, "router released the slot", lambda: _router(st).slots_in_use == 0)
                assert _prefill_legs_open(st) == 0
                _wait_phase(
                    st, "P sent its core the abort", lambda: h.logged(p_log, h.ABORTED) > aborts
                )
        # P's core now reads the request and its abort. Once P has answered a request of its
        # own, sent after them, it has handled both: had the router left the leg open, P
        # would have run the request to its end (and then held its blocks for D).
        assert _local_completion(st, P) == 200
        idle, what = _all_idle(st)
        assert idle, what
        assert _finished(st, P) == p_done + 1, "P ran the request to its end"
        assert _finished(st, D) == d_done
        assert _disconnects(st) == drops + 1

    def test_disconnect_between_p_and_d_leaves_both_idle(
        self, pull_stack: Stack, fault_prompts: Prompts
    ) -> None:
        """Dropped after P's answer while the D leg is open (D's core frozen meanwhile, its API
        server holding the leg): the router closes D; D, thawed, tells P to free the blocks it
        kept for the READ."""
        st = pull_stack
        p_done, drops = _finished(st, P), _disconnects(st)
        d_log = st.log_path(D)
        aborts = h.logged(d_log, h.ABORTED)
        with h.frozen_core(st, D, PHASE_DEADLINE_S):
            d_load = _server_load(st, D)
            with OpenRequest(st.router_url, _body(fault_prompts.long)) as req:
                _wait_phase(st, "P answered", lambda: _finished(st, P) > p_done)
                _wait_phase(st, "D holds the D leg", lambda: _server_load(st, D) == d_load + 1)
                assert not req.answered()
                req.drop()
                _wait_phase(st, "router released the slot", lambda: _router(st).slots_in_use == 0)
                _wait_phase(
                    st, "D sent its core the abort", lambda: h.logged(d_log, h.ABORTED) > aborts
                )
        waited = _assert_idle_soon(st, "the disconnect")
        assert _disconnects(st) == drops + 1
        print(f"pull, dropped between P and D: idle after {waited:.1f}s")

    def test_prefill_killed_after_answer_fails_decode_read(
        self, pull_stack: Stack, fault_prompts: Prompts
    ) -> None:
        """P SIGKILLed after its answer, before D READs the blocks (D frozen meanwhile): D's READ
        fails, D streams an error event after its 200, the router relays it. Last pull test."""
        st = pull_stack
        p_done = _finished(st, P)
        p_pids = st.engine_pids(P)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with h.frozen_core(st, D, PHASE_DEADLINE_S):
                d_load = _server_load(st, D)
                future = pool.submit(_ask, st, fault_prompts.short)
                _wait_phase(st, "P answered", lambda: _finished(st, P) > p_done)
                _wait_phase(st, "D holds the D leg", lambda: _server_load(st, D) == d_load + 1)
                st.signal_engine(P, signal.SIGKILL)
                _wait_phase(st, "P gone", lambda: not any(map(h.alive, p_pids)))
            thawed_at = time.monotonic()
            answer = future.result(timeout=TIMEOUTS["total"])
        assert answer.status == 200 and answer.content_type.startswith("text/event-stream")
        events = answer.events()
        errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
        assert len(errors) == 1 and errors[0]["code"] == 500, answer.text
        assert not any('"choices"' in e for e in events), "tokens without the KV"
        assert answer.ended_at - thawed_at < TIMEOUTS["decode_first_byte"]
        waited = _assert_idle_soon(st, "the failed READ", engines=(D,))
        assert _router(st).degraded == 0
        print(
            f"pull, P killed before D's READ: error after {answer.elapsed:.1f}s, idle {waited:.1f}s"
        )
