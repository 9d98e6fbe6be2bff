"""The refusal matrix, on real sockets (fake engines): every endpoint the router serves, by a
body that is not JSON, empty or not an object, a field of the wrong type, a required field
missing, a body over ``admission.max_body_bytes``, a prompt over the context, and bad
credentials. Each row states the answer exactly (status, error ``type``, ``code``, ``param``,
and the message where vLLM's is fixed text), and each refusal is made before any work: no
engine call (the fake engines record every one), no dispatch (so no decode slot) and no key
lease. ``test_the_expectations_are_vllms`` sends the same requests to vLLM 0.32's own routes
(``tests/fakes/vllm_reference.py``) and checks the rows against its answers.

Where the router differs from ``vllm serve`` on purpose (docs/vllm-compatibility.md): a body over
``admission.max_body_bytes`` is a 413 (vLLM has no cap); with keys configured every route
but ``/health`` and ``/ready`` needs one (vLLM checks ``/v1`` paths only) and the 401 is an
OpenAI error (vLLM's is ``{"error": "Unauthorized"}``); a body sent without
``content-type: application/json`` is read as JSON (vLLM refuses it).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from router.app import AppContext
from tests.conftest import Cluster, metric
from tests.needs import missing

JSON = {"content-type": "application/json"}
VALID: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 4},
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    },
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 4},
    "/tokenize": {"model": "tiny", "prompt": "hi"},
    "/detokenize": {"model": "tiny", "tokens": [104, 105]},
    # SageMaker-style: a chat completion or a completion by the body's shape
    "/invocations": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    # the Anthropic Messages API: model and max_tokens required
    "/v1/messages": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    },
    # several conversations, one chat completion each
    "/v1/chat/completions/batch": {
        "model": "tiny",
        "messages": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "ho"}]],
        "max_tokens": 4,
    },
}
GENERATE = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/invocations",
    "/v1/chat/completions/batch",
)
# The engine path a route's valid body reaches (else its own).
ENGINE_PATH = {
    "/invocations": "/v1/chat/completions",
    "/v1/chat/completions/batch": "/v1/chat/completions",  # one per conversation
}
NO_HANDLER = (
    "Cannot find suitable handler for request. "
    "Expected one of: ['ChatCompletionRequest', 'CompletionRequest']"
)
BAD = "Bad Request"  # vLLM's type for a body its request model refuses (FastAPI's validation)
NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"
_DROP = object()


def _with(path: str, **fields: Any) -> bytes:
    """The endpoint's valid body with ``fields`` changed (``_DROP``: removed)."""
    body = {**VALID[path], **fields}
    return json.dumps({k: v for k, v in body.items() if v is not _DROP}).encode()


@dataclass(frozen=True)
class Refusal:
    """A request and the 400 it gets, from the router as from vLLM."""

    path: str
    body: bytes
    type: str
    param: str | None
    message: str | None = None  # only where vLLM's is fixed text (else: pydantic's dump)


