"""The stack's real model, SmolLM2-135M-Instruct, through the router in every P/D mode: a chat
answer that is right, and that is exactly what one engine alone answers (greedy, natural stop).

The random-weight model of the other tests shows the KV moved intact; this one shows that a
real checkpoint (converted from the package's GGUF file) keeps its quality across the handoff.
"One engine alone" is each stack's D asked directly, without ``kv_transfer_params``: an
ordinary local request, the whole prompt computed there.
"""

from __future__ import annotations

from typing import Any

import pytest

from router.stack import Stack
from router.stack.model import kv_bytes_per_token
from tests.e2e import helpers as h
from tests.engine_stacks import Running

# One stack per mode; the reference is D alone on each (no aggregated engine of its own).
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.parametrize(
        "engine_stack",
        ["smol-pull", "smol-push", "smol-pipelined"],
        indirect=True,
        ids=["pull", "push", "pipelined"],
    ),
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG = [{"role": "user", "content": "Tell me about the Eiffel Tower. " * 60}]  # ~500 tokens


def ask(stack_url: str, model: str, messages: list[dict[str, str]], stream: bool) -> str:
    """A greedy chat answer of at most 32 tokens, ending where the model stops."""
    client = h.client_for(stack_url)
    kwargs: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 32}
    if not stream:
        return (
            client.chat.completions.create(temperature=0, **kwargs).choices[0].message.content or ""
        )
    chunks = client.chat.completions.create(temperature=0, stream=True, **kwargs)
    return "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)


@pytest.fixture
def stack(engine_stack: Running) -> Stack:
    st: Stack = engine_stack.stack
    assert st.model_path is not None and kv_bytes_per_token(st.model_path) == 23040
    return st


@pytest.fixture
def answers(engine_stack: Running, stack: Stack) -> dict[str, str]:
    """What D answers alone (a request without ``kv_transfer_params`` is an ordinary local
    one, prefix caching off): one engine's answers, computed once per stack."""

    def make(_: object) -> dict[str, str]:
        url = stack.decode.url
        return {
            "question": ask(url, stack.model_name, QUESTION, stream=False),
            "long": ask(url, stack.model_name, LONG, stream=False),
        }

    made: dict[str, str] = engine_stack.shared("one-engine-answers", make)
    return made


def test_the_real_model_answers_right(answers: dict[str, str]) -> None:
    assert "Paris" in answers["question"], answers


@pytest.mark.parametrize("stream", [False, True])
def test_pd_answers_what_one_engine_answers(
    stack: Stack, answers: dict[str, str], stream: bool
) -> None:
    for name, messages in (("question", QUESTION), ("long", LONG)):
        got = ask(stack.router_url, stack.model_name, messages, stream)
        assert got == answers[name], f"{stack.mode.value} {name}: {got!r}"
