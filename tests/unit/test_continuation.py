"""router/pd/continuation.py: which requests migrate, a continuation's body, and the events a
client gets across legs (pure functions)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import orjson
import pytest

from router.client_request import ClientRequest, Endpoint, parse_client_request
from router.config import MigrationConfig, parse_config
from router.pd.continuation import continuation, refusal, with_token_ids
from router.pd.progress import Progress, null_ids

COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 10, "stream": True}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def creq(body: dict[str, Any], endpoint: Endpoint = Endpoint.COMPLETIONS) -> ClientRequest:
    return parse_client_request(json.dumps(body).encode(), endpoint)


def test_migration_config_defaults_and_bounds() -> None:
    assert MigrationConfig().max_attempts == 2 and MigrationConfig().enabled
    assert not MigrationConfig(max_attempts=0).enabled
    base = {"models": [{"name": "m", "mode": "aggregated", "decode": [{"url": "http://d"}]}]}
    for bad in ({"max_attempts": -1}, {"stall_timeout": 0}, {"stall_timeout": float("inf")}):
        with pytest.raises(Exception, match="migration"):
            parse_config({**base, "migration": bad})


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({}, None),
        ({"temperature": 0, "seed": 3, "stop_token_ids": [7]}, None),
        ({"stream": False}, "not_streamed"),
        ({"n": 2}, "n"),
        ({"best_of": 3}, "n"),
        ({"logprobs": 0}, "logprobs"),  # a completion's 0 asks for the sampled token's
        ({"stop": "x"}, "stop_strings"),
        ({"stop": []}, None),
        ({"frequency_penalty": 0.1}, "penalties"),
        ({"frequency_penalty": 0}, None),
        ({"echo": True}, "echo"),
        ({"response_format": {"type": "json_object"}}, "structured_output"),
        ({"prompt": ["a", "b"]}, "prompts"),
        ({"stream_options": {"continuous_usage_stats": True}}, "continuous_usage"),
    ],
)
def test_refusals(extra: dict[str, Any], reason: str | None) -> None:
    assert refusal(creq({**COMPLETION, **extra}), kept_turns=False) == reason


def test_non_streamed_requests_only_when_asked() -> None:
    whole = creq({**COMPLETION, "stream": False})
    assert refusal(whole, kept_turns=False) == "not_streamed"
    assert refusal(whole, kept_turns=False, non_streamed=True) is None
    asked = with_token_ids(whole)  # streamed to the router, with its usage
    assert asked.stream and asked.body["stream"] is True
    assert asked.body["stream_options"] == {"include_usage": True}
    assert MigrationConfig().non_streamed is False


def test_kept_turns_and_other_endpoints_are_refused() -> None:
    assert refusal(creq(COMPLETION), kept_turns=True) == "kept_turns"
    assert refusal(creq(CHAT, Endpoint.CHAT), kept_turns=False) is None
    responses = creq({"model": "m", "input": "hi", "stream": True}, Endpoint.RESPONSES)
    assert refusal(responses, kept_turns=False) == "endpoint"


def _event(doc: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    raw = b"data: " + orjson.dumps(doc)
    return raw, doc


def test_a_chat_continues_as_a_completion_of_its_template_ids() -> None:
    body = {**CHAT, "max_completion_tokens": 8, "min_tokens": 5, "chat_template_kwargs": {}}
    c = with_token_ids(creq(body, Endpoint.CHAT))
    progress = Progress.of(creq(body, Endpoint.CHAT))
    head = {"id": "chatcmpl-1", "created": 5, "model": "m", "object": "chat.completion.chunk"}
    role = {**head, "prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {}}]}
    token = {**head, "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [9]}]}
    for doc in (role, token, token):
        out = progress.first_leg(*_event(doc))
        assert b"[1, 2]" not in out and b"[9]" not in out  # null for a client that did not ask
    cont = continuation(c, progress)
    assert cont.endpoint is Endpoint.COMPLETIONS and cont.stream
    assert cont.body["prompt"] == [1, 2, 9, 9]
    assert cont.body["max_tokens"] == 6 and cont.body["min_tokens"] == 3
    assert cont.body["return_token_ids"] is True
    assert not {"messages", "max_completion_tokens", "chat_template_kwargs"} & set(cont.body)


def test_a_continuation_keeps_its_class_but_not_its_ttft_deadline() -> None:
    """The deadline was the first token's, met: a continuation that waits for a slot must not
    be refused for it (router/priority.py)."""
    c = dataclasses.replace(
        creq(COMPLETION), priority_class="gold", ttft_deadline_ms=100.0, deadline_at=1.0
    )
    progress = Progress.of(c)
    progress.prompt_ids = [1]
    cont = continuation(c, progress)
    assert cont.priority_class == "gold"
    assert cont.deadline_at is None and cont.ttft_deadline_ms is None


def test_a_continuations_events_look_like_the_first_legs() -> None:
    body = {**COMPLETION, "stream_options": {"include_usage": True}}
    progress = Progress.of(creq(body))
    first = {
        "id": "cmpl-1",
        "created": 5,
        "model": "m",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "a", "prompt_token_ids": [1, 2, 3], "token_ids": [9]}],
    }
    progress.first_leg(*_event(first))
    progress.legs = 2
    chunk = {
        "id": "cmpl-2",
        "created": 6,
        "model": "m",
        "choices": [{"index": 0, "text": "b", "token_ids": [8], "finish_reason": "length"}],
    }
    out = progress.continued(chunk)
    assert (out["id"], out["created"], out["choices"][0]["text"]) == ("cmpl-1", 5, "b")
    assert out["choices"][0]["token_ids"] is None
    usage = progress.continued({"id": "x", "choices": [], "usage": {"prompt_tokens": 5}})
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert progress.closing_events() == []  # final chunk and usage already sent


def test_an_answer_cut_after_its_last_token_is_closed_with_its_usage() -> None:
    progress = Progress.of(creq({**COMPLETION, "stream_options": {"include_usage": True}}))
    doc = {
        "id": "c",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "a", "prompt_token_ids": [1], "token_ids": [2]}],
    }
    progress.first_leg(*_event(doc))
    final, usage = progress.closing_events()
    assert final["choices"][0]["finish_reason"] == "length"
    assert usage["usage"]["completion_tokens"] == 1


def test_text_without_ids_cannot_be_continued() -> None:
    progress = Progress.of(creq(COMPLETION))
    progress.first_leg(*_event({"id": "c", "choices": [{"index": 0, "text": "a"}]}))
    assert not progress.resumable


def test_null_ids_touches_only_the_id_lists() -> None:
    event = b'{"text":"token_ids\\":[1]","prompt_token_ids": [1, 2],"token_ids":[3],"n":[4]}'
    assert null_ids(event) == (
        b'{"text":"token_ids\\":[1]","prompt_token_ids": null,"token_ids":null,"n":[4]}'
    )
    assert json.loads(null_ids(event))["text"] == 'token_ids":[1]'


@pytest.mark.parametrize("client_ids", [False, True])
def test_an_answer_without_ids_is_relayed_and_ended_as_it_came(client_ids: bool) -> None:
    """An engine that ignores ``return_token_ids``: the answer is not resumable, each event
    is relayed as D sent it (ids it sent anyway made null unless asked), and ``[DONE]`` and an
    error event are still found (a text that reads "[DONE]" is no end)."""
    body = {**COMPLETION, "return_token_ids": True} if client_ids else COMPLETION
    progress = Progress.of(creq(body))
    events = [
        b'data: {"id":"c","choices":[{"index":0,"text":"a","finish_reason":null}]}',
        b'data: {"id":"c","choices":[{"index":0,"text":"[DONE]","token_ids":[4]}]}',
        b'data: {"id":"c","choices":[{"index":0,"text":"","finish_reason":"length"}]}',
    ]
    out, done, error = progress.client_bytes(events)
    ids = b"[4]" if client_ids else b"null"
    assert out == b"".join(e + b"\n\n" for e in events).replace(b"[4]", ids)
    assert (done, error, progress.resumable) == (False, None, False)
    assert progress.client_bytes([b"data: [DONE]", b"data: {}"]) == (b"", True, None)
    error_event = b'data: {"error":{"message":"boom"}}'
    assert progress.client_bytes([error_event]) == (b"", False, error_event + b"\n\n")
