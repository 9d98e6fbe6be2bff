"""A fast fake vLLM engine for router benchmarks (a separate process).

Raw asyncio protocol + httptools on uvloop: no framework between the socket and
the canned bytes, so the engine is never what a benchmark measures. It speaks
the subset of vLLM's OpenAI API that a P/D router uses:

* ``GET /health`` -> 200.
* ``POST /v1/completions`` and ``/v1/chat/completions``:
  - **P role** (``kv_transfer_params.do_remote_decode`` true): sleeps
    ``prefill_us_per_token`` x prompt tokens, answers one token as JSON with
    ``kv_transfer_params`` (pull shape with ``remote_block_ids`` and P's
    identity; ``transfer_mode`` is ``--transfer-mode``).
  - **D role** (anything else): ``stream=true`` answers SSE, ``--tokens`` events (fewer when
    the request's ``max_tokens`` asks for fewer, down to one)
    ``--itl-ms`` apart then ``[DONE]``; otherwise one JSON body. The first token
    waits for the prefill (prompt-proportional) when D must compute it itself
    (no ``kv_transfer_params``: direct or aggregated), for ``--kv-transfer-ms``
    after a pull handoff (P already finished), and for the prefill time plus
    ``--kv-transfer-ms`` in push (no block ids: P runs concurrently).
  - ``--token-ids``: streamed events carry vLLM 0.32's ``token_ids`` (and a completion's
    ``prompt_token_ids``), null unless ``return_token_ids`` is asked; then each event its
    token's id and a completion's first the prompt's ids (the router asks for them with
    migration on).
  - ``--chunk-params``: as vLLM 0.33 and 0.34 stream, every chunk ends with
    ``"kv_transfer_params":null`` (D's params on the last one where it has any: a fake D has
    none), which the router's scrub reads on every token.

Prompt tokens are estimated as characters / 4, the same for every target.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
from typing import Any, cast

import httptools
import orjson
import uvloop

_HEALTH = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
_BAD = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
_DONE = b"data: [DONE]\n\n"
_ids = itertools.count()


def _chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk (one SSE event per chunk, as vLLM sends them)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def _json_response(doc: dict[str, Any]) -> bytes:
    body = orjson.dumps(doc)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    return head % len(body) + body


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        chars = sum(len(str(m.get("content", ""))) for m in body["messages"])
    else:
        chars = len(str(body.get("prompt", "")))
    return max(1, chars // 4)


class Engine:
    """Timing model and canned payloads shared by all connections."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.tokens: int = args.tokens
        self.itl: float = args.itl_ms / 1000.0
        self.prefill_per_token: float = args.prefill_us_per_token / 1e6
        self.transfer: float = args.kv_transfer_ms / 1000.0
        self.transfer_mode: str = args.transfer_mode
        self.token_ids: bool = args.token_ids
        # vLLM 0.33+ ends every streamed chunk with its kv_transfer_params (null on a token's).
        self.chunk_tail = b',"kv_transfer_params":null}' if args.chunk_params else b"}"
        self.engine_id = f"fake-{os.getpid()}"
        self.kv_port: int = args.port + 1000
        self.batch = Batch(self.itl)
        # /v1/models as vLLM lists it: the base model, then each LoRA adapter with its parent.
        # ``owned_by: vllm`` is how SGLang's gateway (smg) tells a vLLM worker from its own.
        cards = [{"id": "fake", "object": "model", "owned_by": "vllm"}] + [
            {
                "id": name,
                "object": "model",
                "owned_by": "vllm",
                "root": f"/adapters/{name}",
                "parent": "fake",
            }
            for name in args.adapters.split(",")
            if name
        ]
        self.models = _json_response({"object": "list", "data": cards})

    def prefill_answer(self, chat: bool, body: dict[str, Any]) -> bytes:
        rid = next(_ids)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[rid % 1000, rid % 1000 + 1]],
            "remote_engine_id": self.engine_id,
            "remote_request_id": f"cmpl-{rid}",
            "remote_host": "127.0.0.1",
            "remote_port": self.kv_port,
            "tp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": _prompt_tokens(body),
            "transfer_mode": self.transfer_mode,
        }
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": " tok"}
        else:
            choice["text"] = " tok"
        return _json_response(
            {"id": f"cmpl-{rid}", "object": "x", "choices": [choice], "kv_transfer_params": params}
        )

    def first_token_delay(self, body: dict[str, Any]) -> float:
        params = body.get("kv_transfer_params")
        prefill = self.prefill_per_token * _prompt_tokens(body)
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return prefill  # D computes the prompt itself
        if params.get("remote_block_ids"):
            return self.transfer  # pull: P is done, D reads the blocks
        return prefill + self.transfer  # push: P runs alongside, then writes

    def events(self, chat: bool, body: dict[str, Any]) -> tuple[bytes, bytes, bytes]:
        """(the first token event, one token event, the last token event) as HTTP chunks.
        With ``--token-ids``, vLLM 0.32's id fields: null, or with ``return_token_ids`` asked
        each event's token id and a completion's first the prompt's (``_prompt_tokens``)."""
        rid = next(_ids)
        ids = first_ids = b""
        if self.token_ids:  # vLLM 0.32 sends both fields, null unless asked
            ids = b',"token_ids":null'
            first_ids = ids if chat else b',"prompt_token_ids":null' + ids
        if self.token_ids and body.get("return_token_ids"):
            ids = b',"token_ids":[%d]' % (10000 + rid % 20000)
            prompt = b",".join(b"%d" % (1000 + i % 30000) for i in range(_prompt_tokens(body)))
            first_ids = ids if chat else b',"prompt_token_ids":[' + prompt + b"]" + ids
        mid_ids = ids if chat else b',"prompt_token_ids":null' * self.token_ids + ids
        tail = self.chunk_tail
        if chat:
            tok = b'{"id":"chatcmpl-%d","object":"chat.completion.chunk","model":"m",' % rid
            text = b'"choices":[{"index":0,"delta":{"content":" tok"}%s,"finish_reason":null}]'
            end = tok + b'"choices":[{"index":0,"delta":{}%s,"finish_reason":"length"}]' % mid_ids
        else:
            tok = b'{"id":"cmpl-%d","object":"text_completion","model":"m",' % rid
            text = b'"choices":[{"index":0,"text":" tok"%s,"finish_reason":null}]'
            end = (
                tok + b'"choices":[{"index":0,"text":" tok"%s,"finish_reason":"length"}]' % mid_ids
            )
        mid = tok + text % mid_ids + tail
        first = tok + text % first_ids + tail
        end += tail
        sse = [_chunk(b"data: " + e + b"\n\n") for e in (first, mid, end)]
        return sse[0], sse[1], sse[2]

    def full_answer(self, chat: bool) -> bytes:
        text = " tok" * self.tokens
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return _json_response(
            {
                "id": f"cmpl-{next(_ids)}",
                "object": "x",
                "choices": [choice],
                "kv_transfer_params": None,
            }
        )