def _body_rows() -> dict[str, Refusal]:
    rows: dict[str, Refusal] = {}
    for path in VALID:
        name = path.rsplit("/", 1)[-1]
        if path == "/invocations":  # vLLM reads its body itself
            quotes = "JSON decode error: Expecting property name enclosed in double quotes"
            rows[f"{name}: not JSON"] = Refusal(
                path, b'{"model": "tiny",', BAD, None, f"{quotes}: line 1 column 18 (char 17)"
            )
            rows[f"{name}: broken JSON"] = Refusal(
                path, b"{bad", BAD, None, f"{quotes}: line 1 column 2 (char 1)"
            )
            rows[f"{name}: empty body"] = Refusal(
                path, b"", BAD, None, "JSON decode error: Expecting value: line 1 column 1 (char 0)"
            )
            rows[f"{name}: not an object"] = Refusal(path, b"[1, 2]", "BadRequestError", None)
            continue
        rows[f"{name}: not JSON"] = Refusal(path, b'{"model": "tiny",', BAD, "body.17")
        rows[f"{name}: broken JSON"] = Refusal(path, b"{bad", BAD, "body.1")
        rows[f"{name}: empty body"] = Refusal(path, b"", BAD, "body")
        rows[f"{name}: not an object"] = Refusal(path, b"[1, 2]", BAD, "body")
        rows[f"{name}: model not a string"] = Refusal(path, _with(path, model=5), BAD, "body.model")
    completions, chat, responses, invocations, batch = GENERATE
    vllm = "BadRequestError"  # vLLM's own checks, in its words
    rows |= {
        # wrong type
        "completions: max_tokens": Refusal(
            completions, _with(completions, max_tokens="many"), BAD, "body.max_tokens"
        ),
        "completions: max_tokens fractional": Refusal(
            completions, _with(completions, max_tokens=1.5), BAD, "body.max_tokens"
        ),
        "completions: stream": Refusal(
            completions, _with(completions, stream="maybe"), BAD, "body.stream"
        ),
        "completions: prompt a number": Refusal(
            completions, _with(completions, prompt=5), BAD, "body.prompt"
        ),
        "completions: prompt mixed": Refusal(
            completions, _with(completions, prompt=[1, "a"]), BAD, "body.prompt.1"
        ),
        "completions: negative token id": Refusal(
            completions, _with(completions, prompt=[5, -1]), BAD, "body.prompt.1"
        ),
        "completions: stream_options": Refusal(
            completions,
            _with(completions, stream=True, stream_options=5),
            BAD,
            "body.stream_options",
        ),
        "chat: messages": Refusal(chat, _with(chat, messages="hi"), BAD, "body.messages"),
        "chat: n": Refusal(chat, _with(chat, n="two"), BAD, "body.n"),
        "chat: max_completion_tokens": Refusal(
            chat, _with(chat, max_completion_tokens="x"), BAD, "body.max_completion_tokens"
        ),
        "responses: input": Refusal(responses, _with(responses, input=5), BAD, "body.input"),
        "responses: max_output_tokens": Refusal(
            responses, _with(responses, max_output_tokens="x"), BAD, "body.max_output_tokens"
        ),
        "tokenize: prompt": Refusal("/tokenize", _with("/tokenize", prompt=5), BAD, "body.prompt"),
        "tokenize: messages": Refusal(
            "/tokenize", _with("/tokenize", prompt=_DROP, messages="hi"), BAD, "body.prompt"
        ),
        "detokenize: tokens": Refusal(
            "/detokenize", _with("/detokenize", tokens="x"), BAD, "body.tokens"
        ),
        "detokenize: a token": Refusal(
            "/detokenize", _with("/detokenize", tokens=["a"]), BAD, "body.tokens.0"
        ),
        # missing (completions: vLLM's model takes no prompt; its validator refuses it)
        "completions: no prompt": Refusal(
            completions, _with(completions, prompt=_DROP), "BadRequestError", "prompt", NO_PROMPT
        ),
        "completions: empty prompt": Refusal(
            completions, _with(completions, prompt=""), "BadRequestError", "prompt", NO_PROMPT
        ),
        "chat: no messages": Refusal(chat, _with(chat, messages=_DROP), BAD, "body.messages"),
        "responses: no input": Refusal(responses, _with(responses, input=_DROP), BAD, "body.input"),
        "tokenize: no prompt or messages": Refusal(
            "/tokenize", _with("/tokenize", prompt=_DROP), BAD, "body.prompt"
        ),
        "detokenize: no tokens": Refusal(
            "/detokenize", _with("/detokenize", tokens=_DROP), BAD, "body.tokens"
        ),
        # /v1/messages: vLLM's Anthropic request model
        "messages: no model": Refusal(
            "/v1/messages", _with("/v1/messages", model=_DROP), BAD, "body.model"
        ),
        "messages: no max_tokens": Refusal(
            "/v1/messages", _with("/v1/messages", max_tokens=_DROP), BAD, "body.max_tokens"
        ),
        "messages: max_tokens 0": Refusal(
            "/v1/messages", _with("/v1/messages", max_tokens=0), BAD, "body.max_tokens"
        ),
        "messages: no messages": Refusal(
            "/v1/messages", _with("/v1/messages", messages=_DROP), BAD, "body.messages"
        ),
        "messages: messages a string": Refusal(
            "/v1/messages", _with("/v1/messages", messages="hi"), BAD, "body.messages"
        ),
        "messages: stream": Refusal(
            "/v1/messages", _with("/v1/messages", stream="maybe"), BAD, "body.stream"
        ),
        # /v1/chat/completions/batch: vLLM's batch checks first, then its request model
        "batch: n": Refusal(
            batch,
            _with(batch, n=2),
            vllm,
            "n",
            "Batch chat completions do not support `n > 1`. Please set `n` to 1. "
            "(parameter=n, value=2)",
        ),
        "batch: beam search": Refusal(
            batch,
            _with(batch, use_beam_search=True),
            vllm,
            "use_beam_search",
            "Batch chat completions do not support beam search. Please set `use_beam_search` "
            "to False. (parameter=use_beam_search)",
        ),
        "batch: logprob_token_ids without logprobs": Refusal(
            batch,
            _with(batch, logprob_token_ids=[1]),
            vllm,
            "logprob_token_ids",
            "when using `logprob_token_ids`, `logprobs` must be set to true. "
            "(parameter=logprob_token_ids)",
        ),
        "batch: prompt_token_ids": Refusal(
            batch,
            _with(batch, kv_transfer_params={"prompt_token_ids": [1, 2]}),
            vllm,
            "kv_transfer_params.prompt_token_ids",
            "Batch chat completions do not support `kv_transfer_params['prompt_token_ids']`: "
            "one pre-tokenized prompt cannot serve several conversations. "
            "(parameter=kv_transfer_params.prompt_token_ids)",
        ),
        "batch: no messages": Refusal(batch, _with(batch, messages=_DROP), BAD, "body.messages"),
        "batch: messages a string": Refusal(
            batch, _with(batch, messages="hi"), BAD, "body.messages"
        ),
        "batch: no conversations": Refusal(batch, _with(batch, messages=[]), BAD, "body.messages"),
        "batch: an empty conversation": Refusal(
            batch, _with(batch, messages=[[]]), BAD, "body.messages.0"
        ),
        "batch: a conversation not a list": Refusal(
            batch,
            _with(batch, messages=[{"role": "user", "content": "hi"}]),
            BAD,
            "body.messages.0",
        ),
        "batch: max_tokens": Refusal(batch, _with(batch, max_tokens="x"), BAD, "body.max_tokens"),
        "batch: tool_choice": Refusal(
            batch, _with(batch, tool_choice="auto"), BAD, "body.tool_choice"
        ),
        # /invocations: chat if the body fits chat's request model, else a completion
        "invocations: messages not a list, no prompt": Refusal(
            invocations, _with(invocations, messages="hi"), "BadRequestError", "prompt", NO_PROMPT
        ),
        "invocations: neither messages nor prompt": Refusal(
            invocations, _with(invocations, messages=_DROP), "BadRequestError", "prompt", NO_PROMPT
        ),
        "invocations: prompt a number": Refusal(
            invocations,
            _with(invocations, messages=_DROP, prompt=5),
            "BadRequestError",
            None,
            NO_HANDLER,
        ),
        "invocations: max_tokens": Refusal(
            invocations,
            _with(invocations, max_tokens="many"),
            "BadRequestError",
            "prompt",
            NO_PROMPT,
        ),
        "invocations: max_tokens with a prompt": Refusal(
            invocations,
            _with(invocations, messages=_DROP, prompt="hi", max_tokens="many"),
            "BadRequestError",
            None,
            NO_HANDLER,
        ),
    }
    return rows


