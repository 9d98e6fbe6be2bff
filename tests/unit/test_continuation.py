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
from router.pd.progress import SETTLE_AT, Progress, null_ids

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


def _stream(chat: bool, spaced: bool, tokens: int = 6) -> list[bytes]:
    """A first leg's events as vLLM 0.32 writes them asked for ids (pydantic's compact JSON),
    or spaced as ``json.dumps`` writes them; texts that quote the keys the scan looks for."""
    texts = ['"finish_reason":"stop"', '"usage":{"x":1}', '"error"', 'token_ids":[7]', "[DONE]"]

    def dumps(doc: dict[str, Any]) -> bytes:
        return b"data: " + (json.dumps(doc).encode() if spaced else orjson.dumps(doc))

    def chunk(i: int, finish: str | None = None) -> dict[str, Any]:
        text = texts[i % len(texts)] if finish is None else ""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            choice["delta"] = {"content": text}
        else:
            choice.update(text=text, prompt_token_ids=[1, 2, 3] if i == 0 else None)
        choice["token_ids"] = [100 + i]
        doc: dict[str, Any] = {"id": "c-1", "created": 5, "model": "m", "choices": [choice]}
        if chat and i == 0:
            doc["prompt_token_ids"] = [1, 2, 3]
        return doc

    events = [dumps(chunk(i)) for i in range(tokens - 1)]
    events.append(dumps(chunk(tokens - 1, "length")))
    usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
    events.append(dumps({"id": "c-1", "created": 5, "model": "m", "choices": [], "usage": usage}))
    return events


def _recorded(progress: Progress) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(progress).items() if k != "pending"}


@pytest.mark.parametrize("tokens", [6, SETTLE_AT + 5])
@pytest.mark.parametrize("client_ids", [False, True])
@pytest.mark.parametrize("spaced", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_events_read_in_batches_record_what_reading_each_records(
    chat: bool, spaced: bool, client_ids: bool, tokens: int
) -> None:
    """The first leg's ordinary events are relayed at once and read later in batches
    (client_bytes, settle): the client gets the same bytes, and the same is recorded, as
    reading each event whole as it comes (first_leg); at most SETTLE_AT wait unread."""
    body = {**(CHAT if chat else COMPLETION), "stream_options": {"include_usage": True}}
    if client_ids:
        body["return_token_ids"] = True
    request = creq(body, Endpoint.CHAT if chat else Endpoint.COMPLETIONS)
    batched, each = Progress.of(request), Progress.of(request)
    waited = 0
    for event in _stream(chat, spaced, tokens):
        out, done, error = batched.client_bytes([event])
        assert (done, error) == (False, None)
        assert out == each.first_leg(event, json.loads(event[6:])) + b"\n\n"
        assert len(batched.pending) < SETTLE_AT
        waited = max(waited, len(batched.pending))
    assert waited == (0 if spaced else min(tokens - 2, SETTLE_AT - 1))  # compact ones wait
    batched.settle()
    assert _recorded(batched) == _recorded(each) and not batched.pending
    assert batched.generated == [100 + i for i in range(tokens)]
    assert batched.prompt_ids == [1, 2, 3] and batched.finish_reason == "length"


def test_an_event_the_scan_cannot_vouch_for_is_read_whole_after_those_before() -> None:
    """An event without ids among ordinary ones is read whole, after the ids relayed before
    it are recorded: an answer with text and no ids is then not resumable."""
    progress = Progress.of(creq(COMPLETION))
    first = (
        b'data: {"id":"c","choices":[{"index":0,"text":"a","prompt_token_ids":[1],'
        b'"token_ids":[2],"finish_reason":null}]}'
    )
    events = [
        first,
        b'data: {"id":"c","choices":[{"index":0,"text":"b","token_ids":[3],"finish_reason":null}]}',
        b'data: {"id":"c","choices":[{"index":0,"text":"c","finish_reason":null}]}',
        b'data: {"id":"c","choices":[{"index":0,"text":"d","token_ids":[5],"finish_reason":null}]}',
    ]
    progress.client_bytes(events)
    assert progress.pending == [b"5"] and progress.generated == [2, 3] and not progress.usable
    assert not progress.resumable and progress.generated == [2, 3, 5] and not progress.pending
    cut = Progress.of(creq(COMPLETION))
    cut.client_bytes(events[:2])
    assert cut.resumable and cut.generated == [2, 3]
    assert continuation(creq(COMPLETION), cut).body["prompt"] == [1, 2, 3]


ORDINARY = (
    b'data: {"id":"c","choices":[{"index":0,"text":"b","logprobs":null,'
    b'"prompt_token_ids":null,"token_ids":[7,8],"finish_reason":null}]}'
)


@pytest.mark.parametrize(
    "event",
    [
        ORDINARY.replace(b"null}", b'"length"}'),  # the final chunk
        ORDINARY.replace(b'"prompt_token_ids":null', b'"prompt_token_ids":[1]'),
        ORDINARY.replace(b"null}", b'null,"prompt_token_ids":[1]}'),  # a prompt's list after
        ORDINARY.replace(b'"token_ids":[7,8]', b'"token_ids": [7,8]'),  # spaced
        ORDINARY.replace(b'"token_ids":[7,8]', b'"token_ids":null'),
        b'data: {"error":{"message":"x","type":"y","code":500}}',  # D's error event
        ORDINARY + b"\n\n" + ORDINARY,  # two events in one read
        ORDINARY + b"\n",  # not whole
        b"event: x\n" + ORDINARY,
    ],
)
def test_only_an_ordinary_token_event_is_relayed_unread(event: bytes) -> None:
    """Progress.relayed takes exactly one ordinary token event (one generated ids list, its
    finish_reason null) and leaves any other read for client_bytes: had it taken one of
    these, the client's bytes or the record would be wrong."""
    progress = Progress.of(creq(COMPLETION))
    progress.identity = {"id": "c"}
    assert progress.relayed(event) is None and progress.pending == []
    assert progress.relayed(ORDINARY + b"\n\n") == ORDINARY.replace(b"[7,8]", b"null") + b"\n\n"
    assert progress.relayed(ORDINARY) == ORDINARY.replace(b"[7,8]", b"null")
    progress.settle()
    assert progress.generated == [7, 8, 7, 8] and progress.usable


def test_a_continuations_and_a_collected_answers_events_are_read_whole() -> None:
    """Only the first leg of a streamed answer is relayed unread: a continuation's events
    are rewritten (Progress.continued), a non-streamed answer's texts collected."""
    progress = Progress.of(creq(COMPLETION))
    assert progress.relayed(ORDINARY) is None  # nothing read yet: no identity
    progress.identity = {"id": "c"}
    progress.legs = 2
    assert progress.relayed(ORDINARY) is None
    collected = Progress.of(creq({**COMPLETION, "stream": False}))
    collected.identity = {"id": "c"}
    assert collected.relayed(ORDINARY) is None


def test_ids_that_are_not_json_make_the_answer_not_resumable() -> None:
    progress = Progress.of(creq(COMPLETION))
    progress.first_leg(*_event({"id": "c", "choices": [{"index": 0, "prompt_token_ids": [1]}]}))
    assert progress.relayed(ORDINARY.replace(b"[7,8]", b"[]")) is not None  # no token
    assert progress.relayed(ORDINARY) is not None and progress.resumable
    assert progress.generated == [7, 8]
    progress.generated.clear()
    assert progress.relayed(ORDINARY.replace(b"[7,8]", b"[7,,8]")) is not None
    assert progress.resumable is False and progress.generated == []
