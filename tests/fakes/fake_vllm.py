"""A fake vLLM engine that speaks the P/D ``kv_transfer_params`` protocol over real sockets.

It records every request it receives (headers, body, when it started and ended,
whether the router closed it) and can delay, fail, hang, drop a stream or send
malformed data. Fake P and D engines of one test share a :class:`KvBus`: a push
D leg waits until the P leg with the same ``X-Request-Id`` has finished, as a
real push-mode D waits for P's WRITE, and hangs forever if P never finishes.

With :meth:`FakeEngine.start_kv_events` an engine has a prefix cache and publishes its KV
events in vLLM 0.32's wire format (tests/fakes/kv_events.py), from this fake's tokenizer (the
bytes of the prompt or of the chat template, as its ``/tokenize`` answers): P caches a prompt's
full blocks when it has computed it, D the prompt's and its reply's when the answer ends. Each
request records what it found cached (``Received.cached``, also reported as usage
``cached_tokens``), and computing the rest takes ``compute_token_delay`` seconds per token
(``receive_token_delay`` for a D that receives the prompt's KV from P), one prompt after the
other with ``compute_one_at_a_time``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.fakes.kv_events import Encoding, PrefixCache, Publisher

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass
class Behaviour:
    """What the next requests get. Change fields between requests in a test."""

    delay: float = 0.0  # before the response headers
    status: int = 200
    error_body: bytes | None = None
    hang: bool = False  # never answer; wait until the client closes
    tokens: int = 4
    token_delay: float = 0.0
    drop_after: int | None = None  # abort the connection after N streamed tokens
    omit_kv_params: bool = False
    malformed_json: bool = False  # P: invalid JSON body
    malformed_sse: bool = False  # D: a broken SSE line mid-stream
    prompt_tag: bool = False  # completions: each token's text starts with "<prompt>:"
    error_event_after: int | None = None  # D: after N tokens, vLLM's SSE error event, then [DONE]
    fail_after_kv: float | None = None  # P: hand D its KV, then fail after this many seconds
    fail_gate: asyncio.Event | None = None  # P: hand D its KV, then fail once the test sets it
    chaos: float = 0.0  # probability that a request gets one random fault (soak runs)
    chaos_hang: float = 30.0  # how long a "hang" fault lasts
    transfer_mode: str = "pull"
    engine_id: str = "fake-prefill"
    kv_host: str = "127.0.0.1"
    kv_port: int = 5600
    health_status: int = 200
    running: int = 0  # reported in /metrics
    waiting: int = 0
    kv_usage: float = 0.0
    # A push D in another process than its P: poll the P at this URL for "the KV"
    # (``GET /kv/<request id>``) instead of this process's bus.
    kv_peer: str | None = None
    poison: str | None = None  # a prompt containing this gets a 500 (a bad prompt)
    gate: asyncio.Event | None = None  # hold every answer until the test sets it
    # D: after [DONE], hold the HTTP end of the stream until set (``holding_end`` says when)
    end_gate: asyncio.Event | None = None
    # usage.prompt_tokens_details.cached_tokens (None: no details, as vLLM by default)
    cached_tokens: int | None = None
    # Pull D with vLLM's bidirectional_kv_xfer: a finished non-streaming answer carries the
    # params of the blocks it keeps (and token ids when asked with return_token_ids).
    bidirectional: bool = False
    block_size: int = 16  # in /metrics (vllm:cache_config_info)
    version: str = "0.32.0"  # in /version (what the router pairs engines by)
    fail_kv_read: bool = False  # P: a request that reads a kept turn from D gets a 500
    max_model_len: int | None = 4096  # in /v1/models, as vLLM reports it (None: left out)
    # Every generate request waits for a turn here: a test releases them one at a time.
    turns: asyncio.Semaphore | None = None
    token_padding: int = 0  # streamed tokens: this many more bytes of text each
    tokens_from_request: bool = False  # a request's max_tokens, when given, is its length
    tokenize_status: int = 200  # /tokenize answers with this status
    compute_token_delay: float = 0.0  # with a prefix cache: seconds per prompt token computed
    compute_one_at_a_time: bool = False  # prompts computed in turn, as one engine's steps
    receive_token_delay: float = 0.0  # ... per prompt token a disaggregated D receives
    # Whose answers this engine sends: "0.32" (vLLM 0.32's, the default) or "0.33" (0.33's
    # and 0.34's: every answer carries kv_transfer_params, a body the engine's params or null;
    # every streamed token chunk null but the one that finishes the choice, which carries
    # finish_reason and the engine's params: a bidirectional pull D's own coordinates).
    wire: str = "0.32"
    # vLLM 0.33+ paused (/pause, /sleep, a prepared checkpoint): every generate request is
    # refused as retryable, a non-streamed one with a 503 ServiceUnavailableError, a streamed
    # one with a 200 whose only event is that error (typed InternalServerError, code 503).
    paused: bool = False
    # 0.33 wire: the params this engine answers with where it keeps no turn (another
    # connector's, whatever it was asked; None: null)
    own_params: dict[str, Any] | None = None
    # Streams as a deterministic model: each token id is a function of the whole sequence so
    # far, prompt ids then generated ids (:func:`next_token`), so a request continued from
    # any cut reproduces the uninterrupted answer; each token's text is one letter. Its length
    # is the request's max_tokens (``tokens`` without one); it streams token ids with
    # return_token_ids as vLLM 0.32 does. ``drop_after``, ``error_event_after``, ``end_after``
    # and ``stall_after`` cut it after exactly that many tokens, on the requests ``shot`` lets
    # through (all without one).
    deterministic: bool = False
    end_after: int | None = None  # D: after N tokens, end the response cleanly, no [DONE]
    stall_after: int | None = None  # D: after N tokens, send nothing until stall_gate is set
    stall_gate: asyncio.Event | None = None
    shot: Shot | None = None
    # LoRA adapters held, name -> path, as `vllm serve --enable-lora --lora-modules
    # name=path` (or /v1/load_lora_adapter) gives them: each listed in /v1/models with its
    # parent, and a request naming a model that is neither "tiny" nor one of them gets vLLM's
    # 404. None: an engine without LoRA that answers whatever model is named (the default).
    adapters: dict[str, str] | None = None
    # POST /v1/load_lora_adapter: answered after this delay, with this status (200: loaded)
    lora_load_delay: float = 0.0
    lora_load_status: int = 200


@dataclass
class Shot:
    """How many streams the faults of the engines sharing it still hit (the first ones to come,
    whichever engine they reach)."""

    left: int = 1

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    started: float
    ended: float | None = None
    closed_by_client: bool = False
    cached: int | None = None  # with a prefix cache: prompt tokens found in it

    @property
    def request_id(self) -> str:
        return self.headers.get("x-request-id", "")

    @property
    def kv(self) -> dict[str, Any]:
        params = self.body.get("kv_transfer_params")
        return params if isinstance(params, dict) else {}


@dataclass
class KvBus:
    """P legs announce finished prefills here; push D legs wait for them."""

    done: dict[str, asyncio.Event] = field(default_factory=dict)

    def event(self, request_id: str) -> asyncio.Event:
        return self.done.setdefault(request_id, asyncio.Event())


class _ClientGone(Exception):
    pass


class FakeEngine:
    def __init__(self, name: str, bus: KvBus | None = None) -> None:
        self.name = name
        self.bus = bus or KvBus()
        self.behaviour = Behaviour()
        self.received: list[Received] = []
        self.active = 0  # generate requests currently open
        self.peak = 0  # most generate requests open at once
        self.health_checks = 0
        self.gets: list[str] = []  # paths of every GET but /health
        self.lora_loads: list[str] = []  # the adapters /v1/load_lora_adapter was asked for
        self.holding_end = asyncio.Event()  # see Behaviour.end_gate
        self.stalled = asyncio.Event()  # set when a stream stalls (Behaviour.stall_after)
        self.cache: PrefixCache | None = None  # see start_kv_events
        self._computing = asyncio.Lock()
        self.publisher: Publisher | None = None
        # A streamed answer waits before its [DONE] for the event this returns, if any (one
        # request's stream held open with all its tokens sent: a steady load).
        self.hold_done: Callable[[Received], asyncio.Event | None] | None = None

    async def start_kv_events(
        self, block_size: int = 16, capacity: int = 100_000, encoding: Encoding = "map"
    ) -> Publisher:
        """Give this engine a prefix cache and a KV event publisher (see module doc)."""
        self.cache = PrefixCache(block_size, capacity)
        self.publisher = Publisher(encoding)
        await self.publisher.start()
        return self.publisher

    async def stop_kv_events(self) -> None:
        if self.publisher is not None:
            await self.publisher.aclose()

    def restart_kv(self) -> None:
        """The engine restarts: an empty cache, event sequence numbers from 0."""
        assert self.cache is not None and self.publisher is not None
        self.cache = PrefixCache(self.cache.block_size, self.cache.capacity)
        self.publisher.restart()

    def _serves(self, rec: Received) -> bool:
        """Whether the model the request names is served here (see ``Behaviour.adapters``)."""
        adapters = self.behaviour.adapters
        model = rec.body.get("model")
        return adapters is None or model in (None, "tiny") or model in adapters

    def lora(self, rec: Received) -> str | None:
        """The adapter a request ran with (None: the base model)."""
        model = rec.body.get("model")
        held = self.behaviour.adapters or {}
        return model if isinstance(model, str) and model in held else None

    def _cache_lookup(self, rec: Received) -> list[int]:
        """The request's prompt ids (none without a cache); records what the cache holds."""
        if self.cache is None:
            return []
        tokens = _token_ids(rec.body)
        rec.cached = self.cache.hit(tokens, self.lora(rec))
        return tokens

    def _cache_store(self, tokens: list[int], lora: str | None = None) -> None:
        if self.cache is not None and self.publisher is not None:
            events = self.cache.store(tokens, lora)
            if events:
                self.publisher.publish(events)

    async def _compute(
        self, rec: Received, tokens: list[int], per_token: float, serial: bool = False
    ) -> None:
        if not per_token or self.cache is None:
            return
        seconds = per_token * (len(tokens) - (rec.cached or 0))
        if not serial:
            await asyncio.sleep(seconds)
            return
        async with self._computing:  # an engine computes one prompt after the other
            await asyncio.sleep(seconds)

    # -- ASGI ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        if scope["method"] == "GET":
            await self._get(path, send)
            return
        body = await _read_body(receive)
        rec = Received(
            path=path,
            headers={k.decode(): v.decode() for k, v in scope["headers"]},
            body=json.loads(body or b"{}"),
            started=time.monotonic(),
        )
        if path == "/v1/load_lora_adapter":
            await self._load_lora(rec, send)
            return
        self.received.append(rec)
        self.active += 1
        self.peak = max(self.peak, self.active)
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await _race(self._generate(rec, send), gone)
        except _ClientGone:
            rec.closed_by_client = True
        finally:
            gone.cancel()
            rec.ended = time.monotonic()
            self.active -= 1

    async def _get(self, path: str, send: Send) -> None:
        b = self.behaviour
        if path == "/health":
            self.health_checks += 1
            await _respond(send, b.health_status, b"")
            return
        self.gets.append(path)
        if path == "/v1/models":
            card: dict[str, Any] = {"id": "tiny", "object": "model"}
            if b.max_model_len is not None:
                card["max_model_len"] = b.max_model_len
            cards = [card] + [
                {"id": name, "object": "model", "root": root, "parent": "tiny"}
                for name, root in (b.adapters or {}).items()
            ]
            await _respond(send, 200, json.dumps({"object": "list", "data": cards}).encode())
        elif path == "/metrics":
            await _respond(send, 200, self.metrics_text().encode(), b"text/plain")
        elif path.startswith("/kv/"):
            ready = self.bus.done.get(path.removeprefix("/kv/"))
            await _respond(send, 200 if ready is not None and ready.is_set() else 404, b"")
        elif path == "/version":
            await _respond(send, 200, json.dumps({"version": b.version}).encode())
        else:
            await _respond(send, 404, b'{"error": {"message": "not found"}}')

    def metrics_text(self, engine: str | None = None) -> str:
        """This engine's ``/metrics`` page; ``engine``: the ``engine`` label vLLM gives each
        data-parallel rank's series (tests/fakes/fake_dp.py)."""
        b = self.behaviour
        labels = 'model_name="tiny"' + ("" if engine is None else f',engine="{engine}"')
        return (
            f"vllm:num_requests_running{{{labels}}} {b.running + self.active}\n"
            f"vllm:num_requests_waiting{{{labels}}} {b.waiting}\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {b.kv_usage}\n"
            f'vllm:cache_config_info{{block_size="{b.block_size}"}} 1.0\n'
        )

    async def _load_lora(self, rec: Received, send: Send) -> None:
        """vLLM 0.32's ``/v1/load_lora_adapter`` (``vllm/entrypoints/openai/models/
        serving.py``, ``load_lora_adapter``): 200 with a text once loaded; 400 for one it
        holds already; ``lora_load_status`` otherwise (a wrong path, say)."""
        b = self.behaviour
        name, path = rec.body.get("lora_name"), rec.body.get("lora_path")
        self.lora_loads.append(str(name))
        if b.lora_load_delay:
            await asyncio.sleep(b.lora_load_delay)
        held = b.adapters if b.adapters is not None else {}
        if name in held:
            message = f"The lora adapter '{name}' has already been loaded."
            error = {"message": message, "type": "InvalidUserInput", "param": None, "code": 400}
            await _respond(send, 400, json.dumps({"error": error}).encode())
        elif b.lora_load_status != 200:
            message = f"Loading lora {name} failed: No adapter found for {path}"
            error = {"message": message, "type": "NotFoundError", "param": None, "code": 404}
            await _respond(send, b.lora_load_status, json.dumps({"error": error}).encode())
        else:
            b.adapters = {**held, str(name): str(path)}
            text = f"Success: LoRA adapter '{name}' added successfully."
            await _respond(send, 200, text.encode(), b"text/plain")

    # -- generation ----------------------------------------------------------

    def _for_request(self) -> Behaviour:
        """The behaviour for one request: with ``chaos``, one random fault applied."""
        b = self.behaviour
        if not b.chaos or random.random() >= b.chaos:
            return b
        faults: list[dict[str, Any]] = [
            {"status": random.choice([400, 500, 503])},
            {"delay": b.chaos_hang},
            {"drop_after": random.randint(0, max(0, b.tokens - 1))},
            {"malformed_sse": True},
            {"omit_kv_params": True},
            {"malformed_json": True},
        ]
        return dataclasses.replace(b, **random.choice(faults))

    async def _generate(self, rec: Received, send: Send) -> None:
        b = self._for_request()
        if b.hang:
            await asyncio.Event().wait()
        if b.gate is not None:
            await b.gate.wait()
        if b.turns is not None:
            await b.turns.acquire()
        if b.delay:
            await asyncio.sleep(b.delay)
        status = b.status
        if b.poison is not None and b.poison in json.dumps(rec.body):
            status = 500
        if status != 200:
            body = (
                b.error_body
                or json.dumps(
                    {"error": {"message": f"{self.name} failed", "type": "x", "code": status}}
                ).encode()
            )
            await _respond(send, status, body)
            return
        if not self._serves(rec):
            await _respond(send, 404, _unknown_model(rec))
            return
        if b.paused and rec.path not in ("/tokenize", "/detokenize"):
            await self._refuse_paused(rec, send)
            return
        if b.fail_kv_read and rec.kv.get("do_remote_decode") and rec.kv.get("remote_block_ids"):
            await _respond(send, 500, b'{"error": {"message": "KV read from D failed"}}')
            return
        if rec.path in ("/tokenize", "/detokenize"):
            if b.tokenize_status != 200:
                await _respond(send, b.tokenize_status, b'{"error": {"message": "no"}}')
                return
            await _respond(send, 200, json.dumps(_tokenizer(rec.path, rec.body)).encode())
            return
        kv = rec.kv
        prompt = self._cache_lookup(rec)
        if self.cache is not None and b.cached_tokens is None:
            b = dataclasses.replace(b, cached_tokens=rec.cached)
        if kv.get("do_remote_decode"):
            await self._compute(rec, prompt, b.compute_token_delay, b.compute_one_at_a_time)
            await self._prefill(rec, send, b)
            self._cache_store(prompt, self.lora(rec))
            return
        if kv.get("do_remote_prefill") and not kv.get("remote_block_ids"):
            # Push-style D: wait for "the KV" from the P leg with the same request id.
            if b.kv_peer is None:
                await self.bus.event(rec.request_id).wait()
            else:
                await _poll_kv(b.kv_peer, rec.request_id)
        if kv.get("do_remote_prefill"):
            await self._compute(rec, prompt, b.receive_token_delay)
        else:
            await self._compute(rec, prompt, b.compute_token_delay, b.compute_one_at_a_time)
        if b.deterministic:
            await self._deterministic(rec, send, b)
            return
        if rec.body.get("stream"):
            await self._stream(rec, send, b, prompt)
            return
        doc = _full(rec, b.tokens, b.prompt_tag, b.cached_tokens)
        if b.wire != "0.32":
            doc["kv_transfer_params"] = b.own_params
        if b.bidirectional and kv.get("do_remote_prefill"):
            _keep_turn(self.name, rec, doc)
        elif rec.body.get("return_token_ids"):
            _add_token_ids(rec, doc)
        self._cache_store(prompt + _reply_ids(doc, rec), self.lora(rec))
        await _respond(send, 200, json.dumps(doc).encode())

    async def _refuse_paused(self, rec: Received, send: Send) -> None:
        message = "Generation is paused. Please retry after it resumes."
        if not rec.body.get("stream"):
            error = {"message": message, "type": "ServiceUnavailableError", "param": None}
            body = json.dumps({"error": {**error, "code": 503}}, separators=(",", ":"))
            await _respond(send, 503, body.encode())
            return
        error = {"message": message, "type": "InternalServerError", "param": None, "code": 503}
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        event = json.dumps({"error": error}, separators=(",", ":")).encode()
        await _chunk(send, b"data: " + event + b"\n\ndata: [DONE]\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _prefill(self, rec: Received, send: Send, b: Behaviour) -> None:
        if b.malformed_json:
            await _respond(send, 200, b'{"id": "cmpl-1", "choices": [')
            return
        doc = _full(rec, 1, cached=b.cached_tokens)
        if rec.body.get("return_token_ids"):
            _add_token_ids(rec, doc)
        if not b.omit_kv_params:
            xid = rec.request_id
            doc["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[1, 2, 3]],
                "remote_engine_id": b.engine_id,
                "remote_request_id": f"cmpl-{xid}-0-1a2b3c4d",
                "remote_host": b.kv_host,
                "remote_port": b.kv_port,
                "tp_size": 1,
                "pp_size": 1,
                "transfer_mode": b.transfer_mode,
            }
        if not b.omit_kv_params:  # a P without a working connector sends D nothing
            self.bus.event(rec.request_id).set()
        if b.fail_after_kv is not None or b.fail_gate is not None:
            if b.fail_gate is not None:
                await b.fail_gate.wait()
            else:
                await asyncio.sleep(b.fail_after_kv or 0.0)
            await _respond(send, 500, b'{"error": {"message": "prefill died late"}}')
            return
        await _respond(send, 200, json.dumps(doc).encode())

    async def _stream(
        self, rec: Received, send: Send, b: Behaviour, prompt: list[int] | None = None
    ) -> None:
        asked = rec.body.get("max_tokens")
        if b.tokens_from_request and isinstance(asked, int):
            b = dataclasses.replace(b, tokens=asked)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
            }
        )
        reply: list[str] = []
        for i in range(b.tokens):
            if b.drop_after is not None and i == b.drop_after:
                raise RuntimeError("fake engine drops the stream")  # uvicorn aborts the conn
            if b.error_event_after is not None and i == b.error_event_after:
                event = {"error": {"message": "KV load failed", "type": "x", "code": 500}}
                await _chunk(send, b"data: " + json.dumps(event).encode() + b"\n\n")
                break
            if b.malformed_sse and i == 1:
                await _chunk(send, b"data: {not json\n\n")
                continue
            delta = _delta(rec, i, b.prompt_tag, b.token_padding)
            if b.wire != "0.32":
                delta["kv_transfer_params"] = None
                if i == b.tokens - 1:  # the chunk that finishes the choice: the engine's params
                    delta["choices"][0]["finish_reason"] = "length"
                    delta["kv_transfer_params"] = self._params_at_end(rec, b, reply, delta)
            reply.append(_delta_text(delta))
            await _chunk(send, b"data: " + json.dumps(delta).encode() + b"\n\n")
            if b.token_delay:
                await asyncio.sleep(b.token_delay)
        if (rec.body.get("stream_options") or {}).get("include_usage"):
            usage = {
                **_delta(rec, 0, False),
                "choices": [],
                "usage": _usage(b.tokens, b.cached_tokens),
            }
            await _chunk(send, b"data: " + json.dumps(usage).encode() + b"\n\n")
        if prompt is not None:
            self._cache_store(prompt + list("".join(reply).encode()), self.lora(rec))
        held = self.hold_done(rec) if self.hold_done is not None else None
        if held is not None:
            await held.wait()
        await _chunk(send, b"data: [DONE]\n\n")
        if b.end_gate is not None:
            self.holding_end.set()
            await b.end_gate.wait()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _deterministic(self, rec: Received, send: Send, b: Behaviour) -> None:
        """An answer of the deterministic model (``Behaviour.deterministic``)."""
        prompt = prompt_ids(rec.body)
        asked = rec.body.get("max_tokens") or rec.body.get("max_completion_tokens")
        reply = deterministic_reply(prompt, asked if isinstance(asked, int) else b.tokens)
        created = 1_700_000_000 + len(self.received)  # differs per request: a leg's own
        if not rec.body.get("stream"):
            doc = _full(rec, 0)
            doc["created"] = created
            choice = doc["choices"][0]
            text = "".join(map(chr, reply))
            choice["message" if _is_chat(rec) else "text"] = (
                {"role": "assistant", "content": text} if _is_chat(rec) else text
            )
            doc["usage"] = _usage(len(reply), None, len(prompt))
            await _respond(send, 200, json.dumps(doc).encode())
            return
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        events = _DeterministicEvents(rec, created, prompt, len(reply))
        if _is_chat(rec):
            await _chunk(send, events.role())
        faulty = b.shot is None or b.shot.take()
        for i, token in enumerate(reply):
            if faulty and await self._cut(send, b, i):
                return
            await _chunk(send, events.token(i, token))
            if b.token_delay:
                await asyncio.sleep(b.token_delay)
        if faulty and await self._cut(send, b, len(reply)):  # its last token sent
            return
        if (rec.body.get("stream_options") or {}).get("include_usage"):
            await _chunk(send, events.usage())
        await _chunk(send, b"data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _cut(self, send: Send, b: Behaviour, sent: int) -> bool:
        """Cut a deterministic stream after ``sent`` tokens if a fault says so (True: the
        stream is over)."""
        if b.drop_after == sent:
            raise RuntimeError("fake engine drops the stream")  # uvicorn aborts the conn
        if b.error_event_after == sent:
            event = {"error": {"message": "engine died", "type": "x", "code": 500}}
            await _chunk(send, b"data: " + json.dumps(event).encode() + b"\n\n")
            await _chunk(send, b"data: [DONE]\n\n")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return True
        if b.end_after == sent:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return True
        if b.stall_after == sent:
            self.stalled.set()
            await (b.stall_gate or asyncio.Event()).wait()
        return False

    def _params_at_end(
        self, rec: Received, b: Behaviour, reply: list[str], last: dict[str, Any]
    ) -> dict[str, Any] | None:
        """A 0.33+ stream's params, on its last token chunk: a bidirectional pull D's own
        coordinates (the blocks it keeps), else ``own_params``."""
        if not (b.bidirectional and rec.kv.get("do_remote_prefill")):
            return b.own_params
        text = "".join(reply) + _delta_text(last)
        if _is_chat(rec):
            doc: dict[str, Any] = {"choices": [{"message": {"content": text}}]}
        else:
            doc = {"choices": [{"text": text}]}
        plain = {**rec.body, "return_token_ids": False}  # the ids are not streamed here
        _keep_turn(self.name, dataclasses.replace(rec, body=plain), doc)
        params: dict[str, Any] = doc["kv_transfer_params"]
        return params


# -- helpers -------------------------------------------------------------------


async def _poll_kv(peer: str, request_id: str) -> None:
    """Wait until the P process at ``peer`` has finished ``request_id``; a dead or
    frozen P leaves this waiting, as a real push D waits for a WRITE that never comes."""
    async with httpx.AsyncClient(timeout=1.0) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{peer}/kv/{request_id}")).status_code == 200:
                    return
            await asyncio.sleep(0.01)


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _ClientGone
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _race(work: Awaitable[None], gone: asyncio.Future[None]) -> None:
    task = asyncio.ensure_future(work)
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise _ClientGone


async def _respond(
    send: Send, status: int, body: bytes, ctype: bytes = b"application/json"
) -> None:
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]}
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _chunk(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


def _unknown_model(rec: Received) -> bytes:
    """vLLM 0.32's 404 for a model it does not serve (``vllm/entrypoints/serve/engine/
    serving.py``, ``_check_model``: its base model names are the valid aliases)."""
    message = f"The model `{rec.body.get('model')}` does not exist. Valid aliases: tiny."
    error = {"message": message, "type": "NotFoundError", "param": "model", "code": 404}
    return json.dumps({"error": error}).encode()


def _is_chat(rec: Received) -> bool:
    return rec.path.endswith("/chat/completions")


def _usage(tokens: int, cached: int | None, prompt: int = 5) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": tokens}
    usage["total_tokens"] = prompt + tokens
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _full(
    rec: Received, tokens: int, tag: bool = False, cached: int | None = None
) -> dict[str, Any]:
    text = "".join(_text(rec, i, tag) for i in range(tokens))
    usage = _usage(tokens, cached)
    if _is_chat(rec):
        return {
            "id": f"chatcmpl-{rec.request_id}",
            "object": "chat.completion",
            "created": 0,
            "model": rec.body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
            ],
            "usage": usage,
        }
    return {
        "id": f"cmpl-{rec.request_id}",
        "object": "text_completion",
        "created": 0,
        "model": rec.body.get("model"),
        "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}],
        "usage": usage,
    }


