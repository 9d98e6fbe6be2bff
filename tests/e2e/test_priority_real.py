"""Priority classes on real engines (issue 41): the router's priorities reach engines started
with ``--scheduling-policy priority`` and reorder their waiting queues; engines without it
never receive a priority.

Two of the run's stacks (tests/engine_stacks.py), each through a second router with two
classes, ``interactive`` (vLLM priority -5) and ``batch`` (5, the default class):

* pull: P and D schedule by priority (``engine_stacks.PRIORITY``), the router has
  ``engine_priority_scheduling: true``. P's core is frozen while twelve batch prompts and
  then one interactive prompt reach P's API server; once thawed, vLLM's priority queue
  prefills the interactive prompt before the batch prompts still waiting, so its answer and
  its first token come before theirs. The control, the same race through a router that
  removes ``priority`` from the legs (``engine_priority_scheduling`` false), has P answer it
  last, in arrival order. Both legs' priorities are checked; only P's queue is raced (D gets
  each request as P answers it, so its queue holds no crowd to reorder).
* push: plain FCFS engines, ``engine_priority_scheduling`` false: a request of the
  interactive class, named by the header or by the body's ``priority``, is served and
  neither leg carries a ``priority``.

What each engine received is read from a pass-through proxy in front of it (``Recorder``, in
this process; the router's config names it instead of the engine): vLLM 0.32 logs no request's
priority (``--enable-log-requests`` prints its SamplingParams, which hold none), and it does not
refuse a non-zero priority on an FCFS engine either (no check of the scheduling policy in its
API server or input processor: ``vllm/entrypoints/generate/base/serving.py``'s
``_get_priority`` passes the body's value on; the ``priority`` field's description in
``vllm/entrypoints/openai/completion/protocol.py`` says it would), so neither an engine's log
nor its status code can show what the router sent.

Timing is decided by the test, never by a sleep: P's core stays frozen until its API server
holds every request (``/load``, ``--enable-server-load-tracking``) and has handed each to the
core (its ``Added request`` log lines, ``--enable-log-requests``); after the thaw the core's
input thread hands the requests to the scheduler a few milliseconds apart, so the order is
asserted with a margin of several engine steps (``MARGIN``), not to the first place.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from router.stack import RoutedStack, Stack, ensure_model
from tests.e2e import helpers as h
from tests.engine_stacks import P_MAX_MODEL_LEN, Running
from tests.fakes.servers import serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "tiny"
P, D = "prefill-0", "decode-0"
INTERACTIVE, BATCH = -5, 5  # vLLM priorities: lower is served first
ADMISSION: dict[str, Any] = {
    "priority_classes": {"interactive": {"priority": INTERACTIVE}, "batch": {"priority": BATCH}},
    "default_priority_class": "batch",
}
# vLLM's CPU API server prefills at most 2048 tokens a step (max_num_batched_tokens): about
# 1.5 of these prompts, so twelve take eight steps or more.
PROMPT_TOKENS = 1400
BATCHES = 12
# Batch prompts whose answers (and first tokens) must come after the interactive one's. In
# arrival order it comes after all twelve (the control); with the priority queue after 0-2
# (measured: the core's input thread may hand the interactive request over a step after the
# first batch ones, each step ~1.5 prompts): six leaves about three steps of slack and still
# fails arrival order.
MARGIN = 6
MAX_TOKENS = 2
COMPLETIONS = "/v1/completions"
PHASE_DEADLINE_S = 30.0  # waits for a state that must come; each returns as soon as it holds
ANSWER_DEADLINE_S = 120.0
assert PROMPT_TOKENS < P_MAX_MODEL_LEN


# -- what the engines receive --------------------------------------------------------------


@dataclass
class Leg:
    """A POST the router sent an engine: its path and JSON body, and when (monotonic) the
    engine's answer to it ended (None until then)."""

    path: str
    body: dict[str, Any]
    answered_at: float | None = None