class Conn(asyncio.Protocol):
    """One client connection; requests on it are answered one after another."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.closed = False
        self.busy: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.busy is not None:
            self.busy.cancel()  # the router closed the stream: abort, like vLLM

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._write(_BAD)
            if self.transport is not None:
                self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        url, body = self.url, b"".join(self.body)
        if method == b"GET":
            if url == b"/v1/models":
                self._write(self.engine.models)
                return
            self._write(_HEALTH if url.startswith(b"/health") else _NOT_FOUND)
            return
        if url not in (b"/v1/completions", b"/v1/chat/completions"):
            self._write(_NOT_FOUND)
            return
        self.busy = asyncio.get_running_loop().create_task(self._serve(url, body))

    def _write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    async def _serve(self, url: bytes, raw: bytes) -> None:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self._write(_BAD)
            return
        eng, chat = self.engine, url == b"/v1/chat/completions"
        params = body.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("do_remote_decode"):
            await _sleep(eng.prefill_per_token * _prompt_tokens(body))
            self._write(eng.prefill_answer(chat, body))
            return
        await _sleep(eng.first_token_delay(body))
        if not body.get("stream"):
            await _sleep(eng.itl * (eng.tokens - 1))
            self._write(eng.full_answer(chat))
            return
        await self._stream(chat, body)

    async def _stream(self, chat: bool, body: dict[str, Any]) -> None:
        first, mid, end = self.engine.events(chat, body)
        n = _answer_tokens(self.engine.tokens, body)
        if n == 1:  # the first token is the last: one write, no decode step
            self._write(_SSE_HEAD + end + _chunk(_DONE) + b"0\r\n\r\n")
            return
        self._write(_SSE_HEAD + first)
        await self.engine.batch.join(self, mid, end, n - 1)


def _answer_tokens(tokens: int, body: dict[str, Any]) -> int:
    """``--tokens``, or fewer when the request's ``max_tokens`` asks for fewer (at least 1)."""
    asked = body.get("max_tokens")
    return max(1, min(tokens, asked)) if isinstance(asked, int) else tokens


