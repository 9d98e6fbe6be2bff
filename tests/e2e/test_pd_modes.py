"""Real vLLM P/D engines behind the router, per mode (pull, push, push-sequential, pipelined).

Each test runs once per mode on that mode's shared stack (``conftest.stack``; push-sequential
through a second router over the push engines). The aggregated single-engine outputs
(``conftest.reference``) are the ground truth. Counters an assertion reads after a request are
read once they have settled (engines count a request's tokens as its answer goes out), so a
"nothing recomputed" check cannot pass on a count not yet made.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
from openai import Stream
from openai.types import Completion

from router.stack.metrics import MetricsPage
from tests.e2e import conformance as cf
from tests.e2e import helpers as h
from tests.e2e.conftest import CONVERSATIONS, MODEL, ON_PD_MODES, AnyStack, Reference

# The first test of each mode also pays for starting engines (30-120 s on a busy 2-core box).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), ON_PD_MODES]

# What the engine that moves the KV counts: vLLM's NIXL connectors, or this project's.
NIXL_STATS = {
    "bytes": "vllm:nixl_bytes_transferred_sum",
    "transfers": "vllm:nixl_bytes_transferred_count",
    "failed": "vllm:nixl_num_failed_transfers_total",
}
PIPELINED_STATS = {
    "bytes": "vllm:pdr_bytes_written_total",
    "transfers": "vllm:pdr_writes_total",
    "failed": "vllm:pdr_failures_total",
}
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
GENERATED = "vllm:generation_tokens_total"
IDLE_DEADLINE_S = 5.0
MANY_TOKENS = 4000  # just under max_model_len (4096) minus the prompt
DISCONNECT_AFTER = 8  # events the client reads before it leaves
# D's slices of time while the client reads (a few make one of the tiny model's decode steps).
D_SLICE_S = 0.001


def _mismatches(got: list[h.Output], want: list[h.Output]) -> list[str]:
    return [
        f"#{i}: got {g.token_ids} {g.text!r}, want {w.token_ids} {w.text!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True))
        if (g.token_ids, g.text) != (w.token_ids, w.text)
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_completions_equal_single_engine(
    stack: AnyStack, reference: Reference, stream: bool
) -> None:
    client = h.client_for(stack.router_url)
    before = stack.engine_metrics("decode-0")
    got = [h.complete(client, MODEL, p, stream=stream) for p in reference.prompts]
    assert all(len(o.token_ids) == h.MAX_TOKENS for o in got), "token ids missing or truncated"
    assert _mismatches(got, reference.completions) == []
    _assert_prompts_came_over_nixl(stack, before, len(got))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_equal_single_engine(stack: AnyStack, reference: Reference, stream: bool) -> None:
    client = h.client_for(stack.router_url)
    before = stack.engine_metrics("decode-0")
    got = [h.chat(client, MODEL, c, stream=stream) for c in CONVERSATIONS]
    assert all(o.finish_reason == "length" for o in got)
    assert _mismatches(got, reference.chats) == []
    _assert_prompts_came_over_nixl(stack, before, len(got))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_responses_api_goes_through_p_where_the_mode_splits_it(
    stack: AnyStack, reference: Reference, stream: bool
) -> None:
    """``/v1/responses`` is disaggregated in pull and pipelined mode: D takes the prompt over
    NIXL. In push and push-sequential D serves it alone (router/pd/plans.py says why)."""
    body = {"model": MODEL, "input": reference.prompts[-1], "max_output_tokens": 4}
    body |= {"temperature": 0}  # sampling would move D's seeded generator for later tests
    before = stack.engine_metrics("decode-0")
    r = httpx.post(f"{stack.router_url}/v1/responses", json=body | {"stream": stream}, timeout=120)
    assert r.status_code == 200, r.text
    after = _settled(stack, "decode-0")
    from_p = h.delta(after, before, BY_SOURCE, source="external_kv_transfer")
    computed = h.delta(after, before, BY_SOURCE, source="local_compute")
    if stack.mode.value in ("pull", "pipelined"):
        assert from_p > 0 and computed <= 1, (from_p, computed)
    else:
        assert from_p == 0 and computed > 0, (from_p, computed)


def _assert_prompts_came_over_nixl(stack: AnyStack, before: MetricsPage, requests: int) -> None:
    """Every request went through P: D took its prompt from NIXL.

    D computes at most one prompt token per request itself: a 1-token prompt has nothing to
    transfer (vLLM always computes the last token), longer prompts arrive whole.
    """
    after = _settled(stack, "decode-0")
    assert h.delta(after, before, BY_SOURCE, source="external_kv_transfer") > 0
    assert h.delta(after, before, BY_SOURCE, source="local_compute") <= requests


def test_kv_crosses_over_nixl_and_decode_does_not_recompute(
    stack: AnyStack, reference: Reference
) -> None:
    """The transferring engine counts NIXL bytes; D takes the prompt from the transfer."""
    prompts = reference.prompts[-4:]  # 128..1500 tokens: at least one full KV block each
    before = {s.name: stack.engine_metrics(s.name) for s in stack.engines}
    client = h.client_for(stack.router_url)
    prompt_tokens = 0
    for prompt in prompts:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, **h.GREEDY)
        assert r.usage is not None
        prompt_tokens += r.usage.prompt_tokens
    after = {s.name: _settled(stack, s.name) for s in stack.engines}

    p, d = "prefill-0", "decode-0"
    # Pull: D READs from P. Push: P WRITEs into D. Only the initiator counts the bytes.
    mover = d if stack.mode.value == "pull" else p
    stats = PIPELINED_STATS if stack.mode.value == "pipelined" else NIXL_STATS
    moved = h.delta(after[mover], before[mover], stats["bytes"])
    assert moved >= prompt_tokens * _min_kv_bytes_per_token(), f"{mover} moved only {moved} B"
    assert h.delta(after[mover], before[mover], stats["transfers"]) >= len(prompts)
    for name in (p, d):
        assert h.delta(after[name], before[name], stats["failed"]) == 0
    # P computed every prompt token; D got them over NIXL and computed none of them.
    assert h.delta(after[p], before[p], BY_SOURCE, source="local_compute") == prompt_tokens
    assert h.delta(after[d], before[d], BY_SOURCE, source="external_kv_transfer") == prompt_tokens
    assert h.delta(after[d], before[d], BY_SOURCE, source="local_compute") == 0


def _min_kv_bytes_per_token() -> int:
    from router.stack.model import ensure_model, kv_bytes_per_token

    return kv_bytes_per_token(ensure_model(h.FAST))


def test_client_disconnect_mid_stream_frees_engines_and_slots(stack: AnyStack) -> None:
    """Closing a stream mid-way aborts both legs: engines idle again, router slots free.

    The test decides the timing: D's EngineCore is frozen before the request and let run in
    short slices (its API server, P, the router and the client run freely meanwhile) until the
    client has read 8 events, so D is at most a few tokens ahead of the client however busy
    the machine (left to run, D once generated 2000 of its tokens before a starved client had
    read 8). The client leaves while D is stopped; once the router has released the slot, D is
    thawed and has to stop at once.
    """
    idle_kv = {s.name: stack.engine_metrics(s.name).total(KV_USAGE) for s in stack.engines}
    d_before = stack.engine_metrics("decode-0")
    client = h.client_for(stack.router_url)
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        h.frozen_core(stack, "decode-0") as core,
    ):
        reading = pool.submit(_read_events, client, DISCONNECT_AFTER)
        slices = core.step_until(
            f"the client read {DISCONNECT_AFTER} events", reading.done, 120, D_SLICE_S
        )
        stream, finished = reading.result()
        d_frozen = h.settled(lambda: stack.engine_metrics("decode-0"), GENERATED)
        stream.close()
        ok, what, _ = h.wait_until(
            lambda: (_router_slots_in_use(stack.router_metrics()) == 0, "router slot held"),
            IDLE_DEADLINE_S,
        )
        assert ok, what
    assert finished == [None] * DISCONNECT_AFTER, f"stream ended before the disconnect: {finished}"
    ahead = h.delta(d_frozen, d_before, GENERATED)
    print(f"{stack.mode.value}: the client left after {slices} slices of D, {ahead:g} tokens made")
    assert ahead < MANY_TOKENS / 8, f"D generated {ahead} tokens before the disconnect"
    _wait_idle(stack, idle_kv)
    d_after = stack.engine_metrics("decode-0")
    # Not aborted, D would generate the remaining 7/8 or more after its thaw.
    assert h.delta(d_after, d_frozen, GENERATED) < MANY_TOKENS / 4


def _read_events(client: openai.OpenAI, n: int) -> tuple[Stream[Completion], list[str | None]]:
    """Opens a long stream and reads ``n`` events (or up to its end); returns the stream, still
    open, and the finish reasons read."""
    stream = client.completions.create(
        model=MODEL, prompt="Count: one two three", max_tokens=MANY_TOKENS, stream=True, **h.GREEDY
    )
    finished: list[str | None] = []
    for chunk in stream:
        finished.append(chunk.choices[0].finish_reason)
        if len(finished) == n or finished[-1] is not None:
            break
    return stream, finished


def _settled(stack: AnyStack, name: str) -> MetricsPage:
    """Engine ``name``'s metrics once its prompt-token counts by source have settled (the
    test fails if they keep moving)."""
    return h.settled(lambda: stack.engine_metrics(name), BY_SOURCE)


def _wait_idle(stack: AnyStack, idle_kv: dict[str, float]) -> None:
    def everything_idle() -> tuple[bool, str]:
        state = {s.name: _load(stack.engine_metrics(s.name)) for s in stack.engines}
        slots = _router_slots_in_use(stack.router_metrics())
        idle = all(
            running == 0 and waiting == 0 and kv <= idle_kv[name] + 1e-9
            for name, (running, waiting, kv) in state.items()
        )
        return idle and slots == 0, f"engines (running, waiting, kv)={state}, slots={slots}"

    idle, state, waited = h.wait_until(everything_idle, IDLE_DEADLINE_S)
    assert idle, f"not idle {waited:.1f}s after disconnect: {state}"


def _load(m: MetricsPage) -> tuple[float, float, float]:
    return m.total(RUNNING), m.total(WAITING), m.total(KV_USAGE)


def _router_slots_in_use(m: MetricsPage) -> float:
    """Sum of the router's decode-slots-in-use gauge over all instances (must exist)."""
    names = [n for n in m.names("slots_in_use") if not n.endswith("_created")]
    assert names, "router /metrics exposes no *slots_in_use gauge"
    return sum(m.total(n) for n in names)


