"""``pd-router demo``: start a local P/D stack, stream one chat answer, show TTFT and NIXL bytes.

The stack (SmolLM2-135M-Instruct by default, P and D vLLM engines, router) is torn down on exit,
on Ctrl-C and on SIGTERM; nothing is left running unless ``--keep-running`` is given (then until
Ctrl-C).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from types import FrameType
from typing import Any

from router.config import Mode
from router.stack.launcher import Stack, StackError
from router.stack.metrics import MetricsPage
from router.stack.model import DEFAULT_VARIANT, known_variants

BYTES_METRIC = "vllm:nixl_bytes_transferred_sum"
# This project's connector (pipelined mode) counts bytes under its own names.
PIPELINED_BYTES_METRICS = ("vllm:pdr_bytes_written_total", "vllm:pdr_bytes_received_total")
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
DEFAULT_PROMPT = "Explain in one paragraph why prefill and decode run on different engines."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the demo's flags on ``parser`` (called by ``pd-router``'s CLI)."""
    parser.add_argument(
        "--mode", choices=[m.value for m in Mode], default=Mode.PUSH.value, help="P/D mode"
    )
    parser.add_argument("--port", type=int, default=None, help="router port (default: free)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message to send")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens to generate")
    parser.add_argument(
        "--cache-dir", default=None, help="model/log cache (default $PD_ROUTER_CACHE or ~/.cache)"
    )
    parser.add_argument(
        "--variant",
        default=DEFAULT_VARIANT,
        choices=known_variants(),
        help="model: smollm2 (real, default) or a random-weight one (tiny, bench)",
    )
    parser.add_argument(
        "--keep-running", action="store_true", help="leave the stack up until Ctrl-C"
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit code (0 on success)."""
    # Explicit handlers: a shell starts background jobs with SIGINT ignored, and Python's
    # default SIGTERM action would skip the teardown.
    previous = {s: signal.signal(s, _raise_keyboard_interrupt) for s in _STOP_SIGNALS}
    try:
        with Stack(
            mode=args.mode,
            variant=args.variant,
            cache_dir=args.cache_dir,
            router_port=args.port,
            prefix_caching=True,  # as a deployment runs: a repeated prompt or history is reused
        ) as stack:
            _show_request(stack, args.prompt, args.max_tokens)
            if args.keep_running:
                print(f"\nrouter at {stack.router_url}/v1 - Ctrl-C to stop", flush=True)
                while True:
                    time.sleep(3600)
    except KeyboardInterrupt:
        print("\ninterrupted; stack stopped", file=sys.stderr)
        return 130
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _show_request(stack: Stack, prompt: str, max_tokens: int) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{stack.router_url}/v1", api_key="demo", max_retries=0)
    # The first P/D request pays the NIXL handshake; measure the second one.
    _stream_chat(client, stack.model_name, "warm-up", 4, echo=False)
    before = _bytes_by_engine(stack)
    print(f"\n> {prompt}\n", flush=True)
    ttft, tokens = _stream_chat(client, stack.model_name, prompt, max_tokens, echo=True)
    after = _bytes_by_engine(stack)
    print("\n")
    print(f"mode:              {stack.mode.value}")
    print(f"client TTFT:       {ttft * 1000:.1f} ms ({tokens} chunks)")
    for name in after:
        moved = after[name] - before.get(name, 0.0)
        print(f"NIXL bytes {name + ':':<10} {moved:,.0f} this request, {after[name]:,.0f} total")
    print(f"logs:              {stack.run_dir}", flush=True)


def _stream_chat(
    client: Any, model: str, prompt: str, max_tokens: int, *, echo: bool
) -> tuple[float, int]:
    """Stream one chat completion; returns (seconds to first content chunk, content chunks)."""
    start = time.perf_counter()
    ttft: float | None = None
    chunks = 0
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        text = chunk.choices[0].delta.content if chunk.choices else None
        if not text:
            continue
        if ttft is None:
            ttft = time.perf_counter() - start
        chunks += 1
        if echo:
            print(text, end="", flush=True)
    return (ttft if ttft is not None else float("nan")), chunks


def _bytes_by_engine(stack: Stack) -> dict[str, float]:
    """NIXL bytes each engine reports (D in pull mode reads, P in push mode writes)."""
    totals: dict[str, float] = {}
    names = PIPELINED_BYTES_METRICS if stack.mode is Mode.PIPELINED else (BYTES_METRIC,)
    for spec in stack.engines:
        metrics: MetricsPage = stack.engine_metrics(spec.name)
        totals[spec.name] = sum(metrics.total(n) for n in names)
    return totals
