"""A real OTLP/HTTP trace receiver: decodes the protobuf payloads exporters POST to /v1/traces."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    status: int  # 0 unset, 1 ok, 2 error
    attributes: dict[str, Any]
    service: str


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class OtlpReceiver:
    spans: list[ReceivedSpan] = field(default_factory=list)

    def named(self, name: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.name == name]

    def by_id(self, span_id: str) -> ReceivedSpan:
        return next(s for s in self.spans if s.span_id == span_id)

    def add(self, payload: bytes) -> None:
        """Decode one OTLP/HTTP export (``ExportTraceServiceRequest``) and keep its spans."""
        request = ExportTraceServiceRequest()
        request.ParseFromString(payload)
        for resource_spans in request.resource_spans:
            res = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            status=s.status.code,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            service=str(res.get("service.name")),
                        )
                    )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.add(body)
        headers = [(b"content-type", b"application/x-protobuf")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b""})


@contextlib.contextmanager
def threaded_receiver() -> Iterator[tuple[str, OtlpReceiver]]:
    """An :class:`OtlpReceiver` on a thread of its own (for tests without an event loop);
    yields its ``/v1/traces`` URL."""
    receiver = OtlpReceiver()
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            payload = self.rfile.read(int(self.headers.get("content-length", 0)))
            with lock:
                receiver.add(payload)
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", receiver
    finally:
        server.shutdown()
        server.server_close()
