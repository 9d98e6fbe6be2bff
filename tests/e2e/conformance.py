"""The differential conformance cases: the same raw requests to one aggregated vLLM engine and to
the router in front of P/D engines, answers compared field by field.

Each case is sent with ``httpx`` (exact bytes, no SDK defaults). An answer is reduced to what a
client relies on: the status, the error body of the cases that compare one, and for 200s the
body without per-request values (ids, timestamps), streams reduced to per-choice text, token
ids, finish reasons, the usage chunk and the number of ``[DONE]``. Floats (logprobs) compare
within ``FLOAT_TOLERANCE``: P/D and one engine batch differently, and bf16 on CPU rounds
differently per batch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import httpx

MODEL = "tiny"
FLOAT_TOLERANCE = 0.05
# Per-request values, and what is not the router's: the engines' max_model_len differs between
# the aggregated engine and the stack's P/D engines.
_VOLATILE = {"id", "created", "created_at", "system_fingerprint", "kv_transfer_params"}
_VOLATILE |= {"max_model_len", "request_id", "response_id", "item_id", "sequence_number"}
_GREEDY = {"temperature": 0, "ignore_eos": True}
_TEXT = "The quick brown fox jumps over the lazy dog. " * 3


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict[str, Any] | None  # None: GET
    compare_body: bool = True  # False: the status only (the router's own error text)
    compare_error: bool = False  # a non-200's body too (the router answers as vLLM would)


def _comp(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": _TEXT, "max_tokens": 6, **_GREEDY, **kw}


def _chat(**kw: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": _TEXT}]
    return {"model": MODEL, "messages": messages, "max_tokens": 6, **_GREEDY, **kw}


_USAGE = {"stream_options": {"include_usage": True}}
_MESSAGES_GREEDY = {"temperature": 0, "top_k": 1}  # Anthropic's model has no ignore_eos
_SAMPLED = {"temperature": 1.0, "top_p": 0.9, "seed": 1234}
_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
_NAMED_TOOL = {
    "tools": [_WEATHER],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
}
_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}},
            "required": ["answer", "score"],
        },
    },
}
_JSON = _SCHEMA["json_schema"]["schema"]
_IDS = {"prompt_token_ids": list(range(5, 60))}
_REGEX = r"\d{1,3}(\.\d{1,3}){3}"
_CHOICE = {"choice": ["alpha", "beta", "gamma"]}
_GRAMMAR = {"grammar": 'root ::= "SELECT " [a-z]+ " FROM " [a-z]+ ";"'}
# "e" is a stop string the tiny model's output hits within 24 tokens; unexercised() checks
# that the reference answers really stopped, called a tool, and so on.

CASES = [
    Case("completion", "/v1/completions", _comp()),
    Case("completion logprobs", "/v1/completions", _comp(logprobs=2)),
    Case("completion echo", "/v1/completions", _comp(echo=True)),
    Case("completion token ids", "/v1/completions", _comp(prompt=list(range(5, 60)))),
    Case("completion n=2", "/v1/completions", _comp(n=2)),
    # vLLM runs a chat's kv_transfer_params.prompt_token_ids as its prompt (issue 44).
    Case("chat prompt ids", "/v1/chat/completions", _chat(kv_transfer_params=_IDS)),
    Case(
        "chat prompt ids malformed",
        "/v1/chat/completions",
        _chat(kv_transfer_params={"prompt_token_ids": [5, -1]}),
        compare_error=True,
    ),
    Case("completion two prompts", "/v1/completions", _comp(prompt=[_TEXT, _TEXT[::-1]])),
    Case("completion stream usage", "/v1/completions", _comp(stream=True, **_USAGE)),
    Case(
        "completion two prompts stream",
        "/v1/completions",
        _comp(prompt=[_TEXT, _TEXT[::-1]], stream=True, **_USAGE),
    ),
    Case("completion stop", "/v1/completions", _comp(max_tokens=24, stop=["e"])),
    Case(
        "completion n=2 sampled",
        "/v1/completions",
        _comp(n=2, max_tokens=8, **_SAMPLED, logprobs=1),
    ),
    Case("completion lenient", "/v1/completions", _comp(max_tokens="6", stream=1)),
    Case(
        "completion without model",
        "/v1/completions",
        {"prompt": _TEXT, "max_tokens": 3, **_GREEDY},  # sampled, it depends on D's history
    ),
    Case("chat", "/v1/chat/completions", _chat()),
    Case(
        "chat logprobs",
        "/v1/chat/completions",
        _chat(logprobs=True, top_logprobs=2, max_tokens=None, max_completion_tokens=5),
    ),
    Case("chat stream usage", "/v1/chat/completions", _chat(stream=True, **_USAGE)),
    Case("chat stop stream", "/v1/chat/completions", _chat(max_tokens=24, stop=["e"], stream=True)),
    Case("chat n=2 sampled", "/v1/chat/completions", _chat(n=2, max_tokens=8, **_SAMPLED)),
    Case("chat named tool", "/v1/chat/completions", _chat(max_tokens=40, **_NAMED_TOOL)),
    Case(
        "chat named tool stream",
        "/v1/chat/completions",
        _chat(max_tokens=40, stream=True, **_NAMED_TOOL, **_USAGE),
    ),
    Case(
        "chat required tool",
        "/v1/chat/completions",
        _chat(max_tokens=40, tools=[_WEATHER], tool_choice="required"),
    ),
    Case("chat auto tool", "/v1/chat/completions", _chat(tools=[_WEATHER], tool_choice="auto")),
    Case("chat json_schema", "/v1/chat/completions", _chat(max_tokens=40, response_format=_SCHEMA)),
    Case(
        "chat json_object stream",
        "/v1/chat/completions",
        _chat(max_tokens=30, response_format={"type": "json_object"}, stream=True),
    ),
    Case(
        "completion json_schema",
        "/v1/completions",
        _comp(max_tokens=40, response_format=_SCHEMA),
    ),
    # Structured outputs by vLLM's own field (issue 44): each kind, streamed and not, chat and
    # completions; ended by the grammar, not by ignore_eos.
    Case(
        "chat json_schema stream",
        "/v1/chat/completions",
        _chat(max_tokens=40, response_format=_SCHEMA, stream=True, **_USAGE),
    ),
    Case(
        "completion regex",
        "/v1/completions",
        _comp(max_tokens=20, ignore_eos=False, structured_outputs={"regex": _REGEX}),
    ),
    Case(
        "chat choice stream",
        "/v1/chat/completions",
        _chat(max_tokens=10, ignore_eos=False, stream=True, structured_outputs=_CHOICE),
    ),
    Case(
        "completion grammar stream",
        "/v1/completions",
        _comp(max_tokens=30, ignore_eos=False, stream=True, structured_outputs=_GRAMMAR),
    ),
    Case(
        "chat structured json",
        "/v1/chat/completions",
        _chat(max_tokens=40, ignore_eos=False, structured_outputs={"json": _JSON}),
    ),
    Case(
        "responses",
        "/v1/responses",
        {"model": MODEL, "input": _TEXT, "max_output_tokens": 6, "temperature": 0},
    ),
    Case(
        "responses stream",
        "/v1/responses",
        {"model": MODEL, "input": _TEXT, "max_output_tokens": 6, "temperature": 0, "stream": True},
    ),
    Case(
        "responses json_schema",
        "/v1/responses",
        {"model": MODEL, "input": _TEXT, "max_output_tokens": 40, "temperature": 0}
        | {"text": {"format": {"type": "json_schema", "name": "answer", "schema": _JSON}}},
    ),
    Case(
        "responses logprobs stream",
        "/v1/responses",
        {"model": MODEL, "input": _TEXT, "max_output_tokens": 6, "temperature": 0, "stream": True}
        | {"include": ["message.output_text.logprobs"], "top_logprobs": 5},
    ),
    Case(
        "responses logprobs",
        "/v1/responses",
        {"model": MODEL, "input": _TEXT, "max_output_tokens": 6, "temperature": 0}
        | {"include": ["message.output_text.logprobs"], "top_logprobs": 5},
    ),
    # vLLM 0.32's other routes (issue 44)
    Case(
        "chat batch",
        "/v1/chat/completions/batch",
        _chat(
            messages=[
                [{"role": "user", "content": _TEXT}],
                [{"role": "user", "content": _TEXT[::-1]}],
            ],
            logprobs=True,
            top_logprobs=2,
            return_token_ids=True,
        ),
    ),
    Case(
        "chat batch json_schema",
        "/v1/chat/completions/batch",
        _chat(
            messages=[[{"role": "user", "content": _TEXT}], [{"role": "user", "content": "Hi"}]],
            max_tokens=30,
            response_format=_SCHEMA,
        ),
    ),
    Case("invocations chat", "/invocations", _chat()),
    Case("invocations completion stream", "/invocations", _comp(stream=True, **_USAGE)),
    Case("invocations neither", "/invocations", {"model": MODEL, "prompt": 5}, compare_error=True),
    Case(
        "messages",
        "/v1/messages",
        {"model": MODEL, "messages": [{"role": "user", "content": _TEXT}], "max_tokens": 6}
        | _MESSAGES_GREEDY,
    ),
    Case(
        "messages stream",
        "/v1/messages",
        {"model": MODEL, "system": "Be brief.", "max_tokens": 6, "stream": True}
        | {"messages": [{"role": "user", "content": [{"type": "text", "text": _TEXT}]}]}
        | _MESSAGES_GREEDY,
    ),
    Case(
        "messages without max_tokens",
        "/v1/messages",
        {"model": MODEL, "messages": []},
        compare_body=False,  # the router's words for a field vLLM's model refuses
    ),
    Case("tokenizer_info", "/tokenizer_info", None),  # the engines run without the flag: 404
    Case("tokenize", "/tokenize", {"model": MODEL, "prompt": _TEXT}),
    Case("detokenize", "/detokenize", {"model": MODEL, "tokens": list(range(5, 30))}),
    Case("bad prompt", "/v1/completions", _comp(prompt=5), compare_body=False),
    Case("unknown model", "/v1/completions", _comp(model="nope"), compare_error=True),
    Case("unknown model, chat", "/v1/chat/completions", _chat(model="nope"), compare_error=True),
    Case("bad max_tokens", "/v1/completions", _comp(max_tokens=-1), compare_body=False),
    Case("seed past 64 bits", "/v1/completions", _comp(seed=2**70), compare_body=False),
]


@dataclass(frozen=True)
class Answer:
    status: int
    body: Any  # normalized (see module doc); None when only the status is compared


def ask(base_url: str, case: Case) -> Answer:
    """Send ``case`` to ``base_url`` and reduce the answer."""
    with httpx.Client(base_url=base_url, timeout=120) as client:
        if case.body is None:
            r = client.get(case.path)
        else:
            raw = json.dumps(case.body).encode()
            r = client.post(case.path, content=raw, headers={"content-type": "application/json"})
    if r.status_code != 200 and case.compare_error:
        return Answer(r.status_code, r.json())
    if r.status_code != 200 or not case.compare_body:
        return Answer(r.status_code, None)
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        if case.path == "/v1/responses":
            return Answer(200, _responses_stream_summary(r.text))
        if case.path == "/v1/messages":
            return Answer(200, _messages_stream_summary(r.text))
        return Answer(200, _stream_summary(r.text))
    return Answer(200, normalize(r.json()))


def unexercised(answers: dict[str, Answer]) -> list[str]:
    """The cases whose reference answer does not show what the case is named for (nothing
    stopped, no tool called, the two sampled choices alike): such a case would pass vacuously."""

    def body(name: str) -> Any:
        return answers[name].body

    checks = {
        "completion stop": body("completion stop")["choices"][0]["finish_reason"] == "stop",
        "chat stop stream": body("chat stop stream")["finish"] == {0: "stop"},
        "completion n=2 sampled": _distinct(
            c["text"] for c in body("completion n=2 sampled")["choices"]
        ),
        "chat n=2 sampled": _distinct(
            c["message"]["content"] for c in body("chat n=2 sampled")["choices"]
        ),
        "chat named tool": _called(body("chat named tool")),
        "chat named tool stream": bool(body("chat named tool stream")["tools"]),
        "chat required tool": _called(body("chat required tool")),
        "chat auto tool": answers["chat auto tool"].status == 200,
        "responses stream": bool(body("responses stream")["text"])
        and body("responses stream")["completed"] is not None,
        # Constrained to a JSON object: a random model's free text would not hold a brace.
        "chat json_schema": "{" in body("chat json_schema")["choices"][0]["message"]["content"],
        "chat batch": len(body("chat batch")["choices"]) == 2
        and bool(body("chat batch")["choices"][1]["token_ids"]),
        "messages stream": bool(body("messages stream")["text"])
        and body("messages stream")["types"][-1] == "message_stop",
        "tokenizer_info": answers["tokenizer_info"].status == 404,
        # The ids, not the messages, were the prompt: the answer is the ids' completion.
        "chat prompt ids": _text(body("chat prompt ids")) == _text(body("completion token ids")),
        "chat prompt ids malformed": answers["chat prompt ids malformed"].status == 400,
        "completion regex": re.fullmatch(_REGEX, _text(body("completion regex"))) is not None,
        "chat choice stream": body("chat choice stream")["texts"].get(0) in _CHOICE["choice"],
        "completion grammar stream": body("completion grammar stream")["texts"]
        .get(0, "")
        .startswith("SELECT "),
        "chat structured json": _text(body("chat structured json")).startswith("{"),
        "responses logprobs": "top_logprobs" in json.dumps(body("responses logprobs")),
    }
    return [name for name, ok in checks.items() if not ok]


def _text(doc: Any) -> str:
    """The first choice's text of a non-streamed chat or completion answer."""
    choice = doc["choices"][0]
    return str(choice.get("text") or (choice.get("message") or {}).get("content") or "")


