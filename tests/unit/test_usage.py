"""P's prefix-cache hits read from its answer, and D's usage rewritten to them, for every
endpoint that reports usage (router/pd/usage.py)."""

from __future__ import annotations

import json

import pytest

from router.pd.usage import MARKER, prompt_cached_tokens, with_cached_tokens


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


def test_anthropic_usage_is_rewritten_its_prompt_kept() -> None:
    """The Messages API: ``cache_read_input_tokens`` becomes P's count and ``input_tokens``
    the rest of the prompt (their sum, the prompt's tokens, unchanged)."""
    event = (
        b'data: {"type":"message_delta","usage":{"input_tokens":0,"output_tokens":6,'
        b'"cache_read_input_tokens":91}}'
    )
    assert MARKER in event
    assert with_cached_tokens(event, 16) == (
        b'data: {"type":"message_delta","usage":{"input_tokens":75,"output_tokens":6,'
        b'"cache_read_input_tokens":16}}'
    )
    created = (
        b'{"input_tokens": 5, "output_tokens": 6, "cache_creation_input_tokens": 2, '
        b'"cache_read_input_tokens": 4}'
    )
    assert with_cached_tokens(created, 100) == (
        b'{"input_tokens":0, "output_tokens": 6, "cache_creation_input_tokens": 2, '
        b'"cache_read_input_tokens":9}'
    )
    without_cache = b'{"usage":{"input_tokens":91,"output_tokens":0}}'
    assert with_cached_tokens(without_cache, 16) == without_cache
    assert prompt_cached_tokens({"usage": {"input_tokens": 3, "cache_read_input_tokens": 16}}) == 16
