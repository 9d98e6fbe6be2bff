"""Parse and validate a client's OpenAI request body (pure functions).

The router validates only what it relies on (model, stream, token limits, the
prompt's shape) and passes every other field through unchanged, as vLLM
expects: the raw dict is kept and rewritten per leg by :mod:`router.pd.kv_params`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from router.errors import InvalidRequest

__all__ = ["ClientRequest", "Endpoint", "parse_client_request", "request_json_schema"]


class Endpoint(enum.StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    stream: StrictBool | None = False
    n: StrictInt | None = Field(default=1, ge=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    min_tokens: StrictInt | None = Field(default=None, ge=0)
    stream_options: dict[str, Any] | None = None


class _Completion(_Common):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]


class _Chat(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A validated client request. ``body`` is the client's JSON, never mutated."""

    endpoint: Endpoint
    body: dict[str, Any]
    model: str
    stream: bool
    n: int
    num_prompts: int
    prompt_chars: int  # characters of text (or tokens, for token prompts) in the prompt
    prompt_is_tokens: bool

    def estimated_prompt_tokens(self, chars_per_token: float = 4.0) -> int:
        if self.prompt_is_tokens:
            return self.prompt_chars
        return int(self.prompt_chars / chars_per_token)


def request_json_schema(endpoint: Endpoint) -> dict[str, Any]:
    """JSON schema of the fields the router checks (others pass through), for OpenAPI."""
    model = _Chat if endpoint is Endpoint.CHAT else _Completion
    return model.model_json_schema()


def _decode_json(raw: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest("request body must be a JSON object")
    return doc


def _first_error(exc: ValidationError) -> InvalidRequest:
    err = exc.errors()[0]
    path = ".".join(str(p) for p in err["loc"])
    return InvalidRequest(f"{path}: {err['msg']}", param=path or None)


def _prompt_shape(prompt: Any) -> tuple[int, int, bool]:
    """(number of prompts, size of the first, whether it is token ids)."""
    if isinstance(prompt, str):
        return 1, len(prompt), False
    if not prompt:
        raise InvalidRequest("prompt: must not be empty", param="prompt")
    first = prompt[0]
    if isinstance(first, int):
        return 1, len(prompt), True
    if isinstance(first, str):
        return len(prompt), sum(len(p) for p in prompt), False
    return len(prompt), sum(len(p) for p in prompt), True


def _chat_chars(messages: list[dict[str, Any]]) -> int:
    total = 0
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return total


def parse_client_request(raw: bytes, endpoint: Endpoint) -> ClientRequest:
    """Validate ``raw``; raises :class:`InvalidRequest` (HTTP 400) with the field's path."""
    body = _decode_json(raw)
    try:
        if endpoint is Endpoint.CHAT:
            chat = _Chat.model_validate(body)
            common: _Common = chat
            num, chars, is_tokens = 1, _chat_chars(chat.messages), False
        else:
            comp = _Completion.model_validate(body)
            common = comp
            num, chars, is_tokens = _prompt_shape(comp.prompt)
    except ValidationError as exc:
        raise _first_error(exc) from None
    if common.stream_options is not None and not common.stream:
        raise InvalidRequest("stream_options: only allowed when stream is true", "stream_options")
    return ClientRequest(
        endpoint=endpoint,
        body=body,
        model=common.model,
        stream=bool(common.stream),
        n=common.n or 1,
        num_prompts=num,
        prompt_chars=chars,
        prompt_is_tokens=is_tokens,
    )