def _called(doc: Any) -> bool:
    """A tool call, parsed, or in the parser's format (``<tool_call>``) when ``max_tokens``
    cut it before its closing tag (vLLM then returns it as content)."""
    message = doc["choices"][0]["message"]
    return bool(message.get("tool_calls")) or "<tool_call>" in (message.get("content") or "")


def _distinct(texts: Any) -> bool:
    items = list(texts)
    return len(set(items)) == len(items) > 1


def normalize(doc: Any) -> Any:
    """``doc`` without volatile keys, recursively."""
    if isinstance(doc, dict):
        return {k: normalize(v) for k, v in sorted(doc.items()) if k not in _VOLATILE}
    if isinstance(doc, list):
        return [normalize(v) for v in doc]
    return doc


def _stream_summary(text: str) -> dict[str, Any]:
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]
    texts: dict[int, str] = {}
    finish: dict[int, Any] = {}
    tools: dict[str, str] = {}  # "choice/call" -> name and arguments as streamed
    usage = None
    for event in events:
        if event == "[DONE]":
            continue
        doc = json.loads(event)
        for choice in doc.get("choices") or []:
            i = choice["index"]
            delta = choice.get("delta") or {}
            piece = choice.get("text")
            if piece is None:
                piece = delta.get("content") or ""
            texts[i] = texts.get(i, "") + piece
            finish[i] = choice.get("finish_reason") or finish.get(i)
            for call in delta.get("tool_calls") or []:
                key, fn = f"{i}/{call['index']}", call.get("function") or {}
                tools[key] = (
                    tools.get(key, "") + (fn.get("name") or "") + (fn.get("arguments") or "")
                )
        if doc.get("usage") is not None and not doc.get("choices"):
            usage = normalize(doc["usage"])
    done = events.count("[DONE]")
    return {"texts": texts, "finish": finish, "tools": tools, "usage": usage, "done": done}