def _text(rec: Received, i: int, tag: bool, padding: int = 0) -> str:
    text = f"{rec.body.get('prompt')}:t{i} " if tag else f"t{i} "
    return text + "x" * padding


def _delta(rec: Received, i: int, tag: bool = False, padding: int = 0) -> dict[str, Any]:
    if _is_chat(rec):
        return {
            "id": f"chatcmpl-{rec.request_id}",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": rec.body.get("model"),
            "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
        }
    return {
        "id": f"cmpl-{rec.request_id}",
        "object": "text_completion",
        "created": 0,
        "model": rec.body.get("model"),
        "choices": [
            {
                "index": 0,
                "text": _text(rec, i, tag, padding),
                "finish_reason": None,
                "logprobs": None,
            }
        ],
    }


def _delta_text(delta: dict[str, Any]) -> str:
    choice = delta["choices"][0]
    text = choice["delta"].get("content", "") if "delta" in choice else choice.get("text", "")
    return str(text)


def _reply_ids(doc: dict[str, Any], rec: Received) -> list[int]:
    """A finished answer's reply as this fake's tokenizer has it (its bytes)."""
    choice = doc["choices"][0]
    text = choice["message"]["content"] if _is_chat(rec) else choice["text"]
    return list(str(text).encode())


def _keep_turn(name: str, rec: Received, doc: dict[str, Any]) -> None:
    """What vLLM's D adds to a finished answer with bidirectional KV: the params of the
    blocks it keeps, and with ``return_token_ids`` the prompt's and the output's ids (bytes,
    as this fake's tokenizer has them)."""
    choice = doc["choices"][0]
    text = choice["message"]["content"] if _is_chat(rec) else choice["text"]
    prompt_ids, output_ids = _token_ids(rec.body), list(text.encode())
    held = len(prompt_ids) + len(output_ids) - 1  # the last sampled token has no KV yet
    doc["kv_transfer_params"] = {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [list(range(100, 100 + -(-held // 16)))],
        "remote_engine_id": f"{name}-engine",
        "remote_request_id": f"cmpl-{rec.request_id}-0-ffff",
        "remote_host": "127.0.0.1",
        "remote_port": 5700,
        "tp_size": 1,
        "remote_num_tokens": held,
        "remote_blocks_expiry_time": 1e9,
        "transfer_mode": "pull",
    }
    if rec.body.get("return_token_ids"):
        _add_token_ids(rec, doc)


def _add_token_ids(rec: Received, doc: dict[str, Any]) -> None:
    """What ``return_token_ids`` adds to a whole answer: the prompt's ids (a chat's at the
    top, a completion's on its choice) and the output's (bytes, as this fake tokenizes)."""
    choice = doc["choices"][0]
    text = choice["message"]["content"] if _is_chat(rec) else choice["text"]
    choice["token_ids"] = list(text.encode())
    if _is_chat(rec):
        doc["prompt_token_ids"] = _token_ids(rec.body)
    else:
        choice["prompt_token_ids"] = _token_ids(rec.body)


def _token_ids(body: dict[str, Any]) -> list[int]:
    """This fake's tokenizer: the bytes of the prompt, or of a chat template that joins
    ``<role>content`` (plus ``<assistant>`` as the generation prompt)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        if body.get("add_generation_prompt", True):
            text += "<assistant>"
        return list(text.encode())
    return list(str(body.get("prompt", "")).encode())


def prompt_ids(body: dict[str, Any]) -> list[int]:
    """The prompt's ids as this fake runs them: a prompt of token ids as given, else
    :func:`_token_ids`."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return _token_ids(body)


def next_token(sequence: list[int]) -> int:
    """The deterministic model's next token after ``sequence`` (prompt then generated ids):
    a letter's code, a hash of the whole sequence."""
    h = 0
    for token in sequence:
        h = (h * 131 + token) % 1_000_003
    return ord("a") + h % 26


def deterministic_reply(prompt: list[int], n: int) -> list[int]:
    """The deterministic model's ``n`` tokens after ``prompt``."""
    sequence = list(prompt)
    for _ in range(n):
        sequence.append(next_token(sequence))
    return sequence[len(prompt) :]


class _DeterministicEvents:
    """The SSE events of a deterministic stream, shaped as vLLM 0.32's."""

    def __init__(self, rec: Received, created: int, prompt: list[int], length: int) -> None:
        self._rec, self._prompt, self._length = rec, prompt, length
        self._ids = bool(rec.body.get("return_token_ids"))
        chat = _is_chat(rec)
        self._head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{rec.request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": rec.body.get("model"),
        }

    def _event(self, doc: dict[str, Any]) -> bytes:
        # Compact, as vLLM writes them (pydantic's JSON): the relay's fast paths expect it.
        event = json.dumps({**self._head, **doc}, separators=(",", ":"))
        return b"data: " + event.encode() + b"\n\n"

    def role(self) -> bytes:
        """A chat's first event: the role (and the prompt's ids, when asked)."""
        delta = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        doc: dict[str, Any] = {"choices": [choice]}
        if self._ids:
            doc["prompt_token_ids"] = self._prompt
        return self._event(doc)

    def token(self, i: int, token: int) -> bytes:
        last = i == self._length - 1
        choice: dict[str, Any] = {"index": 0}
        if _is_chat(self._rec):
            choice["delta"] = {"content": chr(token)}
        else:
            choice["text"] = chr(token)
        choice.update({"logprobs": None, "finish_reason": "length" if last else None})
        if self._ids:
            if i == 0 and not _is_chat(self._rec):
                choice["prompt_token_ids"] = self._prompt
            choice["token_ids"] = [token]
        return self._event({"choices": [choice]})

    def usage(self) -> bytes:
        return self._event({"choices": [], "usage": _usage(self._length, None, len(self._prompt))})


def _tokenizer(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A byte-level stand-in for vLLM's /tokenize and /detokenize answers."""
    if path == "/detokenize":
        return {"prompt": bytes(body.get("tokens", [])).decode("utf-8", "replace")}
    tokens = _token_ids(body)
    return {"count": len(tokens), "max_model_len": 4096, "tokens": tokens, "token_strs": None}
