"""Completions with a list of prompts: one dispatch per prompt, answers merged as vLLM merges them.

vLLM answers ``{"prompt": [p0, p1, ...], "n": n}`` with one response whose choice for prompt
``i`` and sequence ``j`` has ``index = i * n + j``, whose ``usage`` sums the prompts' tokens
(``prompt_tokens_details`` is the last prompt's, as vLLM reports it), and whose stream carries
one ``id`` and one ``created``, one usage chunk at the end (with ``include_usage``) and one
``data: [DONE]``. P/D connectors pair one prompt per transfer, so the router dispatches each
prompt on its own (each with its own decode slot, all at once) and merges their answers here.
An error answer of any prompt is the answer of the request; a stream that fails ends with its
error event and ``data: [DONE]`` while the other prompts' legs are closed.

The parts' legs are composed here (:class:`MultiPrompt`, a :class:`~router.composer.Composer`):
their bytes are read from each leg and merged, and the relay (router/relay.py) writes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from router.client_request import ClientRequest
from router.errors import Outcome, RouterError, UpstreamError, sse_error_event
from router.pd.dispatch import Dispatcher
from router.pd.opened import Dispatch
from router.pd.relay_hooks import RelayHooks
from router.pd.sse import ENGINE_ERROR_EVENT
from router.registry import ModelPool

__all__ = ["MultiPrompt", "StreamMerge", "merge_bodies", "split"]

_DONE = b"data: [DONE]"
_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")


def split(creq: ClientRequest) -> list[ClientRequest]:
    """One single-prompt request per prompt of ``creq``, in order."""
    prompts = creq.body["prompt"]
    return [
        dataclasses.replace(
            creq,
            body={**creq.body, "prompt": p},
            num_prompts=1,
            prompt_chars=len(p),
            prompt_is_tokens=isinstance(p, list),
        )
        for p in prompts
    ]


def _merge_usage(usages: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    present = [u for u in usages if isinstance(u, dict)]
    if not present:
        return None
    # The last prompt's usage with the token counts summed: its other fields (the
    # *_tokens_details) are the last prompt's, as vLLM reports them.
    out = dict(present[-1])
    out.update({k: sum(int(u.get(k) or 0) for u in present) for k in _USAGE_FIELDS})
    return out


def merge_bodies(bodies: list[bytes], n: int) -> bytes:
    """The non-streaming answer to the whole request from each prompt's (all 200s)."""
    docs = [orjson.loads(b) for b in bodies]
    merged = dict(docs[0])
    choices = []
    for i, doc in enumerate(docs):
        for choice in doc.get("choices") or []:
            choices.append({**choice, "index": i * n + int(choice.get("index", 0))})
    merged["choices"] = choices
    merged["usage"] = _merge_usage([d.get("usage") for d in docs])
    return orjson.dumps(merged)


