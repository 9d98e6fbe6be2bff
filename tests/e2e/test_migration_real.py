"""Mid-stream migration on real engines (issue 40): D killed or frozen mid-answer.

The shared pull and pipelined stacks (tests/engine_stacks.py: one P, one D), through a second
router with migration on (``ROUTER``: ``non_streamed`` too, a short ``stall_timeout``, health
checks every 0.5 s). A greedy completion of ``TOKENS`` tokens is asked once uninterrupted,
then again while D fails after ``K`` tokens:

* ``kill``: D (every process of it) SIGKILLed: its stream to the router breaks (cause
  ``disconnect``);
* ``stall``: D's EngineCore kept frozen (SIGSTOP): its API server keeps the connection open and
  sends nothing, and the router's ``stall_timeout`` cuts it (cause ``stall``).

The timing is the test's, never a sleep's: D's core is frozen before the request is sent and
let run in short slices (``FrozenCore.step_until``) until the client has received ``K`` tokens
(streamed) or D's API server has counted ``K`` generated tokens (non-streamed: the client gets
nothing before the end); the fault comes while the core is stopped, far from the answer's end.

Where the continuation runs: the stacks have one D, and never more than two engines run at
once on the two cores, so no other D can take it. The router's rule for that case
(``migration.prefill_alone``, on by default) gives it to the P as an engine alone, the
``prefill_alone`` decision of the adaptive rule: the prompt's ids and the generated ones,
without ``kv_transfer_params``; P is a whole vLLM engine. A third engine, a second D, would
cost a start of about a minute per stack and a third engine process on two cores; the P-alone
path costs nothing to set up and is what a 1P1D deployment gets.

Checked: the client's answer (text, token ids, finish reason) equals the uninterrupted one
token for token; one migration with the fault's cause, served by P alone; afterwards no
decode slot is held and every live engine is idle (nothing running or waiting, no KV block;
the stacks have no prefix caching), the frozen D too once thawed (the router's close reached
its core as an abort); a killed D is restarted (``Stack.restart_engine``) and rejoins: the
router sees it healthy and the next request is decoded there.

Cases, crossed so each mode sees both faults and both kinds of answer: pull kill streamed, pull
stall non-streamed, pipelined kill non-streamed, pipelined stall streamed. Destructive, first
in their stacks' destructive stage: each killed D is restarted before the next test. Added CI
time on the shared stacks, measured on the 2-core development machine (2026-12-06, three runs):
the second router 1.5-2 s per stack; a kill case 35-46 s, of which D's restart 31-37 s (what
checking the rejoin costs); a stall case 7-16 s, of which ``stall_timeout`` 5 s. About 100 s
in all (39 + 12 s pull, 42 + 7.5 s pipelined in the last run).
"""

from __future__ import annotations

import concurrent.futures
import signal
from typing import Any

import pytest

from tests.e2e import helpers as h
from tests.e2e.conftest import AnyStack
from tests.engine_stacks import Running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.destructive(order=0)]

MODEL = "tiny"
P, D = "prefill-0", "decode-0"
TOKENS = 48  # the answer's length (greedy, ignore_eos)
K = 4  # tokens D gives before it fails
PROMPT = "The router moved the answer to another engine, and the client never noticed because"
# Long enough that D's answer never pauses that long between tokens while its core runs in
# slices (a gap of tens of ms a token here), short enough for CI.
STALL_S = 5.0
ROUTER: dict[str, Any] = {
    "migration": {"max_attempts": 2, "stall_timeout": STALL_S, "non_streamed": True},
    "health": {"interval": 0.5, "timeout": 2.0},
}
SLICE_S = 0.002  # a slice of D's core time: a fraction of one decode step
PHASE_S = 60.0  # for D to reach K tokens slice by slice
ANSWER_S = 120.0
IDLE_S = 30.0
REJOIN_S = 60.0
GENERATED = "vllm:generation_tokens_total"
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE, FINISHED = "vllm:kv_cache_usage_perc", "vllm:request_success_total"


def _streamed(mode: str, fault: str) -> bool:
    """The crossed cases: pull streams the killed D's answer and assembles the frozen one's,
    pipelined the other way round."""
    return (mode == "pull") == (fault == "kill")


def _router(engine_stack: Running) -> AnyStack:
    routed: AnyStack = engine_stack.routed("migration", router_overrides=ROUTER)
    return routed


