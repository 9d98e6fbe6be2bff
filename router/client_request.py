"""Parse and validate a client's OpenAI request body (pure functions).

The router validates only what it relies on (model, stream, token limits, the
prompt's shape) and passes every other field through unchanged, as vLLM
expects: the raw dict is kept and rewritten per leg by :mod:`router.pd.kv_params`.
It is as lenient as vLLM's own (pydantic, lax mode): ``"max_tokens": "5"`` and
``"stream": 1`` are accepted, ``model`` may be left out. Integers beyond 64 bits
(a ``seed``) stay integers on the way to the engines.

A refusal is typed as vLLM 0.32 types the same refusal: a body that fails vLLM's request
model (not JSON, not an object, a field of the wrong type, a required field missing) is an
:class:`~router.errors.InvalidBody` (``"Bad Request"``, ``param`` ``body.<field>``); a value
that vLLM's model takes and its serving code refuses (``n: 0``, an empty prompt) is an
:class:`~router.errors.InvalidRequest` (``BadRequestError``, ``param`` the field).
"""

from __future__ import annotations

import contextlib
import enum
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from router.config import SessionConfig
from router.errors import InvalidBody, InvalidRequest

__all__ = [
    "ClientRequest",
    "Endpoint",
    "chat_chars",
    "check_passthrough_body",
    "client_prompt_ids",
    "parse_client_request",
    "parse_invocation",
    "parse_json_object",
    "request_json_schema",
    "reused_prompt_ids",
]