class Recorder:
    """A pass-through HTTP proxy in front of one engine, on a thread of the test process: it
    forwards every request and answer as they are (streams chunk by chunk) and keeps each
    JSON POST it forwarded (``legs``)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.url = ""
        self._legs: list[Leg] = []
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop
        self._stop: asyncio.Event

    def mark(self) -> int:
        """Where the legs forwarded from now on begin (``legs``' ``since``)."""
        return len(self._legs)

    def legs(self, *, since: int = 0, prompt: str | None = None) -> list[Leg]:
        """The completions forwarded since ``since``, those of ``prompt`` if given (the router
        also asks an engine to ``/tokenize`` a prompt: not a leg)."""
        legs = [leg for leg in self._legs[since:] if leg.path == COMPLETIONS]
        return [leg for leg in legs if prompt is None or leg.body["prompt"] == prompt]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http" and self._client is not None
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        skip = (b"host", b"content-length", b"connection", b"transfer-encoding")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in skip]
        query = scope.get("query_string", b"").decode()
        url = f"{self.target}{scope['path']}" + (f"?{query}" if query else "")
        request = self._client.build_request(scope["method"], url, headers=headers, content=body)
        leg = None
        if scope["method"] == "POST" and body.startswith(b"{"):
            leg = Leg(scope["path"], json.loads(body))
            self._legs.append(leg)  # before it is sent: the engine's answer cannot come first
        response = await self._client.send(request, stream=True)
        try:
            out = [(k, v) for k, v in response.headers.raw if k.lower() not in skip[2:]]
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": out})  # fmt: skip
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()
            if leg is not None:
                leg.answered_at = time.monotonic()

    async def run(self, started: threading.Event) -> None:
        """Serve until :meth:`stop`; ``started`` is set once ``url`` answers."""
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with httpx.AsyncClient(timeout=None) as client:
            self._client = client
            async with serve(self, lifespan="off") as url:
                self.url = url
                started.set()
                await self._stop.wait()

    def stop(self) -> None:
        """From another thread: ends :meth:`run`."""
        self._loop.call_soon_threadsafe(self._stop.set)


@contextlib.contextmanager
def recording(target: str) -> Iterator[Recorder]:
    """A :class:`Recorder` in front of ``target``, served on a thread until the block ends."""
    recorder = Recorder(target)
    started = threading.Event()
    thread = threading.Thread(target=asyncio.run, args=(recorder.run(started),), daemon=True)
    thread.start()
    try:
        assert started.wait(30), f"no proxy in front of {target}"
        yield recorder
    finally:
        if started.is_set():
            recorder.stop()
        thread.join(10)


@dataclass(frozen=True)
class Routed:
    """A stack's engines through a router of this module, each engine behind a recorder."""

    stack: RoutedStack
    recorders: dict[str, Recorder]


@contextlib.contextmanager
def _routed(running: Running, name: str, *, engine_priority: bool) -> Iterator[Routed]:
    """The stack's engines, each behind a :class:`Recorder`, through a router ``name`` with
    ``ADMISSION``'s classes, for the block: router and recorders stop at its end, so no later
    test's engine restart reloads a router whose config names them."""
    stack: Stack = running.stack
    with recording(stack.engine(P).url) as p_rec, recording(stack.engine(D).url) as d_rec:
        base = stack.router_config()["models"][0]
        prefill = [{**e, "url": p_rec.url} for e in base["prefill"]]
        decode = [{**e, "url": d_rec.url} for e in base["decode"]]
        assert len(prefill) == len(decode) == 1
        model = {"engine_priority_scheduling": engine_priority, "prefill": prefill,
                 "decode": decode}  # fmt: skip
        router = stack.start_router(
            name, router_overrides={"admission": ADMISSION}, model_overrides=model
        )
        try:
            yield Routed(RoutedStack(stack, router), {P: p_rec, D: d_rec})
        finally:
            stack.stop_router(router)


@pytest.fixture(scope="module")
def long_prompts(engines_available: None) -> list[str]:
    tokenizer = ensure_model(MODEL) / "tokenizer.json"
    return h.prompts_of_lengths(tokenizer, [PROMPT_TOKENS] * (BATCHES + 1))


# -- clients and engines ----------------------------------------------------------------