class _Asker:
    """The client's request on a thread, counting the tokens it has received."""

    def __init__(self, url: str, stream: bool) -> None:
        self._client, self._stream = h.client_for(url), stream
        self.received = 0

    def ask(self) -> h.Output:
        if not self._stream:
            return h.complete(self._client, MODEL, PROMPT, stream=False, max_tokens=TOKENS)
        parts: list[str] = []
        ids: list[int] = []
        finish = None
        chunks = self._client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=TOKENS, stream=True, **h.GREEDY
        )
        for chunk in chunks:
            for choice in chunk.choices:
                parts.append(choice.text)
                ids.extend(h.token_ids(choice))
                finish = choice.finish_reason or finish
            self.received = len(ids)
        return h.Output("".join(parts), tuple(ids), finish)


def _generated(st: AnyStack, name: str) -> float:
    return st.engine_metrics(name).total(GENERATED)


def _cut_answer(st: AnyStack, fault: str, stream: bool) -> h.Output:
    """The request, with D failing (``fault``) once ``K`` of its tokens are out."""
    asker = _Asker(st.router_url, stream)
    base = _generated(st, D)
    with (
        h.frozen_core(st, D, PHASE_S) as core,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        answer = pool.submit(asker.ask)

        def reached() -> bool:
            return asker.received >= K if stream else _generated(st, D) >= base + K

        core.step_until(f"{K} tokens from {D}", reached, PHASE_S, SLICE_S)
        assert not answer.done(), "the answer ended before the fault"
        if fault == "kill":
            st.signal_engine(D, signal.SIGKILL)
        return answer.result(timeout=ANSWER_S)  # a stall: D stays frozen until the answer


def _idle(st: AnyStack, names: list[str]) -> tuple[bool, str]:
    """No decode slot held; nothing running or waiting and no KV block on ``names``."""
    slots = st.router_metrics().total("pdrouter_decode_slots_in_use")
    busy = {}
    for name in names:
        page = st.engine_metrics(name)
        busy[name] = (page.total(RUNNING), page.total(WAITING), page.total(KV_USAGE))
    return slots == 0 and not any(any(b) for b in busy.values()), f"slots {slots}, {busy}"


def _rejoins(st: AnyStack) -> None:
    """The restarted D is healthy in the router's view and decodes the next request."""

    def healthy() -> tuple[bool, str]:
        page = st.router_metrics()
        value = page.total("pdrouter_engine_healthy", role="decode")
        breaker = page.total("pdrouter_breaker_state", role="decode")
        return (value, breaker) == (1, 0), f"D healthy {value}, breaker {breaker}"

    ok, what, _ = h.wait_until(healthy, REJOIN_S, every_s=0.25)
    assert ok, what
    finished = st.engine_metrics(D).total(FINISHED, finished_reason="length")
    before = st.router_metrics()
    out = h.complete(h.client_for(st.router_url), MODEL, PROMPT, stream=True, max_tokens=4)
    assert out.finish_reason == "length"
    # Decoded whole by D: not continued elsewhere (a D that fails it mid-stream would be).
    assert h.delta(st.router_metrics(), before, "pdrouter_migrations_total") == 0
    page = h.settled(lambda: st.engine_metrics(D), FINISHED)
    done = page.total(FINISHED, finished_reason="length")
    assert done == finished + 1, "the next request was not decoded by D"


# Two decorators, not one of (stack, fault) pairs: pytest tears a session fixture down between
# two indirect parameters of different indices, even of the same value (a stack started twice).
@pytest.mark.parametrize("fault", ["kill", "stall"])
@pytest.mark.parametrize("engine_stack", ["pull", "pipelined"], indirect=True)
def test_a_d_failing_mid_answer_gives_the_uninterrupted_answer(
    engine_stack: Running, fault: str
) -> None:
    stream = _streamed(engine_stack.kind, fault)
    st = _router(engine_stack)
    client = h.client_for(st.router_url)
    want = h.complete(client, MODEL, PROMPT, stream=stream, max_tokens=TOKENS)
    assert len(want.token_ids) == TOKENS and want.finish_reason == "length"
    before = st.router_metrics()
    got = _cut_answer(st, fault, stream)
    after = st.router_metrics()
    assert got == want
    cause = "disconnect" if fault == "kill" else "stall"
    assert h.delta(after, before, "pdrouter_migrations_total") == 1
    assert h.delta(after, before, "pdrouter_migrations_total", cause=cause) == 1
    decisions = "pdrouter_disagg_decisions_total"
    assert h.delta(after, before, decisions, decision="prefill_alone") == 1
    live = [P] if fault == "kill" else [P, D]
    ok, what, _ = h.wait_until(lambda: _idle(st, live), IDLE_S, every_s=0.25)
    assert ok, f"left behind: {what}"
    if fault == "kill":
        took = st.restart_engine(D)
        print(f"{st.mode.value}: {D} restarted in {took:.1f}s")
        _rejoins(st)
        ok, what, _ = h.wait_until(lambda: _idle(st, [P, D]), IDLE_S, every_s=0.25)
        assert ok, f"left behind: {what}"
