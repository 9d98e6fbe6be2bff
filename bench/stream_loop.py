"""CPU time of the router's per-token loop, ``DecodeLeg.forward``, in memory. Not a test.

    .venv/bin/python bench/stream_loop.py --streams 20000 --tokens 16
    PYTHONPATH=<another checkout> .venv/bin/python bench/stream_loop.py   # the same, there

Forwards ``--streams`` streams of ``--tokens`` chat-completion chunks and a ``[DONE]`` from an
in-memory D to a client ``send`` that does nothing, and prints the process CPU time per stream
and per chunk: what the loop itself costs, without sockets, engines or the event loop's I/O
(``bench/router_bench.py`` measures the whole router). Run it alternately in two checkouts to
compare them; the figures move by about 10% between runs on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from router.engines.breaker import Breaker
from router.engines.instance import Instance, Role
from router.pd.decode_leg import DecodeLeg

TOKEN = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":" hello"},"logprobs":null,'
    b'"finish_reason":null}]}\n\n'
)


class _Open:
    """D's response: its HTTP end comes in a read of its own (``ended`` stays False)."""

    ended = False


async def _chunks(tokens: int) -> AsyncIterator[bytes]:
    for _ in range(tokens):
        yield TOKEN
    yield b"data: [DONE]\n\n"


async def _send(message: Any) -> None:
    pass


def _more(chunk: bytes) -> Awaitable[None]:
    return _send({"type": "http.response.body", "body": chunk, "more_body": True})


async def _run(streams: int, tokens: int) -> float:
    inst = Instance("http://d:8000", Role.DECODE, "m", Breaker(3, 10.0), slots=4)
    start = time.process_time()
    for _ in range(streams):
        leg = DecodeLeg(inst, _Open(), TOKEN, _chunks(tokens))  # type: ignore[arg-type]
        # As the relay (router/relay.py) does: the leg's bytes as ASGI body messages.
        await leg.forward(_more)
        await _send({"type": "http.response.body", "body": leg.tail, "more_body": False})
    return (time.process_time() - start) / streams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=20000)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    per_stream = asyncio.run(_run(args.streams, args.tokens))
    per_chunk = per_stream / (args.tokens + 1)
    print(f"{per_stream * 1e6:.2f} us per stream, {per_chunk * 1e9:.0f} ns per chunk")


if __name__ == "__main__":
    main()
