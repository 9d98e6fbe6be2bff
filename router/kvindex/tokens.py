"""What a request's prompt is in token ids: the body of the engine's ``/tokenize`` call.

The router has no tokenizer of its own: an engine's ``/tokenize`` answers with exactly the ids
the engine would compute for the request (its tokenizer, its chat template, its special-token
rules), which a local tokenizer reproduces only as long as its files and template code match
the engine's. What that costs per request is measured by ``bench/tokenize_cost.py``
(``docs/kv-events.md``).
"""

from __future__ import annotations

from typing import Any

from router.client_request import ClientRequest, Endpoint, reused_prompt_ids

__all__ = ["CHAT_TEMPLATE_FIELDS", "tokenize_query"]

# What shapes the chat template's token ids, as vLLM's /tokenize takes it for chat.
CHAT_TEMPLATE_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


def tokenize_query(creq: ClientRequest) -> list[int] | dict[str, Any] | None:
    """The prompt's token ids when the request gives them, else the ``/tokenize`` body that
    yields them; None when ``/tokenize`` cannot say (the Responses API, several prompts)."""
    body = creq.body
    if creq.endpoint is Endpoint.CHAT:
        reused = reused_prompt_ids(body)
        if reused is not None:
            return list(reused)  # the engines run these, not the rendered messages
        query = {k: body[k] for k in CHAT_TEMPLATE_FIELDS if k in body}
    elif creq.endpoint is Endpoint.COMPLETIONS and creq.num_prompts == 1:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, list) and all(_is_id(t) for t in prompt):
            return list(prompt)  # token ids already
        if not isinstance(prompt, str):
            return None
        query = {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
    else:
        return None
    if "model" in body:
        query["model"] = body["model"]
    return query


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