BODY_ROWS = _body_rows()


def _error(r: httpx.Response) -> dict[str, Any]:
    doc = r.json()
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}
    err: dict[str, Any] = doc["error"]
    return err


def _untouched(cluster: Cluster, ctx: AppContext, allowed: tuple[str, ...] = ()) -> None:
    """No engine call (but to ``allowed`` paths), no dispatch (the decision comes before a
    decode slot is reserved), no key lease, no slot held."""
    posts = [r.path for e in cluster.engines for r in e.received if r.path not in allowed]
    assert posts == []
    assert metric(ctx, "pdrouter_disagg_decisions_total") == 0
    assert metric(ctx, "pdrouter_key_requests_total", result="admitted") == 0
    assert ctx.registry.slots_in_use() == 0


async def _served_after(
    cluster: Cluster,
    client: httpx.AsyncClient,
    url: str,
    ctx: AppContext,
    path: str,
    content: bytes | None = None,
) -> None:
    """The endpoint's valid body (or ``content``) is then served, with an engine call and a
    lease: what :func:`_untouched` checks could have been seen."""
    r = await client.post(url + path, content=content or json.dumps(VALID[path]), headers=JSON)
    assert r.status_code == 200, r.text
    assert ENGINE_PATH.get(path, path) in [r.path for e in cluster.engines for r in e.received]
    assert metric(ctx, "pdrouter_key_requests_total", result="admitted") == 1