class Endpoint(enum.StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    RESPONSES = "/v1/responses"
    CHAT_BATCH = "/v1/chat/completions/batch"  # several conversations (router/chat_batch.py)
    MESSAGES = "/v1/messages"  # the Anthropic Messages API, run by the engines' own route


_PROMPT_SCHEMA: list[JsonValue] = [
    {"type": "string"},
    {"type": "array", "items": {"type": "string"}},
    {"type": "array", "items": {"type": "integer"}},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
]
_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


class _Common(BaseModel):
    # Lax types, as vLLM's request models: "5" is a valid max_tokens there too.
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(default=None, min_length=1)  # None: the router's only model
    stream: bool | None = False
    n: int | None = Field(default=1, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int | None = Field(default=None, ge=0)
    stream_options: dict[str, Any] | None = None


class _Completion(_Common):
    # Optional, as in vLLM's model: its absence is refused in vLLM's words (_prompt_shape).
    prompt: Any = Field(default=None, json_schema_extra={"anyOf": _PROMPT_SCHEMA})


class _Chat(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class _Responses(_Common):
    # A string or a list of items; checked by hand so that its error names ``input`` alone
    # (a union's error would name each of its branches).
    input: Any = Field(json_schema_extra={"anyOf": [{"type": "string"}, {"type": "array"}]})
    max_output_tokens: int | None = Field(default=None, ge=1)


class _Messages(BaseModel):
    """vLLM 0.32's AnthropicMessagesRequest, the fields the router reads: ``model`` and
    ``max_tokens`` are required there (and a ``max_tokens`` of 0 fails its model)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[Any]
    max_tokens: int = Field(gt=0)
    stream: bool | None = False


class _TokenizePrompt(BaseModel):
    """``/tokenize`` with a prompt; the fields the engine needs, the rest passes through."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # before the others: vLLM reports it first
    prompt: str


class _TokenizeChat(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Any]


class _Detokenize(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A validated client request. ``body`` is the client's JSON, never mutated."""

    endpoint: Endpoint
    body: dict[str, Any]
    model: str | None  # None: not given (the router's only model serves it)
    stream: bool
    n: int
    num_prompts: int
    prompt_chars: int  # characters of text (or tokens, for token prompts) in the prompt
    prompt_is_tokens: bool
    session: str | None = None  # the conversation id, for session affinity
    # The output tokens asked for, and the field that asked (vLLM names it in its errors).
    max_output: int | None = None
    max_output_field: str = "max_tokens"
    api_key_name: str = "anonymous"  # the API key's name: limits, fair queueing, metrics
    priority_class: str = ""  # the priority class's name, "" without one (router/priority.py)
    priority_level: int = 0  # the class's place in the admission queue: 0 most urgent
    ttft_deadline_ms: float | None = None  # the request's TTFT deadline (router/priority.py)
    deadline_at: float | None = None  # when it passes, on the router's clock
    # An endpoint picker's choice, read by a ``pd-router sidecar`` (router/picker): the
    # decision (a ``Decision`` value), the P (its engine key: its URL, ``<url>#dp<r>`` for a
    # data-parallel rank) and D's data-parallel rank (the picker's slot is on that rank); None:
    # the router chooses.
    picked_decision: str | None = None
    picked_prefill: str | None = None
    picked_rank: int | None = None

    def estimated_prompt_tokens(self, chars_per_token: float = 4.0) -> int:
        if self.prompt_is_tokens:
            return self.prompt_chars
        return int(self.prompt_chars / chars_per_token)


def with_session(
    creq: ClientRequest, headers: Iterable[tuple[bytes, bytes]], config: SessionConfig
) -> ClientRequest:
    """``creq`` with its session id: the first header of ``config.headers`` it carries, else the
    body's ``config.body_field`` (a string or number), which is removed from the body
    either way: it is not an OpenAI field and must not reach an engine."""
    session = None
    if config.enabled and config.headers:
        wanted = config.headers
        for name, value in headers:
            if value and name.decode("latin-1") in wanted:
                session = value.decode("latin-1")
                break
    field = config.body_field
    if field is None or field not in creq.body:
        return creq if session is None else replace(creq, session=session)
    body = dict(creq.body)
    given = body.pop(field)
    if session is None and isinstance(given, (str, int)) and not isinstance(given, bool):
        session = str(given) or None
    return replace(creq, body=body, session=session if config.enabled else None)


def request_json_schema(endpoint: Endpoint) -> dict[str, Any]:
    """JSON schema of the fields the router checks (others pass through), for OpenAPI."""
    return _MODELS[endpoint].model_json_schema()


_INT64 = 2**63


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _not_json(raw: bytes) -> InvalidBody:
    """The refusal of a body that is not JSON, placed as vLLM places it: FastAPI parses with
    the standard library and names the offset where it failed (``body.<offset>``); a body
    it cannot even decode has no place."""
    if not raw:
        return InvalidBody("body: Field required (the request body is empty)", "body")
    try:
        json.loads(raw, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        message = f"request body is not valid JSON at offset {exc.pos}: {exc.msg}"
        return InvalidBody(message, f"body.{exc.pos}")
    except ValueError as exc:  # undecodable bytes; NaN or Infinity, which the router refuses
        return InvalidBody(f"request body is not valid JSON: {exc}")
    return InvalidBody("request body is not valid JSON", "body")


def _maybe_huge_int(doc: Any) -> bool:
    """Whether orjson may have turned an integer past 64 bits into a float here (a float
    with an integral value that large); looks at numbers and containers only."""
    todo = [doc]
    while todo:
        value = todo.pop()
        kind = type(value)
        if kind is dict:
            todo.extend(v for v in value.values() if type(v) in _NESTED)
        elif kind is list:
            todo.extend(v for v in value if type(v) in _NESTED)
        elif kind is float and abs(value) >= _INT64 and value.is_integer():
            return True
    return False


_NESTED = (dict, list, float)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a dict. A body where orjson may have turned an integer past 64 bits
    into a float is parsed again by the standard library, which keeps integers of any
    size; the upstream client serializes them the same way."""
    try:
        doc = orjson.loads(raw)
        if _maybe_huge_int(doc):
            doc = json.loads(raw, parse_constant=_reject_constant)
    except (orjson.JSONDecodeError, ValueError):
        raise _not_json(raw) from None
    if not isinstance(doc, dict):
        raise InvalidBody("request body must be a JSON object", "body")
    return doc


# Constraints that vLLM's request models do not have: vLLM takes such a value and its
# serving code refuses it (BadRequestError); every other error fails its model as well.
_VALUE_ERRORS = frozenset({"greater_than", "greater_than_equal", "too_short", "string_too_short"})


def _first_error(exc: ValidationError) -> InvalidRequest:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    path = ".".join(loc)
    if err["type"] in _VALUE_ERRORS:
        return InvalidRequest(f"{path}: {err['msg']}", param=path or None)
    return InvalidBody(f"{path}: {err['msg']}", param=".".join(["body", *loc]))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_token(x: Any) -> bool:
    return _is_int(x) and x >= 0  # vLLM's model: token ids are never negative


# vLLM's words (and its VLLMValidationError's "(parameter=...)" suffix) for a missing prompt.
_NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"


def client_prompt_ids(body: dict[str, Any]) -> Any:
    """What a chat body carries in ``kv_transfer_params.prompt_token_ids``, None if nothing.

    vLLM 0.32's chat route runs those ids as the prompt instead of rendering ``messages``
    (a P/D proxy's reuse of P's tokenization), refuses them when malformed and ignores them
    when ``echo`` is set or a message has non-text content. The router forwards this one
    key to the engines unchanged (:mod:`router.pd.kv_params`), so that they decide as vLLM
    does; it is the only client-supplied transfer parameter that names no engine or block."""
    kv = body.get("kv_transfer_params")
    if "messages" not in body or not isinstance(kv, dict):
        return None
    return kv.get("prompt_token_ids")


def reused_prompt_ids(body: dict[str, Any]) -> list[int] | None:
    """The prompt token ids the engines will run for a chat ``body`` that forwards them
    (:func:`client_prompt_ids`): well-formed, without ``echo``, every message content text.
    None where the engines render ``messages`` or refuse the ids."""
    ids = client_prompt_ids(body)
    if not isinstance(ids, list) or not ids or not all(_is_token(t) for t in ids):
        return None
    if body.get("echo") or not _text_only(body.get("messages")):
        return None
    return ids


def _text_only(messages: Any) -> bool:
    """No content part other than text (stricter than vLLM's check: a hint never wrong)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type", "text") != "text" for part in content
        ):
            return False
    return True


def _prompt_shape(prompt: Any) -> tuple[int, int, bool]:
    """(number of prompts, their total size, whether they are token ids)."""
    if prompt is None or prompt == "":
        raise InvalidRequest(_NO_PROMPT, param="prompt")
    if isinstance(prompt, str):
        return 1, len(prompt), False
    if not isinstance(prompt, list):
        raise InvalidBody(f"prompt: must be {_PROMPT_SHAPES}", param="body.prompt")
    if not prompt:
        raise InvalidRequest("prompt: must not be empty", param="prompt")
    if all(_is_token(t) for t in prompt):
        return 1, len(prompt), True
    if all(isinstance(p, str) for p in prompt):
        return len(prompt), sum(len(p) for p in prompt), False
    if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
        return len(prompt), sum(len(p) for p in prompt), True
    # As vLLM's union reports it: its first branch (token ids) fails at the first element
    # that is not one.
    first = next(i for i, t in enumerate(prompt) if not _is_token(t))
    raise InvalidBody(f"prompt: must be {_PROMPT_SHAPES}", param=f"body.prompt.{first}")


def chat_chars(messages: list[dict[str, Any]]) -> int:
    total = 0
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return total


def _input_shape(given: Any) -> str | list[Any]:
    if isinstance(given, (str, list)):
        return given
    raise InvalidBody("input: Input should be a valid string or list", param="body.input")


def _input_chars(items: str | list[Any]) -> int:
    """Characters of text in a Responses-API ``input`` (a string or a list of items)."""
    if isinstance(items, str):
        return len(items)
    return chat_chars([i for i in items if isinstance(i, dict)])


_MODELS: dict[Endpoint, type[BaseModel]] = {
    Endpoint.MESSAGES: _Messages,
    Endpoint.COMPLETIONS: _Completion,
    Endpoint.CHAT: _Chat,
    Endpoint.RESPONSES: _Responses,
}


def parse_client_request(
    raw: bytes, endpoint: Endpoint, api_key_name: str = "anonymous"
) -> ClientRequest:
    """Validate ``raw`` (sent with the API key named ``api_key_name``); raises
    :class:`InvalidRequest` (HTTP 400) with the field's path."""
    body = parse_json_object(raw)
    max_output: int | None
    try:
        if endpoint is Endpoint.CHAT:
            chat = _Chat.model_validate(body)
            common: _Common = chat
            num, chars, is_tokens = 1, chat_chars(chat.messages), False
            reused = reused_prompt_ids(body)
            if reused is not None:  # the engines run these ids, not the messages
                chars, is_tokens = len(reused), True
            # vLLM reads max_completion_tokens first, then max_tokens.
            if chat.max_completion_tokens is not None:
                max_output, field = chat.max_completion_tokens, "max_completion_tokens"
            else:
                max_output, field = chat.max_tokens, "max_tokens"
        elif endpoint is Endpoint.MESSAGES:
            return _messages_request(body, api_key_name)
        elif endpoint is Endpoint.RESPONSES:
            resp = _Responses.model_validate(body)
            common = resp
            num, chars, is_tokens = 1, _input_chars(_input_shape(resp.input)), False
            max_output, field = resp.max_output_tokens, "max_output_tokens"
        else:
            comp = _Completion.model_validate(body)
            common = comp
            num, chars, is_tokens = _prompt_shape(comp.prompt)
            max_output, field = comp.max_tokens, "max_tokens"
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
        max_output=max_output,
        max_output_field=field,
        api_key_name=api_key_name,
    )


# vLLM's /invocations: the request models it tries in turn, and its words when none fits.
_INVOCATION_TYPES = "['ChatCompletionRequest', 'CompletionRequest']"
NO_INVOCATION_HANDLER = (
    f"Cannot find suitable handler for request. Expected one of: {_INVOCATION_TYPES}"
)


def parse_invocation(raw: bytes, api_key_name: str = "anonymous") -> ClientRequest:
    """A SageMaker-style ``/invocations`` body, dispatched by its shape as vLLM 0.32 does:
    a chat completion if it fits vLLM's chat request model, else a completion (whose
    validator refuses a missing or empty prompt first, in its own words) if it fits the
    completion model; a body that fits neither is refused in vLLM's words. A value that a
    model takes and its serving code refuses (``n: 0``) is that endpoint's refusal."""
    try:
        body = parse_json_object(raw)
    except InvalidBody as exc:
        # vLLM reads this body itself: a JSON error in the standard library's words.
        try:
            json.loads(raw)
        except ValueError as err:
            raise InvalidBody(f"JSON decode error: {err}") from None
        raise InvalidRequest(exc.message) from None  # JSON, not an object
    with contextlib.suppress(InvalidBody):
        return parse_client_request(raw, Endpoint.CHAT, api_key_name)
    prompt = body.get("prompt")
    if (prompt is None or prompt == "") and not body.get("prompt_embeds"):
        raise InvalidRequest(_NO_PROMPT, param="prompt")
    try:
        return parse_client_request(raw, Endpoint.COMPLETIONS, api_key_name)
    except InvalidBody:
        raise InvalidRequest(NO_INVOCATION_HANDLER) from None


def _system_chars(system: Any) -> int:
    if isinstance(system, str):
        return len(system)
    return chat_chars([{"content": system}]) if isinstance(system, list) else 0


def _messages_request(body: dict[str, Any], api_key_name: str) -> ClientRequest:
    """An Anthropic Messages body: every field vLLM's request model refuses is a
    ``"Bad Request"`` there (FastAPI's validation), ``max_tokens: 0`` included."""
    try:
        msgs = _Messages.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"]]
        raise InvalidBody(f"{'.'.join(loc)}: {err['msg']}", ".".join(["body", *loc])) from None
    messages = [m for m in msgs.messages if isinstance(m, dict)]
    return ClientRequest(
        endpoint=Endpoint.MESSAGES,
        body=body,
        model=msgs.model,
        stream=bool(msgs.stream),
        n=1,
        num_prompts=1,
        prompt_chars=chat_chars(messages) + _system_chars(body.get("system")),
        prompt_is_tokens=False,
        max_output=msgs.max_tokens,
        max_output_field="max_tokens",
        api_key_name=api_key_name,
    )


def check_passthrough_body(raw: bytes, path: str) -> dict[str, Any]:
    """The body of a ``/tokenize`` (``path``) or ``/detokenize`` request, checked for what
    the engine needs (a prompt or messages; token ids) so that a malformed one is refused
    before any engine call, as vLLM refuses it; forwarded as sent otherwise."""
    body = parse_json_object(raw)
    try:
        if path == "/detokenize":
            _Detokenize.model_validate(body)
            return body
        try:
            _TokenizePrompt.model_validate(body)
        except ValidationError as first:
            try:
                _TokenizeChat.model_validate(body)
            except ValidationError:
                raise first from None  # vLLM's union reports its prompt branch first
    except ValidationError as exc:
        raise _first_error(exc) from None
    return body