def test_concurrent_requests_all_complete(stack: AnyStack, reference: Reference) -> None:
    """Four overlapping requests finish (push once hung here when P starved on a shared core)."""
    client = h.client_for(stack.router_url)
    prompts = reference.prompts[2:6]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(h.complete, client, MODEL, p, stream=True) for p in prompts]
        outputs = [f.result(timeout=60) for f in futures]
    assert [len(o.token_ids) for o in outputs] == [h.MAX_TOKENS] * len(prompts)
    assert {o.finish_reason for o in outputs} == {"length"}


def test_models_endpoint_lists_the_model(stack: AnyStack) -> None:
    client = h.client_for(stack.router_url)
    assert MODEL in [m.id for m in client.models.list().data]


def test_conformance_with_single_engine(
    stack: AnyStack, reference: Reference, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same raw requests as to one aggregated engine: the same answers, field by field
    (tests/e2e/conformance.py says what is left out and why); prints the table."""
    assert cf.unexercised(reference.answers) == [], "cases the reference does not exercise"
    rows, failures = [], []
    for case in cf.CASES:
        want = reference.answers[case.name]
        got = cf.ask(stack.router_url, case)
        diffs = [f"status {got.status} != {want.status}"] if got.status != want.status else []
        diffs += cf.differences(got.body, want.body)
        rows.append(
            f"| {stack.mode.value} | {case.name} | {case.path} | {want.status} | "
            f"{cf.compared_fields(want)} | {'same' if not diffs else 'DIFFERENT'} |"
        )
        failures += [f"{case.name}: {d}" for d in diffs]
    with capsys.disabled():
        print("\n| mode | case | endpoint | status | fields compared | result |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))
    assert not failures, "\n".join(failures[:40])