def _responses_stream_summary(text: str) -> dict[str, Any]:
    """A streamed ``/v1/responses``: the order of the event types (an ``event:`` line per
    event, equal to its data's ``type``; a run of deltas counts once: vLLM merges the tokens
    of steps its stream has not sent yet, so how many deltas carry them is timing), the text
    the deltas add up to, and the final response of ``response.completed`` (usage included)."""
    types, texts, final = [], "", None
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" not in lines:
            continue
        doc = json.loads(lines["data"])
        kind = doc["type"] if lines.get("event") == doc["type"] else f"bad {lines}"
        if kind == "response.output_text.delta":
            texts += doc["delta"]
        if kind != "response.output_text.delta" or types[-1:] != [kind]:
            types.append(kind)
        if doc["type"] == "response.completed":
            final = normalize(doc["response"])
    return {"types": types, "text": texts, "completed": final}


def _messages_stream_summary(text: str) -> dict[str, Any]:
    """A streamed ``/v1/messages``: the order of its event types (an ``event:`` line per
    event, equal to its data's ``type``; a run of deltas counts once), the text the deltas
    add up to, and ``message_delta``'s stop reason and usage."""
    types: list[str] = []
    texts, end = "", None
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" not in lines:
            continue
        doc = json.loads(lines["data"])
        kind = doc["type"] if lines.get("event") == doc["type"] else f"bad {lines}"
        if kind == "content_block_delta":
            texts += (doc.get("delta") or {}).get("text") or ""
        if kind != "content_block_delta" or types[-1:] != [kind]:
            types.append(kind)
        if kind == "message_delta":
            end = normalize({k: v for k, v in doc.items() if k != "type"})
    return {"types": types, "text": texts, "end": end}


def differences(got: Any, want: Any, path: str = "") -> list[str]:
    """Where ``got`` differs from ``want`` (floats within ``FLOAT_TOLERANCE``)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}.{k}: missing" for k in want if k not in got]
        out += [f"{path}.{k}: unexpected" for k in got if k not in want]
        for k in want.keys() & got.keys():
            out += differences(got[k], want[k], f"{path}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: {len(got)} items, want {len(want)}"]
        return [
            d
            for i, (g, w) in enumerate(zip(got, want, strict=True))
            for d in differences(g, w, f"{path}[{i}]")
        ]
    if isinstance(want, float) and isinstance(got, (int, float)):
        return [] if abs(got - want) <= FLOAT_TOLERANCE else [f"{path}: {got} != {want}"]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def compared_fields(answer: Answer) -> int:
    """How many leaf values an answer compares (for the printed table)."""

    def leaves(doc: Any) -> int:
        if isinstance(doc, dict):
            return sum(leaves(v) for v in doc.values())
        if isinstance(doc, list):
            return sum(leaves(v) for v in doc)
        return 1

    return 1 + (leaves(answer.body) if answer.body is not None else 0)