class Batch:
    """D's decode loop: one step every ``itl`` emits a token to every running stream.

    One timer per step instead of one per stream per token, like a real engine
    step; with ``itl`` 0 it steps as fast as the loop turns.
    """

    def __init__(self, itl: float) -> None:
        self.itl = itl
        # conn -> [token event, last event, tokens left, finished future]
        self.running: dict[Conn, list[Any]] = {}
        self.wake = asyncio.Event()

    async def join(self, conn: Conn, mid: bytes, end: bytes, left: int) -> None:
        done = asyncio.get_running_loop().create_future()
        self.running[conn] = [mid, end, left, done]
        self.wake.set()
        try:
            await done
        finally:
            self.running.pop(conn, None)

    async def run(self) -> None:
        while True:
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
            await _sleep(self.itl)
            self.step()

    def step(self) -> None:
        finished = []
        for conn, entry in self.running.items():
            entry[2] -= 1
            if entry[2] > 0:
                conn._write(entry[0])
            else:
                conn._write(entry[1] + _chunk(_DONE) + b"0\r\n\r\n")
                finished.append(entry[3])
        for fut in finished:
            if not fut.done():
                fut.set_result(None)


async def _sleep(seconds: float) -> None:
    # sleep(0) still yields, so "no delay" interleaves streams like a real engine step.
    await asyncio.sleep(seconds if seconds > 0 else 0)


async def _main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    engine = Engine(args)
    stepper = loop.create_task(engine.batch.run())
    server = await loop.create_server(
        lambda: Conn(engine), args.host, args.port, backlog=8192, reuse_address=True
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"fake engine on {args.host}:{args.port}", flush=True)
    async with server:
        await stop.wait()
    stepper.cancel()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=16, help="tokens per D response (>= 2)")
    p.add_argument("--itl-ms", type=float, default=5.0, help="delay between D's tokens")
    p.add_argument("--prefill-us-per-token", type=float, default=20.0)
    p.add_argument("--kv-transfer-ms", type=float, default=1.0)
    p.add_argument("--transfer-mode", choices=["pull", "push"], default="pull")
    p.add_argument(
        "--adapters", default="", help="LoRA adapters /v1/models lists (comma-separated)"
    )
    p.add_argument(
        "--token-ids", action="store_true", help="stream token ids when return_token_ids is asked"
    )
    p.add_argument(
        "--chunk-params",
        action="store_true",
        help='as vLLM 0.33+: every streamed chunk ends with "kv_transfer_params":null',
    )
    args = p.parse_args(argv)
    if args.tokens < 2:
        p.error("--tokens must be at least 2")
    return args


def main(argv: list[str] | None = None) -> None:
    uvloop.run(_main(parse_args(argv)))


if __name__ == "__main__":
    main()