@dataclass(frozen=True)
class Streamed:
    """A streamed completion as its client saw it."""

    status: int
    first_token_at: float | None  # monotonic
    text: str
    finish_reason: str | None = None

    @property
    def whole(self) -> bool:
        """200, and streamed to its end (``MAX_TOKENS`` tokens: ``ignore_eos``)."""
        return self.status == 200 and self.finish_reason == "length"


def _body(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, **extra}  # fmt: skip


def _stream(url: str, body: dict[str, Any], headers: dict[str, str]) -> Streamed:
    """POST a streamed ``/v1/completions``; when its first token came, and its text."""
    first: float | None = None
    parts: list[str] = []
    finish: str | None = None
    with httpx.stream(
        "POST", f"{url}{COMPLETIONS}", json=body, headers=headers, timeout=ANSWER_DEADLINE_S
    ) as r:
        if r.status_code != 200:
            r.read()
            return Streamed(r.status_code, None, r.text)
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line.removeprefix("data: ")).get("choices", []):
                first = first or time.monotonic()
                parts.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
    return Streamed(r.status_code, first, "".join(parts), finish)


def _server_load(stack: RoutedStack, name: str) -> float:
    """Requests engine ``name``'s API server holds (``--enable-server-load-tracking``)."""
    load = httpx.get(f"{stack.engine(name).url}/load", timeout=5).json()["server_load"]
    return float(load)


def _wait(what: str, probe: Any) -> None:
    ok, _, _ = h.wait_until(lambda: (bool(probe()), what), PHASE_DEADLINE_S, every_s=0.05)
    assert ok, f"not within {PHASE_DEADLINE_S} s: {what}"


# -- pull: engines that schedule by priority ---------------------------------------------


@dataclass(frozen=True)
class Race:
    """Twelve batch requests and one interactive one, as ``_race`` saw them."""

    answers: list[Streamed]  # the batch requests', then the interactive one's
    p_before: int  # batch prompts P answered before the interactive one
    client_before: int  # batch requests whose first token came before the interactive one's
    waited_s: float  # the thirteen requests' summed wait for a decode slot in the router
    legs: dict[str, list[Leg]]  # by engine: the legs of the thirteen requests it received


def _race(routed: Routed, prompts: list[str]) -> Race:
    """The batch prompts (``prompts[:-1]``, the default class), then the interactive one
    (``prompts[-1]``, by ``x-priority``), each streamed by a client of its own through the
    router while P's core is frozen. Each phase ends when P's API server holds the
    requests and has handed them to its core; the router must then have given all thirteen
    a decode slot at once (none in its queue). The core is thawed once P holds them all, so
    they wait in P's queue together; returns once every answer has ended."""
    st, rec = routed.stack, routed.recorders
    *batch, interactive = prompts
    marks = {name: r.mark() for name, r in rec.items()}
    before = st.router_metrics()
    p_log = st.log_path(P)
    added, load = h.logged(p_log, h.ADDED), _server_load(st, P)

    def p_holds(n: int) -> bool:
        return _server_load(st, P) == load + n and h.logged(p_log, h.ADDED) >= added + n

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        with h.frozen_core(st.stack, P, PHASE_DEADLINE_S):
            futures = [pool.submit(_stream, st.router_url, _body(p), {}) for p in batch]
            _wait("P holds every batch request", lambda: p_holds(len(batch)))
            header = {"x-priority": "interactive"}
            futures.append(pool.submit(_stream, st.router_url, _body(interactive), header))
            _wait("P holds the interactive request", lambda: p_holds(len(prompts)))
            held = st.router_metrics()
            assert held.total("pdrouter_decode_slots_in_use") == len(prompts)
            assert held.total("pdrouter_queue_depth") == 0
        answers = [f.result(ANSWER_DEADLINE_S) for f in futures]
    after = st.router_metrics()

    for answer in answers:
        assert answer.whole and answer.first_token_at is not None, answer
    legs = {name: r.legs(since=marks[name]) for name, r in rec.items()}
    for name, got in legs.items():
        assert sorted(leg.body["prompt"] for leg in got) == sorted(prompts), f"{name}'s legs"
    p_done = {leg.body["prompt"]: leg.answered_at or math.inf for leg in legs[P]}
    firsts = [a.first_token_at or 0.0 for a in answers]
    wait_sum = "pdrouter_priority_queue_wait_seconds_sum"
    return Race(
        answers,
        p_before=sum(p_done[p] < p_done[interactive] for p in batch),
        client_before=sum(t < firsts[-1] for t in firsts[:-1]),
        waited_s=h.delta(after, before, wait_sum),
        legs=legs,
    )