@pytest.mark.parametrize("path", list(VALID))
async def test_a_bad_body_is_refused_as_vllm_refuses_it(
    cluster: Cluster, client: httpx.AsyncClient, path: str
) -> None:
    """Every row of the endpoint, on one router; the counters are checked after each."""
    url, ctx = await cluster.router("pull")
    rows = {name: row for name, row in BODY_ROWS.items() if row.path == path}
    for count, (name, row) in enumerate(rows.items(), 1):
        r = await client.post(url + path, content=row.body, headers=JSON)
        assert r.status_code == 400, (name, r.text)
        err = _error(r)
        assert (err["type"], err["code"], err["param"]) == (row.type, 400, row.param), name
        if row.message is not None:
            assert err["message"] == row.message, name
        else:  # the router's own words, naming the field
            field = (row.param or "body").removeprefix("body.").split(".")[0]
            assert field.isdigit() or field in err["message"], (name, err["message"])
        _untouched(cluster, ctx)
        if path in GENERATE:
            assert metric(ctx, "pdrouter_requests_total", outcome="client_error") == count
    await _served_after(cluster, client, url, ctx, path)


CAP = 1024  # admission.max_body_bytes, its least value


async def _chunks(body: bytes) -> AsyncIterator[bytes]:
    """The body without a content-length (chunked): the cap is found while reading."""
    yield body[: len(body) // 2]
    yield body[len(body) // 2 :]


@pytest.mark.parametrize("path", list(VALID))
async def test_a_body_over_the_cap_is_refused_before_it_is_read(
    cluster: Cluster, client: httpx.AsyncClient, path: str
) -> None:
    """The router's own bound (vLLM has none): one byte over is a 413, whether the size is
    declared or not; exactly the cap is served."""
    url, ctx = await cluster.router("pull", admission={"max_body_bytes": CAP})
    bare = len(_with(path, padding=""))
    over = _with(path, padding="x" * (CAP + 1 - bare))
    assert len(over) == CAP + 1
    for content in (over, _chunks(over)):
        r = await client.post(url + path, content=content, headers=JSON)
        assert r.status_code == 413, r.text
        assert _error(r) == {
            "message": f"request body exceeds {CAP} bytes",
            "type": "BadRequestError",
            "param": None,
            "code": 413,
        }
    _untouched(cluster, ctx)
    at_cap = _with(path, padding="x" * (CAP - bare))
    await _served_after(cluster, client, url, ctx, path, at_cap)


CONTEXT = 128


def _context_message(tokens: str) -> str:
    return (
        f"This model's maximum context length is {CONTEXT} tokens. However, your prompt "
        f"contains {tokens} input tokens, which exceeds this limit even without any output "
        "tokens. Please reduce the length of the input prompt."
    )


# A prompt over the context, per generate endpoint: token ids are counted by the router, text
# by an engine's /tokenize (one past the context: vLLM says "at least"). The messages are
# vLLM's (tests/integration/test_bounds.py checks them against vLLM's code).
OVER_CONTEXT = {
    "/v1/completions": (_with("/v1/completions", prompt=list(range(CONTEXT + 2))), "130"),
    "/v1/chat/completions": (
        _with("/v1/chat/completions", messages=[{"role": "user", "content": "w" * 300}]),
        f"at least {CONTEXT + 1}",
    ),
    "/v1/responses": (_with("/v1/responses", input="w" * 300), f"at least {CONTEXT + 1}"),
    "/invocations": (
        _with("/invocations", messages=[{"role": "user", "content": "w" * 300}]),
        f"at least {CONTEXT + 1}",
    ),
    "/v1/chat/completions/batch": (  # one conversation over: the batch is refused
        _with(
            "/v1/chat/completions/batch",
            messages=[
                [{"role": "user", "content": "hi"}],
                [{"role": "user", "content": "w" * 300}],
            ],
        ),
        f"at least {CONTEXT + 1}",
    ),
}


@pytest.mark.parametrize("path", GENERATE)
async def test_a_prompt_over_the_context_is_refused_before_any_generate_call(
    cluster: Cluster, client: httpx.AsyncClient, path: str
) -> None:
    for e in cluster.engines:
        e.behaviour.max_model_len = CONTEXT
    url, ctx = await cluster.router("pull")
    body, tokens = OVER_CONTEXT[path]
    r = await client.post(url + path, content=body, headers=JSON)
    assert r.status_code == 400, r.text
    assert _error(r) == {
        "message": _context_message(tokens),
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
    _untouched(cluster, ctx, allowed=("/tokenize",))  # counting a text prompt is no work
    assert metric(ctx, "pdrouter_bounds_refusals_total", bound="context") == 1
    await _served_after(cluster, client, url, ctx, path)


# -- credentials -------------------------------------------------------------------------

KEY = "refusal-matrix-key"
AUTH = {"keys": [{"name": "team-a", "key": KEY}]}
UNAUTHORIZED = {
    "message": "missing or invalid API key (send Authorization: Bearer <key>)",
    "type": "authentication_error",
    "param": None,
    "code": "invalid_api_key",
}
# Every route the router serves but the probes (tests/integration/test_security.py keeps the
# list complete), and paths it does not serve: a 401, not a 404 listing the routes.
GUARDED = [
    *(("POST", p) for p in VALID),
    ("GET", "/v1/models"),
    ("GET", "/version"),
    ("GET", "/tokenizer_info"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/docs/oauth2-redirect"),
    ("GET", "/redoc"),
    ("GET", "/no/such/route"),
    ("POST", "/v1/embeddings"),
]
PROBES = [("GET", "/health"), ("GET", "/ready")]
# (headers, the reason counted in pdrouter_auth_failures_total)
CREDENTIALS: dict[str, tuple[dict[str, str], str]] = {
    "no key": ({}, "missing"),
    "wrong key": ({"authorization": "Bearer not-the-key"}, "invalid"),
    "bearer without a key": ({"authorization": "Bearer"}, "invalid"),
    "basic scheme": ({"authorization": f"Basic {KEY}"}, "scheme"),
    "token scheme": ({"authorization": f"Token {KEY}"}, "scheme"),
    "bare key": ({"authorization": KEY}, "scheme"),
}
# Not JSON and over the cap: a route that read the body before the key would answer 400/413.
_UNREAD = b"{" + b"x" * 2 * CAP


async def test_bad_credentials_are_refused_on_every_route_before_the_body(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await cluster.router(
        "pull", auth=AUTH, admission={"max_body_bytes": CAP}, health_checks=True
    )
    gets = [list(e.gets) for e in cluster.engines]  # the router's own reads at start
    for count, (name, (headers, reason)) in enumerate(CREDENTIALS.items(), 1):
        for method, path in GUARDED:
            content = _UNREAD if method == "POST" else None
            r = await client.request(method, url + path, content=content, headers=headers)
            assert (r.status_code, _error(r)) == (401, UNAUTHORIZED), (name, method, path)
            assert r.headers["www-authenticate"] == "Bearer"
        for method, path in PROBES:  # open: probes carry no credentials
            assert (await client.request(method, url + path, headers=headers)).status_code == 200
        assert metric(ctx, "pdrouter_auth_failures_total") == count * len(GUARDED), name
        assert metric(ctx, "pdrouter_auth_failures_total", reason=reason) >= len(GUARDED), name
    for reason in ("missing", "invalid", "scheme"):
        wanted = [r for h, r in CREDENTIALS.values() if r == reason]
        seen = metric(ctx, "pdrouter_auth_failures_total", reason=reason)
        assert seen == len(wanted) * len(GUARDED), reason
    _untouched(cluster, ctx)
    assert [e.gets for e in cluster.engines] == gets  # /version, /v1/models: not forwarded
    # The right key is served: the refusals above were the credentials'.
    auth = {"authorization": f"Bearer {KEY}"}
    r = await client.post(url + "/v1/completions", json=VALID["/v1/completions"], headers=auth)
    assert r.status_code == 200, r.text


# -- the expectations against vLLM's own code -------------------------------------------


def _vllm_answers(asks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``asks`` answered by vLLM's own routes (tests/fakes/vllm_reference.py, in a process of
    its own: importing vLLM loads torch)."""
    if importlib.util.find_spec("vllm") is None:
        missing("needs vLLM: run scripts/setup.sh (engine-cpu extra)")
    done = subprocess.run(
        [sys.executable, "-m", "tests.fakes.vllm_reference", "refusals"],
        input=json.dumps(asks),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answers: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return answers


def _ask(
    method: str, path: str, body: bytes | None, headers: dict[str, str], **overrides: Any
) -> dict[str, Any]:
    return {
        "method": method,
        "path": path,
        "headers": headers,
        "body_b64": None if body is None else base64.b64encode(body).decode(),
        "overrides": overrides,
    }


def test_the_expectations_are_vllms() -> None:
    """Each body row above is answered so by vLLM 0.32, and vLLM refuses bad credentials with
    a 401 on the routes it guards (``/v1``; its body carries no type or code)."""
    rows = list(BODY_ROWS.values())
    asks = [_ask("POST", row.path, row.body, JSON) for row in rows]
    v1 = [(m, p) for m, p in GUARDED if p.startswith("/v1/")]
    for headers, _ in CREDENTIALS.values():
        asks += [_ask(m, p, None, {**JSON, **headers}, api_key=[KEY]) for m, p in v1]
    right = {**JSON, "authorization": f"Bearer {KEY}"}
    asks.append(_ask("POST", "/v1/completions", b"{bad", right, api_key=[KEY]))
    answers = _vllm_answers(asks)
    assert len(answers) == len(asks)
    for row, answer in zip(rows, answers, strict=False):
        err = answer["body"]["error"]
        ours = (400, row.type, 400, row.param)
        assert (answer["status"], err["type"], err["code"], err["param"]) == ours, (row, answer)
        if row.message is not None:
            assert err["message"] == row.message
    for answer in answers[len(rows) : -1]:
        assert answer == {"status": 401, "body": {"error": "Unauthorized"}}
    assert answers[-1]["status"] == 400  # the right key: on to the body, which is refused
