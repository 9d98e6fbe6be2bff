"""P's prefix-cache hits read from its answer, and D's usage rewritten to them, for every
endpoint that reports usage (router/pd/usage.py)."""

from __future__ import annotations

import json

import pytest

from router.pd.usage import prompt_cached_tokens, with_cached_tokens


@pytest.mark.parametrize(
    ("usage", "want"),
    [
        ({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}, 4),
        ({"input_tokens": 9, "input_tokens_details": {"cached_tokens": 3}}, 3),  # Responses
        ({"input_tokens": 9, "input_tokens_details": {"cached_tokens": 0}}, 0),
        ({"prompt_tokens": 9}, None),  # vLLM without --enable-prompt-tokens-details
        ({"prompt_tokens": 9, "prompt_tokens_details": None}, None),
        ({"prompt_tokens_details": {"cached_tokens": "4"}}, None),
        (None, None),
    ],
)
def test_prefix_cache_hits_of_every_usage_shape(usage: object, want: int | None) -> None:
    assert prompt_cached_tokens({"usage": usage}) == want


def test_a_responses_completed_event_gets_p_s_count() -> None:
    event = {
        "type": "response.completed",
        "response": {"usage": {"input_tokens": 78, "input_tokens_details": {"cached_tokens": 78}}},
    }
    chunk = b"event: response.completed\ndata: " + json.dumps(event).encode() + b"\n\n"
    out = with_cached_tokens(chunk, 0)
    doc = json.loads(out.split(b"data: ", 1)[1])
    assert doc["response"]["usage"] == {
        "input_tokens": 78,
        "input_tokens_details": {"cached_tokens": 0},
    }
