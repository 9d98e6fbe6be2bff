"""Request and metrics helpers shared by the end-to-end tests (real engines, ``openai`` SDK)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from router.stack import Stack
from router.stack.metrics import MetricsPage
from tests.frozen import FrozenCore, frozen
from tests.frozen import alive as alive  # the suites read it as h.alive

# The random-weight model (served as "tiny"): the tests that need speed run on it; the stack's
# default is the real SmolLM2 model.
FAST = "tiny"

MAX_TOKENS = 24
# Greedy, fixed length, token ids in the response: what a token-for-token comparison needs.
GREEDY: dict[str, Any] = {
    "temperature": 0,
    "extra_body": {"ignore_eos": True, "return_token_ids": True},
}


@dataclass(frozen=True)
class Output:
    """What a request produced: generated text, generated token ids, finish reason."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None


def client_for(base_url: str) -> openai.OpenAI:
    """An SDK client without retries (a retry would hide a failure)."""
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="e2e", max_retries=0, timeout=120)


def complete(
    client: openai.OpenAI, model: str, prompt: str, *, stream: bool, max_tokens: int = MAX_TOKENS
) -> Output:
    """One ``/v1/completions`` request, streamed or not, reduced to an :class:`Output`."""
    if not stream:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **GREEDY)
        choice = r.choices[0]
        return Output(choice.text, token_ids(choice), choice.finish_reason)
    parts: list[str] = []
    ids: list[int] = []
    finish: str | None = None
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, stream=True, **GREEDY
    ):
        for choice in chunk.choices:
            parts.append(choice.text)
            ids.extend(token_ids(choice))
            finish = choice.finish_reason or finish
    return Output("".join(parts), tuple(ids), finish)


def chat(
    client: openai.OpenAI,
    model: str,
    messages: Sequence[dict[str, str]],
    *,
    stream: bool,
    max_tokens: int = MAX_TOKENS,
) -> Output:
    """One ``/v1/chat/completions`` request, streamed or not, reduced to an :class:`Output`."""
    msgs: Any = list(messages)
    if not stream:
        r = client.chat.completions.create(
            model=model, messages=msgs, max_tokens=max_tokens, **GREEDY
        )
        choice = r.choices[0]
        return Output(choice.message.content or "", token_ids(choice), choice.finish_reason)
    parts: list[str] = []
    ids: list[int] = []
    finish: str | None = None
    for chunk in client.chat.completions.create(
        model=model, messages=msgs, max_tokens=max_tokens, stream=True, **GREEDY
    ):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            ids.extend(token_ids(c))
            finish = c.finish_reason or finish
    return Output("".join(parts), tuple(ids), finish)


def token_ids(choice: Any) -> tuple[int, ...]:
    """vLLM's ``token_ids`` extension field (present because of ``return_token_ids``)."""
    extra = getattr(choice, "model_extra", None) or {}
    return tuple(extra.get("token_ids") or ())


def delta(after: MetricsPage, before: MetricsPage, name: str, **labels: str) -> float:
    """How much the summed samples ``name``{labels} grew between two scrapes."""
    return after.total(name, **labels) - before.total(name, **labels)


def wait_until(
    probe: Callable[[], tuple[bool, str]], timeout_s: float, every_s: float = 0.2
) -> tuple[bool, str, float]:
    """Poll ``probe`` (returning (done, description)) until done or ``timeout_s`` passes.

    Returns (done, last description, seconds waited).
    """
    start = time.monotonic()
    while True:
        done, what = probe()
        waited = time.monotonic() - start
        if done or waited >= timeout_s:
            return done, what, waited
        time.sleep(every_s)


def prompts_of_lengths(tokenizer_json: Path, lengths: Sequence[int]) -> list[str]:
    """Prompts of about ``lengths`` tokens each, cut from different places of a stdlib text."""
    import json as json_module

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    folder = Path(json_module.__file__).parent
    source = (folder / "decoder.py").read_text() + (folder / "encoder.py").read_text()
    ids = tok.encode(source).ids
    prompts = []
    for i, n in enumerate(lengths):
        start = (i * 211) % max(1, len(ids) - n)
        prompts.append(tok.decode(ids[start : start + n]))
    return prompts


