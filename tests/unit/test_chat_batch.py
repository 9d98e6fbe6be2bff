"""router/chat_batch.py: a batch split into chat completions and assembled as vLLM 0.32
assembles its batch answer."""

from __future__ import annotations

import json

import pytest

from router.chat_batch import merge_batch, parse_chat_batch, split
from router.client_request import Endpoint
from router.errors import InvalidBody, InvalidRequest

ONE = [{"role": "user", "content": "one"}]
TWO = [{"role": "user", "content": "two!"}]


def _answer(content: str, prompt: int, made: int) -> bytes:
    return json.dumps(
        {
            "id": f"chatcmpl-{content}",
            "object": "chat.completion",
            "created": 7,
            "model": "tiny",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "logprobs": None,
                    "finish_reason": "length",
                    "token_ids": [1, 2],
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "total_tokens": prompt + made,
                "completion_tokens": made,
                "prompt_tokens_details": {"cached_tokens": 3},
            },
            "prompt_token_ids": [5, 6],
            "kv_transfer_params": {"remote_engine_id": "d"},
        }
    ).encode()


def test_a_batch_is_one_chat_completion_per_conversation_never_streamed() -> None:
    raw = json.dumps(
        {"model": "tiny", "messages": [ONE, TWO], "stream": True, "logprobs": True, "seed": 3}
    ).encode()
    creq = parse_chat_batch(raw, "team")
    assert (creq.endpoint, creq.num_prompts, creq.stream, creq.api_key_name) == (
        Endpoint.CHAT_BATCH,
        2,
        False,
        "team",
    )
    parts = split(creq)
    assert [p.endpoint for p in parts] == [Endpoint.CHAT, Endpoint.CHAT]
    assert [p.body for p in parts] == [
        {"model": "tiny", "logprobs": True, "seed": 3, "messages": ONE},
        {"model": "tiny", "logprobs": True, "seed": 3, "messages": TWO},
    ]
    assert [p.prompt_chars for p in parts] == [3, 4] and all(p.num_prompts == 1 for p in parts)


def test_the_answers_are_assembled_as_vllm_assembles_them() -> None:
    doc = json.loads(merge_batch([_answer("a", 10, 2), _answer("b", 20, 3)]))
    assert doc["id"] == "chatcmpl-a" and doc["object"] == "chat.completion"
    assert [(c["index"], c["message"]["content"]) for c in doc["choices"]] == [(0, "a"), (1, "b")]
    assert doc["choices"][1]["token_ids"] == [1, 2]
    assert doc["usage"] == {
        "prompt_tokens": 30,
        "completion_tokens": 5,
        "total_tokens": 35,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert doc["prompt_token_ids"] is None and doc["kv_transfer_params"] is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [ONE], "n": 2}, "n"),
        ({"messages": [ONE], "use_beam_search": True}, "use_beam_search"),
        ({"messages": [ONE], "logprob_token_ids": [1]}, "logprob_token_ids"),
        (
            {"messages": [ONE], "kv_transfer_params": {"prompt_token_ids": [1]}},
            "kv_transfer_params.prompt_token_ids",
        ),
        ({"messages": [ONE], "max_tokens": 0}, "max_tokens"),
    ],
)
def test_vllms_own_checks(body: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_batch(json.dumps(body).encode())
    assert caught.value.param == param and not isinstance(caught.value, InvalidBody)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "body.messages"),
        ({"messages": []}, "body.messages"),
        ({"messages": [[]]}, "body.messages.0"),
        ({"messages": [ONE, ONE[0]]}, "body.messages.1"),
        ({"messages": [ONE], "tool_choice": "auto"}, "body.tool_choice"),
    ],
)
def test_a_body_that_fails_vllms_model(body: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidBody) as caught:
        parse_chat_batch(json.dumps(body).encode())
    assert caught.value.param == param
