"""The adaptive rule (docs/policy.md) on real engines: a request it serves by one engine gets
exactly the answer that engine gives as an aggregated server.

A second router over a P/D stack's engines forces each single-engine choice (``single_engine``
names the engine; an SLO no load here can break leaves the choice to it alone), teaches the
rule its timings with one streamed request through P/D, then sends the conformance cases
(tests/e2e/conformance.py) and compares them field by field with the aggregated reference,
as ``test_pd_modes.test_conformance_with_single_engine`` does for P/D. The router's counters
say that every case was served by the forced engine, but for the load the rule must see: with
P forced, the second prompt of a two-prompt case (or conversation of a batch) finds the first
pending on P, and goes P/D.
"""

from __future__ import annotations

import pytest

from router.stack.metrics import scrape
from tests.e2e import conformance as cf
from tests.e2e import helpers as h
from tests.e2e.conftest import MODEL, AnyStack, Reference
from tests.engine_stacks import Running

# On the pull stack's engines. P alone also passed on the pipelined stack's (this project's
# connector serves a request without kv_transfer_params as a plain one) at 12 s a run: left out
# for CI time. The stack is parametrized on its own: in one parametrize with a direct argument,
# the stack's parameter would get function scope, and the stack would restart for every test.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(600),
    pytest.mark.parametrize("engine_stack", ["pull"], indirect=True),
]
# An SLO no request here can break: only which engine may serve alone decides.
SLO = {"ttft_ms": 3_600_000, "tpot_ms": 3_600_000}
FORCED = {"decode_alone": "decode", "prefill_alone": "prefill"}
DECISIONS = "pdrouter_disagg_decisions_total"


def _routed(engine_stack: Running, choice: str) -> AnyStack:
    adaptive = {"enabled": True, "single_engine": FORCED[choice], **SLO}
    routed: AnyStack = engine_stack.routed(
        f"adaptive-{choice}", model_overrides={"adaptive": adaptive}
    )
    return routed


@pytest.mark.parametrize("choice", ["decode_alone", "prefill_alone"])
def test_a_request_served_alone_answers_as_that_engine_aggregated(
    engine_stack: Running, reference: Reference, choice: str
) -> None:
    stack = _routed(engine_stack, choice)
    mode = stack.mode.value
    untaught = scrape(stack.router_url)
    # Without a step time yet (the warm-up did not stream), the rule sends this through P/D.
    h.complete(h.client_for(stack.router_url), MODEL, "teach the rule", stream=True)
    before = scrape(stack.router_url)
    assert h.delta(before, untaught, "pdrouter_route_choice_total", choice="pd") == 1
    diffs: list[str] = []
    for case in cf.CASES:
        want = reference.answers[case.name]
        got = cf.ask(stack.router_url, case)
        if got.status != want.status:
            diffs.append(f"{case.name}: status {got.status} != {want.status}")
        diffs += [f"{case.name}: {d}" for d in cf.differences(got.body, want.body)]
    after = scrape(stack.router_url)
    assert diffs == [], "\n".join(diffs[:40])
    assert h.delta(after, before, DECISIONS, decision=choice) > 0
    # The prompts of a two-prompt case are dispatched at once: with P forced, the second finds
    # the first pending on P, which is load, so it goes through P/D (docs/policy.md).
    pd = _extra_prompts() if choice == "prefill_alone" else 0
    assert h.delta(after, before, DECISIONS, decision=mode) == pd
    chosen = {
        c: h.delta(after, before, "pdrouter_route_choice_total", choice=c) for c in ("pd", *FORCED)
    }
    other = next(c for c in FORCED if c != choice)
    assert chosen["pd"] == pd and chosen[other] == 0 and chosen[choice] > 0, chosen
    _assert_released(stack)


def _extra_prompts() -> int:
    """Prompts of the cases beyond the first of each: those of completions with a list of
    prompts and of chat batches (one dispatch per conversation, all at once)."""
    return sum(_parts(c.body) - 1 for c in cf.CASES if c.body)


def _parts(body: dict[str, object]) -> int:
    """How many dispatches the router makes for ``body`` at once."""
    prompt, messages = body.get("prompt"), body.get("messages")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    if isinstance(messages, list) and messages and isinstance(messages[0], list):
        return len(messages)
    return 1


def _assert_released(stack: AnyStack) -> None:
    """Nothing held once the cases are answered: no decode slot, no leg, no stream."""
    ok, last, _ = h.wait_until(lambda: _router_idle(stack.router_url), timeout_s=10)
    assert ok, last


def _router_idle(url: str) -> tuple[bool, str]:
    page = scrape(url)
    held = {
        name: page.total(name)
        for name in ("pdrouter_decode_slots_in_use", "pdrouter_prefill_in_flight")
    }
    return all(v == 0 for v in held.values()), str(held)