class StreamMerge:
    """Rewrites the SSE events of each prompt's stream into one stream (see module doc)."""

    def __init__(self, prompts: int, n: int) -> None:
        self._n = n
        self._buffers = [b""] * prompts
        self._usage: list[dict[str, Any] | None] = [None] * prompts
        self._head: tuple[Any, Any, Any] | None = None  # id, created, model of the first event

    def feed(self, prompt: int, data: bytes) -> tuple[bytes, bytes | None]:
        """(the events to send now, an error event if ``data`` holds one)."""
        buf = self._buffers[prompt] + data
        *events, self._buffers[prompt] = buf.split(b"\n\n")
        out: list[bytes] = []
        for event in events:
            if not event.strip() or event.strip() == _DONE:
                continue
            if event.startswith(ENGINE_ERROR_EVENT):
                return b"".join(out), event + b"\n\n"
            out.append(self._rewrite(prompt, event))
        return b"".join(out), None

    def end(self) -> bytes:
        """The merged usage chunk (if the prompts sent usage) and ``data: [DONE]``."""
        usage = _merge_usage(self._usage)
        tail = b""
        if usage is not None and self._head is not None:
            chunk_id, created, model = self._head
            chunk = {
                "id": chunk_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            tail = b"data: " + orjson.dumps(chunk) + b"\n\n"
        return tail + _DONE + b"\n\n"

    def _rewrite(self, prompt: int, event: bytes) -> bytes:
        if not event.startswith(b"data: "):
            return event + b"\n\n"  # not a JSON event: relayed as is
        doc = orjson.loads(event[6:])
        if self._head is None:
            self._head = (doc.get("id"), doc.get("created"), doc.get("model"))
        doc["id"], doc["created"] = self._head[0], self._head[1]
        choices = doc.get("choices") or []
        if not choices and doc.get("usage") is not None:
            self._usage[prompt] = doc["usage"]  # summed into one chunk at the end
            return b""
        for choice in choices:
            choice["index"] = prompt * self._n + int(choice.get("index", 0))
        return b"data: " + orjson.dumps(doc) + b"\n\n"


class MultiPrompt:
    """The :class:`~router.composer.Composer` of a request with several parts (prompts, or
    a batch's conversations): one dispatch each, all at once; ``merged`` makes the
    non-streamed answer from each part's body (all 200s), ``n`` the sequences per part."""

    count = 0  # never migrated

    def __init__(
        self,
        dispatcher: Dispatcher,
        pool: ModelPool,
        parts: list[ClientRequest],
        client_id: str,
        merged: Callable[[list[bytes]], bytes],
        n: int = 1,
    ) -> None:
        self._dispatcher, self._pool, self._parts = dispatcher, pool, parts
        self._client_id, self._merged, self._n = client_id, merged, n

    @classmethod
    def of_prompts(
        cls, dispatcher: Dispatcher, pool: ModelPool, creq: ClientRequest, client_id: str
    ) -> MultiPrompt:
        """A completion with several prompts, answered as vLLM answers it."""
        merged = functools.partial(merge_bodies, n=creq.n)
        return cls(dispatcher, pool, split(creq), client_id, merged, creq.n)

    async def run(self, hooks: RelayHooks) -> Outcome:
        async with contextlib.AsyncExitStack() as stack:
            dispatches = await self._open_all(stack)
            return await self._answer(dispatches, hooks)

    async def _open_all(self, stack: contextlib.AsyncExitStack) -> list[Dispatch]:
        """Every part's dispatch, entered into ``stack``; the first error of any
        (the others then cancelled or released) is raised as is."""

        async def enter(part: ClientRequest) -> Dispatch:
            return await stack.enter_async_context(
                self._dispatcher.dispatch(self._pool, part, self._client_id)
            )

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(enter(p)) for p in self._parts]
        except* RouterError as errors:
            raise errors.exceptions[0] from None
        return [t.result() for t in tasks]

    async def _answer(self, dispatches: list[Dispatch], hooks: RelayHooks) -> Outcome:
        legs = [d.leg for d in dispatches]  # all 200: an error answer fails its dispatch
        hooks.opened(dispatches[0])
        await hooks.start(legs[0], dispatches[0].request_id)
        if legs[0].rest is None:
            bodies = [await d.first_bytes() for d in dispatches]
            await hooks.end(self._merged(bodies))
            hooks.first_byte()
            return Outcome.SUCCESS
        return await self._merge_streams(dispatches, hooks, StreamMerge(len(legs), self._n))

    async def _merge_streams(
        self, dispatches: list[Dispatch], hooks: RelayHooks, merge: StreamMerge
    ) -> Outcome:
        """Relay every part's stream as one; on an error, the other parts' legs are
        left unread (their dispatches close them)."""
        queue: asyncio.Queue[tuple[int, bytes | UpstreamError | None]] = asyncio.Queue()

        async def pump(i: int, dispatch: Dispatch) -> None:
            def more(chunk: bytes) -> Awaitable[None]:
                return queue.put((i, chunk))

            leg = dispatch.leg
            try:
                await leg.forward(more, dispatch.usage_patch)
                await queue.put((i, leg.tail))
            except UpstreamError as exc:
                await queue.put((i, exc))
            await queue.put((i, None))

        for i, dispatch in enumerate(dispatches):
            queue.put_nowait((i, await dispatch.first_bytes()))
        async with asyncio.TaskGroup() as group:
            pumps = [group.create_task(pump(i, d)) for i, d in enumerate(dispatches)]
            try:
                return await _relay_merged(queue, len(dispatches), hooks, merge)
            finally:
                for task in pumps:
                    task.cancel()


async def _relay_merged(
    queue: asyncio.Queue[tuple[int, bytes | UpstreamError | None]],
    open_streams: int,
    hooks: RelayHooks,
    merge: StreamMerge,
) -> Outcome:
    sent = False
    while open_streams:
        i, item = await queue.get()
        if item is None:
            open_streams -= 1
            continue
        if isinstance(item, UpstreamError):
            await hooks.end(sse_error_event(item.message, item.type, item.code))
            return Outcome.UPSTREAM_ERROR
        events, error = merge.feed(i, item)
        if events:
            await hooks.more(events)
            if not sent:
                sent = True
                hooks.first_byte()
        if error is not None:
            await hooks.end(error + _DONE + b"\n\n")
            return Outcome.UPSTREAM_ERROR
    await hooks.end(merge.end())
    return Outcome.SUCCESS
