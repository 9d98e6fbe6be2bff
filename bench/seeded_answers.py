"""Is a long answer through P/D the router's doing? vLLM's own structured-output and Responses
tests, sampled and seeded, sent to D alone and through the router, side by side. Not a test.

    flock /tmp/pd-engines.lock .venv/bin/python bench/seeded_answers.py --mode pull --seeds 1 2 3

Starts a real-engine stack of ``--mode`` (SmolLM2-135M-Instruct, fp32, P on core 0, D on core 1:
``router.stack``) and sends, for each seed, each request once to D's own URL (``vllm serve``
with the connector, no transfer: an aggregated engine on D's core) and once to the router, in
alternating order. The requests are those vLLM 0.32's server tests send: a chat asking for an
employee profile under a JSON schema (``structured_outputs``, ``max_completion_tokens=1000``,
the model's default sampling) and a Responses request with ``top_logprobs`` and the logprobs
``include``. Prints per request the completion tokens and seconds on each side, whether the
answers are token for token the same, and the ratio of the router's seconds to D's.

What it showed (docs/vllm-compatibility.md): the same seed gives the same answer and about the
same time both ways; how long an answer is depends on the seed alone (a sampled 135M model may
fill a JSON string until ``max_completion_tokens``: 1000 tokens take over a minute on one CPU
core), which is what made vLLM's tests time out through a P/D stack.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import httpx

from router.stack import Stack

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 3},
        "work_history": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "company": {"type": "string"},
                    "duration": {"type": "number"},
                    "position": {"type": "string"},
                },
                "required": ["company", "position"],
            },
        },
    },
    "required": ["name", "age", "skills", "work_history"],
}
PROFILE = f"Give an example JSON for an employee profile that fits this schema: {SCHEMA}"


def _requests(model: str, seed: int) -> dict[str, tuple[str, dict[str, Any]]]:
    messages = [
        {"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": PROFILE},
    ]
    chat = {"model": model, "messages": messages, "max_completion_tokens": 1000, "seed": seed}
    responses = {"model": model, "input": "What is 13 * 24?", "top_logprobs": 5, "seed": seed}
    return {
        "json chat": ("/v1/chat/completions", chat | {"structured_outputs": {"json": SCHEMA}}),
        "responses logprobs": (
            "/v1/responses",
            responses | {"include": ["message.output_text.logprobs"]},
        ),
    }


def _answer(
    client: httpx.Client, url: str, path: str, body: dict[str, Any]
) -> tuple[Any, int, float]:
    t0 = time.monotonic()
    r = client.post(url + path, json=body)
    seconds = time.monotonic() - t0
    r.raise_for_status()
    doc = r.json()
    if "choices" in doc:
        return doc["choices"][0]["message"]["content"], doc["usage"]["completion_tokens"], seconds
    return doc["output"], doc["usage"]["output_tokens"], seconds


def run(mode: str, seeds: list[int]) -> list[float]:
    ratios: list[float] = []
    with (
        open(os.devnull, "w") as log,
        Stack(mode, variant="smollm2", log=log) as stack,
        httpx.Client(timeout=600) as client,
    ):
        sides = {"router": stack.router_url, "D": stack.decode.url}
        print(f"mode {mode}; D at {sides['D']}; router at {sides['router']}")
        print(
            f"{'request':20} {'seed':>4} {'D tokens':>8} {'D s':>6} {'router tokens':>13} "
            f"{'router s':>8} {'same':>5} {'ratio':>6}"
        )
        for i, seed in enumerate(seeds):
            for name, (path, body) in _requests(stack.model_name, seed).items():
                order = ["D", "router"] if i % 2 == 0 else ["router", "D"]
                got = {side: _answer(client, sides[side], path, body) for side in order}
                (d_out, d_tokens, d_s), (r_out, r_tokens, r_s) = got["D"], got["router"]
                ratios.append(r_s / d_s)
                print(
                    f"{name:20} {seed:>4} {d_tokens:>8} {d_s:>6.1f} {r_tokens:>13} "
                    f"{r_s:>8.1f} {_same(d_out, r_out)!s:>5} {r_s / d_s:>6.2f}",
                    flush=True,
                )
    return ratios


def _same(a: Any, b: Any) -> bool:
    """Equal answers: the same text (Responses: the same output text, ids aside)."""
    if isinstance(a, list) and isinstance(b, list):
        return _texts(a) == _texts(b)
    return bool(a == b)


def _texts(output: list[dict[str, Any]]) -> list[str]:
    return [c.get("text", "") for item in output for c in item.get("content") or []]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="pull")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    ratios = run(args.mode, args.seeds)
    print(
        f"router s / D s: median {statistics.median(ratios):.2f}, "
        f"range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} requests"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
