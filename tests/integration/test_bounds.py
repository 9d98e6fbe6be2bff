"""Bounds before work, over real sockets: a request over the model's context or the
configured caps is refused in vLLM's words before any slot is reserved or any generate
call is made (the fake engines record every call; the context length is the fake's
``/v1/models`` ``max_model_len``)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from typing import Any

import httpx

from tests.conftest import Cluster, metric
from tests.needs import missing

CONTEXT = 128


def _completion(prompt: object, **kw: object) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, **kw}


def _refusal(r: httpx.Response) -> tuple[str, str | None]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("BadRequestError", 400)
    return err["message"], err["param"]


def _untouched(cluster: Cluster, ctx: Any) -> None:
    """No generate call, no slot ever taken (dispatch never began)."""
    assert [r.path for e in cluster.engines for r in e.received] == []
    assert metric(ctx, "pdrouter_disagg_decisions_total") == 0


def _context_message(tokens: str) -> str:
    return (
        f"This model's maximum context length is {CONTEXT} tokens. However, your prompt "
        f"contains {tokens} input tokens, which exceeds this limit even without any output "
        "tokens. Please reduce the length of the input prompt."
    )


async def _router(cluster: Cluster, **overrides: Any) -> tuple[str, Any]:
    for e in cluster.engines:
        e.behaviour.max_model_len = CONTEXT
    return await cluster.router("pull", **overrides)


async def test_token_prompt_over_the_context(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, ctx = await _router(cluster)
    assert "/v1/models" in cluster.decode[0].gets  # read at start
    r = await client.post(url + "/v1/completions", json=_completion(list(range(130))))
    assert _refusal(r) == (_context_message("130"), "input_tokens")
    two = [[1, 2], list(range(CONTEXT + 1))]
    r = await client.post(url + "/v1/completions", json=_completion(two))
    assert _refusal(r) == (_context_message(f"at least {CONTEXT + 1}"), "input_tokens")
    _untouched(cluster, ctx)
    assert metric(ctx, "pdrouter_bounds_refusals_total", bound="context") == 2
    r = await client.post(url + "/v1/completions", json=_completion(list(range(CONTEXT))))
    assert r.status_code == 200  # exactly the context: vLLM takes it too
    (card,) = (await client.get(url + "/v1/models")).json()["data"]
    assert card["max_model_len"] == CONTEXT  # as vLLM's own card says it


async def test_output_tokens_over_the_context_or_the_cap(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await _router(cluster, limits={"max_tokens": 16})
    cases = [
        ("/v1/completions", _completion("hi", max_tokens=129), "max_tokens", "max_model_len=128"),
        ("/v1/completions", _completion("hi", max_tokens=17), "max_tokens", "limits.max_tokens=16"),
        (
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "max_completion_tokens": 129,  # read first, as vLLM does
            },
            "max_completion_tokens",
            "max_model_len=128",
        ),
        (
            "/v1/responses",
            {"model": "tiny", "input": "hi", "max_output_tokens": 17},
            "max_output_tokens",
            "limits.max_tokens=16",
        ),
    ]
    for path, body, field, limit in cases:
        r = await client.post(url + path, json=body)
        asked = body[field]
        message = (
            f"{field}={asked} cannot be greater than {limit}. Please request fewer output tokens."
        )
        assert _refusal(r) == (message, field)
    _untouched(cluster, ctx)
    assert metric(ctx, "pdrouter_bounds_refusals_total", bound="max_tokens") == 4
    r = await client.post(url + "/v1/completions", json=_completion("hi"))
    assert r.status_code == 200
    (d_leg,) = cluster.decode[0].received
    assert d_leg.body["max_tokens"] == 16  # no limit asked for: the cap is the limit


async def test_n_and_prompts_over_their_caps(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, ctx = await _router(cluster, limits={"max_n": 2, "max_prompts": 2})
    r = await client.post(url + "/v1/completions", json=_completion("hi", n=3))
    assert _refusal(r) == ("n must be at most 2, got 3.", None)
    r = await client.post(url + "/v1/completions", json=_completion(["a", "b", "c"]))
    assert _refusal(r) == ("prompt list length 3 exceeds the maximum allowed count of 2.", "prompt")
    _untouched(cluster, ctx)


async def test_a_long_text_prompt_is_counted_by_the_engine_only_when_it_could_be_over(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await _router(cluster)
    for prompt in ("hi there", "w" * 60):  # surely within 128 tokens: nothing to count
        r = await client.post(url + "/v1/completions", json=_completion(prompt))
        assert r.status_code == 200
    assert "/tokenize" not in [x.path for e in cluster.engines for x in e.received]
    # 100 bytes may be 100 tokens plus special ones, over 128: counted (100), then served.
    r = await client.post(url + "/v1/completions", json=_completion("w" * 100))
    assert r.status_code == 200
    d_paths = [x.path for x in cluster.decode[0].received]
    assert d_paths[-2:] == ["/tokenize", "/v1/completions"]
    # 200 tokens by the engine's count: refused, no generate call.
    before = [x.path for e in cluster.engines for x in e.received]
    r = await client.post(url + "/v1/completions", json=_completion("w" * 200))
    assert _refusal(r) == (_context_message(f"at least {CONTEXT + 1}"), "input_tokens")
    after = [x.path for e in cluster.engines for x in e.received]
    assert sorted(after) == sorted([*before, "/tokenize"])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w" * 200}]}
    r = await client.post(url + "/v1/chat/completions", json=chat)
    assert _refusal(r)[1] == "input_tokens"
    (tokenized,) = [x for x in cluster.decode[0].received if x.body.get("messages")]
    assert tokenized.path == "/tokenize" and tokenized.body["messages"] == chat["messages"]
    assert metric(ctx, "pdrouter_bounds_refusals_total", bound="context") == 2


async def test_the_configured_context_needs_no_engine(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await cluster.router(
        "pull", model={"max_model_len": 8}, limits={"tokenize_long_prompts": False}
    )
    r = await client.post(url + "/v1/completions", json=_completion("hi", max_tokens=9))
    assert _refusal(r)[0].startswith("max_tokens=9 cannot be greater than max_model_len=8.")
    r = await client.post(url + "/v1/completions", json=_completion("w" * 100))
    assert r.status_code == 200, r.text  # no /tokenize: left to the engine, which would refuse it
    assert all("/v1/models" not in e.gets for e in cluster.engines)
    assert [x.path for e in cluster.engines for x in e.received if x.path == "/tokenize"] == []


async def test_the_messages_are_vllms(cluster: Cluster, client: httpx.AsyncClient) -> None:
    """Each refusal against vLLM 0.32's own validation code, run on the same request."""
    if importlib.util.find_spec("vllm") is None:  # in CI: a failure, not a skip
        missing("needs vLLM: run scripts/setup.sh (engine-cpu extra)")
    case = {"context": CONTEXT, "tokens": 130, "n": 20000, "prompts": 1025}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.fakes.vllm_reference",
        "messages",
        json.dumps(case),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    theirs = {k: tuple(v) for k, v in json.loads(out).items()}
    url, _ = await _router(cluster, limits={"max_n": 16384, "max_prompts": 1024})
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    asks = {
        "max_tokens": ("/v1/completions", _completion("hi", max_tokens=CONTEXT + 1)),
        "max_completion_tokens": (
            "/v1/chat/completions",
            {**chat, "max_completion_tokens": CONTEXT + 1},
        ),
        "max_output_tokens": (
            "/v1/responses",
            {"model": "tiny", "input": "x", "max_output_tokens": CONTEXT + 1},
        ),
        "tokens": ("/v1/completions", _completion(list(range(130)))),
        "one_past": ("/v1/completions", _completion("w" * 300)),
        "n": ("/v1/completions", _completion("hi", n=20000)),
        "prompts": ("/v1/completions", _completion(["p"] * 1025)),
    }
    for name, (path, body) in asks.items():
        ours = _refusal(await client.post(url + path, json=body))
        if name in ("n", "prompts"):
            # vLLM adds how to raise its environment variable; the router's cap is config.
            assert theirs[name][0].startswith(ours[0]) and theirs[name][1] == ours[1], name
        else:
            assert ours == theirs[name], name
