"""vLLM's own code as the reference of the drop-in checks, without an engine.

``python -m tests.fakes.vllm_reference PORT '{"allowed_origins": [...]}'`` serves a FastAPI
app with the middleware ``vllm serve`` installs (``init_entrypoints_middleware``, from
vLLM's own source, with its command-line defaults and the given overrides) around stub
routes: what ``vllm serve`` answers before any route runs (CORS preflights, keys).

``python -m tests.fakes.vllm_reference messages '{"context": 64, ...}'`` prints, as JSON,
the ``(message, param)`` of vLLM's own refusals of requests over its bounds (the request
validation vLLM runs before any engine work), for the cases named in
:func:`bound_messages`.

Run in a process of its own: importing vLLM takes seconds and loads torch, which the test
process does not need.
"""

from __future__ import annotations

import argparse
import json
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
    port = int(sys.argv[1])
    overrides = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    uvicorn.run(build(overrides), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
