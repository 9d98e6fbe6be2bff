"""Every engine's KV index and the stream that feeds it, kept in step with the registry.

:class:`KvIndex` is the only owner of the streams and their indexes, by engine (its URL, and
with data parallelism its rank: each rank publishes on ports of its own). It follows
the registry (:meth:`KvIndex.follow`): whenever the instance lists change (start, config
reload, Kubernetes discovery), :meth:`KvIndex.sync` starts a stream for each P and D of a model
with ``kv_events`` on, restarts one whose endpoints or settings changed (its index starts
over), and stops those of engines that left. Every router replica (and every worker of
``--workers N``) subscribes on its own: nothing is shared between them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import zmq
import zmq.asyncio
from pydantic import AnyHttpUrl

from router.config import ModelConfig
from router.kvindex.engine import EngineIndex
from router.kvindex.stream import Source, Stream
from router.registry import ModelPool, Registry

__all__ = ["KvIndex", "rank_endpoint", "sources"]

log = logging.getLogger("pd_router.kv_events")


def _host(url: AnyHttpUrl) -> str:
    host = url.host or ""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def sources(model: ModelConfig) -> dict[str, Source]:
    """Where each engine of ``model`` publishes its KV events (none with ``kv_events`` off)."""
    ev = model.kv_events
    if not ev.enabled:
        return {}
    out: dict[str, Source] = {}
    for inst in (*model.prefill, *model.decode):
        host = _host(inst.url)
        endpoint = inst.kv_events_endpoint or f"tcp://{host}:{ev.port}"
        replay = inst.kv_events_replay
        if replay is None and ev.replay_port is not None:
            replay = f"tcp://{host}:{ev.replay_port}"
        for rank, key in zip(inst.ranks, inst.keys, strict=True):
            out[key] = Source(
                rank_endpoint(endpoint, rank),
                None if replay is None else rank_endpoint(replay, rank),
                ev.topic,
                ev.max_blocks_per_engine,
                ev.verify_interval,
                ev.replay_timeout,
            )
    return out


def rank_endpoint(endpoint: str, rank: int | None) -> str:
    """Where data-parallel rank ``rank`` binds the engine's ``endpoint``, as vLLM's publisher
    offsets it (``vllm/distributed/kv_events.py``, ``offset_endpoint_port``): a TCP port plus
    the rank (a port 0 is left to the OS), another transport's name suffixed ``_dp<rank>``."""
    if not rank:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def _nothing() -> None:
    pass


@dataclass(slots=True)
class _Followed:
    stream: Stream
    task: asyncio.Task[None]


class KvIndex:
    """The engines' KV indexes by engine key (:func:`router.config.engine_key`) (see module doc)."""

    def __init__(self) -> None:
        self._ctx: zmq.asyncio.Context | None = None
        self._followed: dict[str, _Followed] = {}
        self._unfollow: Callable[[], None] = _nothing

    def follow(self, registry: Registry) -> None:
        """Subscribe to the registry's engines now and after every change of its lists."""

        def changed() -> None:
            self.sync(_wanted(registry.pools()))

        self._unfollow()
        self._unfollow = registry.subscribe(changed)
        changed()

    def sync(self, wanted: Mapping[str, Source]) -> None:
        """Follow exactly the engines of ``wanted`` (URL to source); needs a running loop."""
        for url in list(self._followed):
            if wanted.get(url) != self._followed[url].stream.source:
                self._followed.pop(url).task.cancel()
        for url, source in wanted.items():
            if url not in self._followed:
                self._start(url, source)

    def view(self, url: str) -> EngineIndex | None:
        """The index of the engine at ``url``; None if its events are not followed."""
        followed = self._followed.get(url)
        return None if followed is None else followed.stream.index

    def streams(self) -> list[Stream]:
        return [f.stream for f in self._followed.values()]

    async def aclose(self) -> None:
        """Stop following the registry, stop every stream and close the sockets."""
        self._unfollow()
        self._unfollow = _nothing
        tasks = [f.task for f in self._followed.values()]
        self._followed.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _start(self, url: str, source: Source) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
            self._ctx.setsockopt(zmq.IPV6, 1)
        stream = Stream(url, source, EngineIndex(source.max_blocks), self._ctx)
        task = asyncio.get_running_loop().create_task(stream.run(), name=f"kv-events {url}")
        task.add_done_callback(functools.partial(_ended, stream))
        self._followed[url] = _Followed(stream, task)


def _wanted(pools: Iterable[ModelPool]) -> dict[str, Source]:
    wanted: dict[str, Source] = {}
    for pool in pools:
        wanted.update(sources(pool.config))
    return wanted


def _ended(stream: Stream, task: asyncio.Task[None]) -> None:
    """A stream ends only when cancelled; one that failed no longer follows its engine, whose
    index is then unknown, never stale."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        stream.index.known = False
        log.error("event=kv_events_stopped engine=%s", stream.url, exc_info=exc)
