"""A chat's ``kv_transfer_params.prompt_token_ids`` (vLLM 0.32 runs them as the prompt): what
the router takes the prompt to be, for routing, bounds and kept turns."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.client_request import Endpoint, parse_client_request, reused_prompt_ids
from router.kvindex.tokens import tokenize_query

MESSAGES = [{"role": "user", "content": "a long message " * 40}]


def _chat(ids: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": MESSAGES, "kv_transfer_params": {"prompt_token_ids": ids}}


def test_the_ids_are_the_prompt_for_routing_and_bounds() -> None:
    creq = parse_client_request(orjson.dumps(_chat([5, 6, 7])), Endpoint.CHAT)
    assert tokenize_query(creq) == [5, 6, 7]
    assert creq.prompt_is_tokens and creq.estimated_prompt_tokens() == 3


@pytest.mark.parametrize(
    "body",
    [
        _chat([5, -1]),
        _chat([]),
        _chat([5, True]),
        _chat("5 6"),
        {**_chat([5, 6]), "echo": True},
        {**_chat([5]), "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    ],
    ids=["negative", "empty", "bool", "string", "echo", "image"],
)
def test_where_the_engines_render_the_messages_or_refuse_the_ids_they_are_not_the_prompt(
    body: dict[str, Any],
) -> None:
    assert reused_prompt_ids(body) is None
    creq = parse_client_request(orjson.dumps(body), Endpoint.CHAT)
    assert isinstance(tokenize_query(creq), dict)  # P's /tokenize of the messages
    assert not creq.prompt_is_tokens


def test_a_completion_s_prompt_ids_in_its_params_are_not_its_prompt() -> None:
    body = {"model": "tiny", "prompt": "hi", "kv_transfer_params": {"prompt_token_ids": [5]}}
    creq = parse_client_request(orjson.dumps(body), Endpoint.COMPLETIONS)
    assert tokenize_query(creq) == {"prompt": "hi", "add_special_tokens": True, "model": "tiny"}
