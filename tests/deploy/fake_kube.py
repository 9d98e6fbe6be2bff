"""A fake Kubernetes API server for pods: list and watch over real HTTP (an ASGI app).

It speaks just enough of ``GET /api/v1/namespaces/{ns}/pods`` for a real client:
``labelSelector`` (equality terms), ``resourceVersion``, ``watch``,
``timeoutSeconds``, ``allowWatchBookmarks``. A watch streams newline-delimited
JSON events (``ADDED``/``MODIFIED``/``DELETED``), replaying the history after
the requested version first; a version older than the compacted history gets
an ``ERROR`` event with a 410 ``Status``, as the real API server does.

Test controls: :meth:`add_pod`, :meth:`set_ready`, :meth:`delete_pod`,
:meth:`compact`, :meth:`end_watches` (the server closes every open watch),
``hold_watches`` (new watches wait until released), ``fail_status`` (every
request answers this HTTP status).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

Pod = dict[str, Any]


def matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based selectors: ``a=b,c==d,e!=f``."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        else:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
    return True


@dataclass
class Request:
    watch: bool
    resource_version: str | None
    selector: str


@dataclass
class FakeKube:
    namespace: str = "llm"
    pods: dict[str, Pod] = field(default_factory=dict)
    version: int = 100
    history: list[tuple[int, str, Pod]] = field(default_factory=list)
    compacted: int = 0  # watches from a version below this get 410
    requests: list[Request] = field(default_factory=list)
    fail_status: int | None = None
    hold_watches: asyncio.Event = field(default_factory=asyncio.Event)
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _epoch: int = 0  # bumped by end_watches

    def __post_init__(self) -> None:
        self.hold_watches.set()  # set = not holding

    # -- test controls -------------------------------------------------------

    async def add_pod(
        self,
        name: str,
        role: str,
        port: int,
        *,
        ready: bool = True,
        ip: str = "127.0.0.1",
        annotations: dict[str, str] | None = None,
    ) -> None:
        pod: Pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {"app": "vllm", "pd-router.io/role": role},
                "annotations": {"pd-router.io/port": str(port), **(annotations or {})},
            },
            "status": {"phase": "Running", "podIP": ip, "conditions": []},
        }
        self._set_ready(pod, ready)
        await self._emit("ADDED", pod)

    async def set_ready(self, name: str, ready: bool) -> None:
        pod = copy.deepcopy(self.pods[name])
        self._set_ready(pod, ready)
        await self._emit("MODIFIED", pod)

    async def delete_pod(self, name: str) -> None:
        await self._emit("DELETED", copy.deepcopy(self.pods[name]))

    def compact(self) -> None:
        """Forget the history: a watch resuming from a version older than the current one gets
        410; a watch from the current version (what a fresh list returns) is served, as the
        API server serves it (a fake that refused it too made a client list and watch in a loop
        and left the outcome of the test to when it was looked at)."""
        self.history.clear()
        self.compacted = self.version

    async def end_watches(self) -> None:
        async with self._changed:
            self._epoch += 1
            self._changed.notify_all()

    def lists(self) -> int:
        return sum(1 for r in self.requests if not r.watch)

    # -- state ---------------------------------------------------------------

    @staticmethod
    def _set_ready(pod: Pod, ready: bool) -> None:
        pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]

    async def _emit(self, kind: str, pod: Pod) -> None:
        async with self._changed:
            self.version += 1
            pod["metadata"]["resourceVersion"] = str(self.version)
            if kind == "DELETED":
                self.pods.pop(pod["metadata"]["name"], None)
            else:
                self.pods[pod["metadata"]["name"]] = pod
            self.history.append((self.version, kind, copy.deepcopy(pod)))
            self._changed.notify_all()

    # -- ASGI ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"]
                await send({"type": kind + ".complete"})
                if kind == "lifespan.shutdown":
                    return
        path = scope["path"]
        query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode()).items()}
        watch = query.get("watch") in ("true", "True", "1")
        req = Request(watch, query.get("resourceVersion"), query.get("labelSelector", ""))
        self.requests.append(req)
        # A watch belongs to the epoch it was asked in: end_watches() ends every watch asked
        # before it, even one whose stream has not started yet (a stream that read the epoch
        # itself outlived an end_watches() that came between the request and the stream).
        epoch = self._epoch
        if self.fail_status is not None:
            await _respond(send, self.fail_status, _status(self.fail_status, "injected"))
            return
        if path != f"/api/v1/namespaces/{self.namespace}/pods":
            await _respond(send, 404, _status(404, f"no such path {path}"))
            return
        if not watch:
            items = [p for p in self.pods.values() if matches(req.selector, _labels(p))]
            body = {
                "apiVersion": "v1",
                "kind": "PodList",
                "metadata": {"resourceVersion": str(self.version)},
                "items": sorted(items, key=lambda p: p["metadata"]["name"]),
            }
            await _respond(send, 200, body)
            return
        await self.hold_watches.wait()
        await self._watch(req, epoch, float(query.get("timeoutSeconds", "300")), receive, send)

    async def _watch(
        self, req: Request, epoch: int, timeout: float, receive: Receive, send: Send
    ) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        since = int(req.resource_version or self.version)
        if since < self.compacted:
            gone = _status(410, f"too old resource version: {since} ({self.compacted})")
            await _line(send, {"type": "ERROR", "object": gone})
            await send({"type": "http.response.body", "body": b""})
            return
        stream = asyncio.create_task(self._stream(req, epoch, since, send))
        disconnected = asyncio.create_task(_wait_disconnect(receive))
        done, _ = await asyncio.wait(
            {stream, disconnected}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        for task in (stream, disconnected):
            task.cancel()
        await asyncio.gather(stream, disconnected, return_exceptions=True)
        if disconnected not in done:  # server-side end: timeout or end_watches()
            await send({"type": "http.response.body", "body": b""})

    async def _stream(self, req: Request, epoch: int, since: int, send: Send) -> None:
        """Send the history after ``since``, then live events, until end_watches() moves the
        epoch on from ``epoch``."""
        while True:
            async with self._changed:
                while self._epoch == epoch and not (pending := self._after(req, since)):
                    await self._changed.wait()
                if self._epoch != epoch:
                    return
            for v, kind, pod in pending:
                await _line(send, {"type": kind, "object": pod})
                since = v

    def _after(self, req: Request, since: int) -> list[tuple[int, str, Pod]]:
        return [
            (v, k, p) for v, k, p in self.history if v > since and matches(req.selector, _labels(p))
        ]


def _labels(pod: Pod) -> dict[str, str]:
    labels: dict[str, str] = pod["metadata"].get("labels") or {}
    return labels


def _status(code: int, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": "Expired" if code == 410 else "InternalError",
        "code": code,
    }


async def _respond(send: Send, status: int, body: dict[str, Any]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


async def _line(send: Send, event: dict[str, Any]) -> None:
    body = json.dumps(event).encode() + b"\n"
    await send({"type": "http.response.body", "body": body, "more_body": True})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