@pytest.mark.parametrize("engine_stack", ["pull"], indirect=True)
def test_interactive_prompt_overtakes_waiting_batch_prompts(
    engine_stack: Running, long_prompts: list[str]
) -> None:
    """Twelve batch prompts, then one interactive prompt, all held by P's API server while
    P's core is frozen (``_race``), so all thirteen wait in P's queue together when it runs:
    P answers the interactive prompt before at least ``MARGIN`` of the batch prompts, and its
    first token reaches its client before theirs; in arrival order it comes last (the next
    test, the control).

    The router reorders nothing: it gave each request a decode slot and its P leg at once
    (64 slots; none queued, every one in P's API server before the thaw). Both legs of each
    request carried its class's value (the recorders), and every answer is whole."""
    with _routed(engine_stack, "priority", engine_priority=True) as routed:
        race = _race(routed, long_prompts)
    *batch, interactive = long_prompts
    assert race.waited_s < 1.0, f"{race.waited_s:.3f} s in the router's queue in all"
    want = {**dict.fromkeys(batch, BATCH), interactive: INTERACTIVE}
    for name, legs in race.legs.items():
        got = {leg.body["prompt"]: leg.body.get("priority") for leg in legs}
        assert got == want, f"{name}'s legs carried other priorities"
    print(
        f"interactive: P answered it after {race.p_before} of {BATCHES} batch prompts, "
        f"its first token came after {race.client_before}"
    )
    assert race.p_before <= BATCHES - MARGIN, f"P answered {race.p_before} batch prompts first"
    assert race.client_before <= BATCHES - MARGIN, (
        f"{race.client_before} batch first tokens came first"
    )


@pytest.mark.parametrize("engine_stack", ["pull"], indirect=True)
def test_without_engine_priorities_the_interactive_prompt_waits_its_turn(
    engine_stack: Running, long_prompts: list[str]
) -> None:
    """The control: the same race through a router with the same classes and
    ``engine_priority_scheduling`` false, so no leg carries a priority and the engines run
    every request at priority 0, i.e. in arrival order: P answers the interactive prompt
    after more than ``BATCHES - MARGIN`` batch prompts (last, or with the last batch prompt
    in its final step), so the test above fails where the priorities do not reach P."""
    with _routed(engine_stack, "fcfs", engine_priority=False) as routed:
        race = _race(routed, long_prompts)
    for name, legs in race.legs.items():
        assert not [leg.body["priority"] for leg in legs if "priority" in leg.body], name
    print(f"no priorities: P answered the interactive prompt after {race.p_before} batch ones")
    assert race.p_before > BATCHES - MARGIN


# -- push: engines without priority scheduling -------------------------------------------


@pytest.mark.parametrize("engine_stack", ["push"], indirect=True)
def test_engines_without_priority_scheduling_get_no_priority(engine_stack: Running) -> None:
    """``engine_priority_scheduling`` false: requests of the interactive class (value -5),
    named by the ``x-priority`` header or by the body's ``priority``, and of the default batch
    class are served (200, whole answers), and neither P's nor D's leg of any of them carries
    a ``priority`` (the recorders in front of the engines)."""
    asked = {
        "by header": (_body("priority by header"), {"x-priority": "interactive"}),
        "by body": (_body("priority by body", priority=INTERACTIVE), {}),
        "default class": (_body("no priority given"), {}),
    }
    with _routed(engine_stack, "priority", engine_priority=False) as routed:
        answers = {what: _stream(routed.stack.router_url, *asked[what]) for what in asked}
    for what, (body, _) in asked.items():
        assert answers[what].whole, (what, answers[what])
        for name, recorder in routed.recorders.items():
            legs = recorder.legs(prompt=body["prompt"])
            assert len(legs) == 1, f"{what}: {len(legs)} legs on {name}"
            assert "priority" not in legs[0].body, (what, name, legs[0].body["priority"])
