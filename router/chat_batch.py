"""``POST /v1/chat/completions/batch``, vLLM 0.32's batch of conversations: one P/D dispatch
per conversation, answers assembled as vLLM assembles them.

vLLM takes a chat request whose ``messages`` is a list of conversations (each a non-empty
list of messages) and answers one non-streamed ``chat.completion`` whose choice ``i`` is
conversation ``i``'s (``index`` ``i``), whose ``usage`` sums the conversations' tokens (its
``*_tokens_details`` null) and which carries no ``prompt_token_ids`` or
``kv_transfer_params`` of its own. It refuses, before any work and in its own words,
``n`` other than 1, beam search, ``logprob_token_ids`` without ``logprobs``,
``kv_transfer_params.prompt_token_ids`` and a ``tool_choice`` other than ``"none"``;
``stream`` it ignores (the answer is never streamed). Every other field is each
conversation's, as in vLLM, where each becomes a chat request of its own.

The router splits the request into one chat completion per conversation (``stream``
dropped), each checked against the bounds and dispatched on its own decode slot, all at once
(router/multi_prompt.py runs them, :func:`merge_batch` assembles the answer); an error answer
of any conversation is the request's.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.client_request import ClientRequest, Endpoint, chat_chars, parse_json_object
from router.errors import InvalidBody, InvalidRequest

__all__ = ["merge_batch", "parse_chat_batch", "request_schema", "split"]

_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")
_STREAMING = ("stream", "stream_options")


class _ChatBatch(BaseModel):
    # Lax types and extra fields allowed, as vLLM's BatchChatCompletionRequest.
    model_config = ConfigDict(extra="allow")

    messages: list[Annotated[list[dict[str, Any]], Field(min_length=1)]] = Field(min_length=1)
    model: str | None = Field(default=None, min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tool_choice: Any = None  # checked by hand: vLLM's Literal["none"]


def request_schema() -> dict[str, Any]:
    """The request body's JSON schema, for the OpenAPI document."""
    return _ChatBatch.model_json_schema()


def _vllm_error(message: str, parameter: str, value: Any = None) -> InvalidRequest:
    """vLLM's VLLMValidationError as its handler renders it."""
    extras = [f"parameter={parameter}"] + ([] if value is None else [f"value={value}"])
    return InvalidRequest(f"{message} ({', '.join(extras)})", param=parameter)


def _check_batch_mode(body: dict[str, Any]) -> None:
    """vLLM's ``check_batch_mode``, run before the fields are validated."""
    if body.get("use_beam_search"):
        raise _vllm_error(
            "Batch chat completions do not support beam search. "
            "Please set `use_beam_search` to False.",
            "use_beam_search",
        )
    if body.get("logprob_token_ids") and not body.get("logprobs"):
        raise _vllm_error(
            "when using `logprob_token_ids`, `logprobs` must be set to true.",
            "logprob_token_ids",
        )
    kv = body.get("kv_transfer_params")
    if isinstance(kv, dict) and kv.get("prompt_token_ids") is not None:
        raise _vllm_error(
            "Batch chat completions do not support `kv_transfer_params['prompt_token_ids']`: "
            "one pre-tokenized prompt cannot serve several conversations.",
            "kv_transfer_params.prompt_token_ids",
        )
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise _vllm_error(
            "Batch chat completions do not support `n > 1`. Please set `n` to 1.", "n", n
        )


def _field_error(exc: ValidationError) -> InvalidRequest:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    path = ".".join(loc)
    if err["type"] in ("greater_than", "greater_than_equal"):  # vLLM's serving code refuses
        return InvalidRequest(f"{path}: {err['msg']}", param=path)
    return InvalidBody(f"{path}: {err['msg']}", param=".".join(["body", *loc]))


def parse_chat_batch(raw: bytes, api_key_name: str = "anonymous") -> ClientRequest:
    """Validate a batch body; its :class:`ClientRequest` has one prompt per conversation."""
    body = parse_json_object(raw)
    _check_batch_mode(body)
    try:
        batch = _ChatBatch.model_validate(body)
    except ValidationError as exc:
        raise _field_error(exc) from None
    if batch.tool_choice not in (None, "none"):
        raise InvalidBody("tool_choice: Input should be 'none'", param="body.tool_choice")
    max_output: int | None
    if batch.max_completion_tokens is not None:
        max_output, field = batch.max_completion_tokens, "max_completion_tokens"
    else:
        max_output, field = batch.max_tokens, "max_tokens"
    return ClientRequest(
        endpoint=Endpoint.CHAT_BATCH,
        body=body,
        model=batch.model,
        stream=False,
        n=1,
        num_prompts=len(batch.messages),
        prompt_chars=sum(chat_chars(c) for c in batch.messages),
        prompt_is_tokens=False,
        max_output=max_output,
        max_output_field=field,
        api_key_name=api_key_name,
    )


def split(creq: ClientRequest) -> list[ClientRequest]:
    """One chat completion per conversation of ``creq``, in order, never streamed."""
    common = {k: v for k, v in creq.body.items() if k not in _STREAMING and k != "messages"}
    return [
        dataclasses.replace(
            creq,
            endpoint=Endpoint.CHAT,
            body={**common, "messages": conversation},
            num_prompts=1,
            prompt_chars=chat_chars(conversation),
        )
        for conversation in creq.body["messages"]
    ]


def merge_batch(bodies: list[bytes]) -> bytes:
    """vLLM's batch answer from each conversation's chat completion (all 200s)."""
    docs = [orjson.loads(b) for b in bodies]
    merged = dict(docs[0])
    choices = []
    for i, doc in enumerate(docs):
        for choice in doc.get("choices") or []:
            choices.append({**choice, "index": i})
    usages = [d["usage"] for d in docs if isinstance(d.get("usage"), dict)]
    merged["choices"] = choices
    if usages:
        usage = {k: sum(int(u.get(k) or 0) for u in usages) for k in _USAGE_FIELDS}
        merged["usage"] = {
            **usage,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
    for own in ("prompt_logprobs", "prompt_token_ids", "kv_transfer_params"):
        if own in merged:
            merged[own] = None
    return orjson.dumps(merged)
