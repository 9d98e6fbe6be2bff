"""vLLM's own code as the reference of the drop-in checks, without an engine.

``python -m tests.fakes.vllm_reference PORT '{"allowed_origins": [...]}'`` serves a FastAPI
app with the middleware ``vllm serve`` installs (``init_entrypoints_middleware``, from
vLLM's own source, with its command-line defaults and the given overrides) around stub
routes: what ``vllm serve`` answers before any route runs (CORS preflights, keys).

``python -m tests.fakes.vllm_reference messages '{"context": 64, ...}'`` prints, as JSON,
the ``(message, param)`` of vLLM's own refusals of requests over its bounds (the request
validation vLLM runs before any engine work), for the cases named in
:func:`bound_messages`.

``python -m tests.fakes.vllm_reference refusals < asks.json`` answers each request of a JSON
list (``method``, ``path``, ``headers``, ``body_b64``, ``overrides``) with vLLM's own routes,
request models, exception handlers and middleware and no engine behind them
(:func:`refusal_app`), and prints each answer's status and body as JSON: what ``vllm serve``
answers to a request it refuses before any engine work.

Run in a process of its own: importing vLLM takes seconds and loads torch, which the test
process does not need.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import Any


def build(overrides: dict[str, Any]) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from vllm.entrypoints.launchers.cli_args import FrontendArgs
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    args = argparse.Namespace(**{**vars(FrontendArgs()), **overrides})
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        return JSONResponse({"object": "text_completion", "choices": []})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    init_entrypoints_middleware(args, app, ())
    return app


def refusal_app(overrides: dict[str, Any]) -> Any:
    """vLLM's app as ``vllm serve`` builds it, less the engine: its API routers (their request
    models and JSON check), exception handlers and middleware. A request it refuses is
    refused as ``vllm serve`` refuses it; one it would serve reaches a handler that is not
    there (a 500 naming the missing state)."""
    from fastapi import FastAPI
    from vllm.entrypoints.anthropic import api_router as anthropic
    from vllm.entrypoints.launchers.cli_args import FrontendArgs
    from vllm.entrypoints.openai.chat_completion import api_router as chat
    from vllm.entrypoints.openai.completion import api_router as completion
    from vllm.entrypoints.openai.models import api_router as models
    from vllm.entrypoints.openai.responses import api_router as responses
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
    from vllm.entrypoints.serve.tokenize import api_router as tokenize

    args = argparse.Namespace(**{**vars(FrontendArgs()), **overrides})
    app = FastAPI()
    app.state.args = args
    for module in (completion, chat, responses, tokenize, models, anthropic):
        module.attach_router(app)
    # /invocations, as for a generate model: it picks its handler by the body's shape, and
    # refuses one that fits none through the tokenizer's serving object (its error builder
    # alone is needed here); the stand-in handlers are never reached by a refusal.
    from types import SimpleNamespace

    from vllm.entrypoints.serve.engine.serving import BaseServing
    from vllm.entrypoints.serve.sagemaker import api_router as sagemaker

    app.state.openai_serving_chat = app.state.openai_serving_completion = object()
    app.state.serving_tokenization = SimpleNamespace(
        create_error_response=BaseServing.create_error_response
    )
    sagemaker.attach_router(app, ("generate",))
    init_exception_handler(app)
    init_entrypoints_middleware(args, app, ())
    return app


def refusals(asks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ask answered by :func:`refusal_app` (one app per distinct ``overrides``)."""
    import base64

    from starlette.testclient import TestClient

    clients: dict[str, Any] = {}
    answers = []
    for ask in asks:
        overrides = ask.get("overrides", {})
        name = json.dumps(overrides, sort_keys=True)
        if name not in clients:
            clients[name] = TestClient(refusal_app(overrides), raise_server_exceptions=False)
        body = ask.get("body_b64")
        r = clients[name].request(
            ask["method"],
            ask["path"],
            content=None if body is None else base64.b64decode(body),
            headers=ask.get("headers", {}),
        )
        try:
            doc = r.json()
        except ValueError:
            doc = r.text
        answers.append({"status": r.status_code, "body": doc})
    return answers


def bound_messages(case: dict[str, Any]) -> dict[str, tuple[str, str | None]]:
    """vLLM's refusals: an output limit over the context (per field name), prompts of
    ``tokens`` and of one token past the context, ``n`` and a prompt list over its caps."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.params import TokenizeParams
    from vllm.sampling_params import _verify_num_sequences

    context = int(case["context"])
    out: dict[str, tuple[str, str | None]] = {}

    def refusal(name: str, check: Any) -> None:
        try:
            check()
        except VLLMValidationError as exc:
            out[name] = (str(exc.args[0]), exc.parameter)

    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        refusal(
            field,
            lambda field=field: TokenizeParams(
                max_total_tokens=context,
                max_output_tokens=context + 1,
                max_total_tokens_param="max_model_len",
                max_output_tokens_param=field,
            ),
        )
    params = TokenizeParams(max_total_tokens=context, max_total_tokens_param="max_model_len")
    for name, count in (("tokens", int(case["tokens"])), ("one_past", context + 1)):
        refusal(name, lambda count=count: params._token_len_check(None, list(range(count))))
    refusal("n", lambda: _verify_num_sequences(int(case["n"]), "n"))
    prompts = ["p"] * int(case["prompts"])
    refusal("prompts", lambda: CompletionRequest.validate_prompt_list_length({"prompt": prompts}))
    return out


def main() -> None:
    import uvicorn

    if sys.argv[1] == "messages":
        print(json.dumps(bound_messages(json.loads(sys.argv[2]))))
        return
    if sys.argv[1] == "refusals":
        print(json.dumps(refusals(json.load(sys.stdin))))
        return
    overrides = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    # Port 0 here, told on stdout once bound: a port the parent picked as free could be
    # taken by another test's server before this one binds it (the parent then compared
    # the router with whatever answered there).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", int(sys.argv[1])))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(build(overrides), log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