def frozen_core(
    stack: Stack, name: str, deadline_s: float = 10.0
) -> AbstractContextManager[FrozenCore]:
    """Freeze engine ``name``'s EngineCore for the block (``tests.frozen.frozen``) and thaw it
    on exit, unless it was killed meanwhile.

    Only the core: the API server keeps accepting requests and answering ``/health``,
    ``/metrics`` and ``/load``; a request it accepts waits for the core, so nothing of it is
    computed and the engine cannot answer it until the core is thawed."""
    return frozen(name, stack.engine_core_pids(name), deadline_s)


# What vLLM's API server logs with --enable-log-requests: a request once it went to the core,
# an abort once it went to the core.
ADDED, ABORTED = "Added request", "Aborted request"


def logged(log: Path, what: str) -> int:
    """How often ``what`` (``ADDED``, ``ABORTED``, or one of those with a request id) is in an
    engine's log: a test that thaws a frozen core after the line appeared knows the core
    reads that request or abort first."""
    return log.read_text(errors="replace").count(what)


def settled(scrape: Callable[[], MetricsPage], name: str, timeout_s: float = 10.0) -> MetricsPage:
    """``scrape()`` once the total of ``name`` is the same in two scrapes 0.2 s apart (an
    engine counts a request's tokens as its answer goes out); fails the test if it is still
    moving after ``timeout_s``."""
    last = scrape()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = scrape()
        if now.total(name) == last.total(name):
            return now
        last = now
    raise AssertionError(f"{name} still changing after {timeout_s} s")


@dataclass(frozen=True)
class Reply:
    """A chat answer with, per generated token, the two best log-probabilities."""

    text: str
    token_ids: tuple[int, ...]
    top2: tuple[tuple[float, float], ...]


def chat_top2(client: openai.OpenAI, model: str, messages: Sequence[dict[str, str]]) -> Reply:
    """One greedy, non-streaming chat answer with its per-token top-2 log-probabilities."""
    msgs: Any = list(messages)
    r = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=2, **GREEDY
    )
    choice = r.choices[0]
    content = choice.logprobs.content if choice.logprobs is not None else None
    top2 = tuple((t.top_logprobs[0].logprob, t.top_logprobs[1].logprob) for t in (content or []))
    return Reply(choice.message.content or "", token_ids(choice), top2)


def chat_top2_streamed(
    client: openai.OpenAI, model: str, messages: Sequence[dict[str, str]]
) -> Reply:
    """``chat_top2``, streamed: the text, token ids and top-2 log-probabilities of every
    chunk, joined."""
    msgs: Any = list(messages)
    stream = client.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        **GREEDY,
    )
    text, ids, top2 = [], [], []
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            ids.extend(token_ids(choice))
            for t in (choice.logprobs.content if choice.logprobs else None) or []:
                top2.append((t.top_logprobs[0].logprob, t.top_logprobs[1].logprob))
    return Reply("".join(text), tuple(ids), tuple(top2))


NEAR_TIE = 0.1  # nats between the two best tokens: where KV computed elsewhere may flip it


def first_disagreement(got: Reply | Output, want: Reply) -> str | None:
    """None if ``got`` equals ``want`` token for token, or first differs where ``want``'s two
    best tokens were within ``NEAR_TIE`` (KV computed in another order, as any prefix cache
    reuses it, rounds differently: a near-tie may go the other way); else what differs."""
    for i, (g, w) in enumerate(zip(got.token_ids, want.token_ids, strict=False)):
        if g != w:
            best, second = want.top2[i]
            if best - second < NEAR_TIE:
                return None
            return f"token {i}: {g} != {w}, not a near-tie ({best:.3f} vs {second:.3f})"
    return None if got.token_ids == want.token_ids else "lengths differ"
