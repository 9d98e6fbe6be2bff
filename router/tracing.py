"""OpenTelemetry traces of the router's requests, exported over OTLP/HTTP.

One SERVER span per client request (an incoming W3C ``traceparent`` is its parent), with
children for each dispatch attempt, the wait for a decode slot, the prefill leg, D's first
bytes and the stream; both engine legs carry a ``traceparent`` naming their span, so engines
started with ``--otlp-traces-endpoint`` put their spans into the same trace.

Off by default (``tracing.endpoint`` unset): then every call here is one attribute check and
a shared null context, and OpenTelemetry is not even imported. The SDK's provider belongs to
this object, never installed globally: two apps in one process trace independently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from router.config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

__all__ = ["Tracing"]

_CARRIED = (b"traceparent", b"tracestate")


class Tracing:
    def __init__(self, config: TracingConfig) -> None:
        self.enabled = config.endpoint is not None
        self._null: contextlib.nullcontext[None] = contextlib.nullcontext()
        self._provider: TracerProvider | None = None
        self._tracer: Tracer | None = None
        if config.endpoint is not None:
            self._provider, self._tracer = _sdk(config)

    def request(
        self, name: str, headers: Iterable[tuple[bytes, bytes]], attributes: dict[str, Any]
    ) -> contextlib.AbstractContextManager[Span | None]:
        """The span of one client request, child of the client's ``traceparent`` if any."""
        if self._tracer is None:
            return self._null
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier = {k.decode(): v.decode("latin-1") for k, v in headers if k in _CARRIED}
        parent = TraceContextTextMapPropagator().extract(carrier) if carrier else None
        return self._tracer.start_as_current_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes
        )

    def span(
        self, name: str, attributes: dict[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[Span | None]:
        """A child of the current span (none if tracing is off)."""
        if self._tracer is None:
            return self._null
        return self._tracer.start_as_current_span(name, attributes=attributes)

    def set(self, **attributes: Any) -> None:
        """Attributes of the current span (dots spelled as double underscores)."""
        if self._tracer is None:
            return
        from opentelemetry import trace

        span = trace.get_current_span()
        span.set_attributes({k.replace("__", "."): v for k, v in attributes.items()})

    def failed(self, outcome: str) -> None:
        """Mark the current span as failed with ``outcome``."""
        if self._tracer is None:
            return
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        trace.get_current_span().set_status(Status(StatusCode.ERROR, outcome))

    def traceparent(self) -> str | None:
        """The W3C ``traceparent`` naming the current span, for an engine leg."""
        if self._tracer is None:
            return None
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        return carrier.get("traceparent")

    def shutdown(self) -> None:
        """Export what is buffered and stop (blocking: run it off the event loop)."""
        if self._provider is not None:
            self._provider.shutdown()


def _sdk(config: TracingConfig) -> tuple[TracerProvider, Tracer]:
    # Imported here: the SDK is an optional dependency (the ``tracing`` extra).
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create({"service.name": config.service_name}),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint), schedule_delay_millis=200)
    )
    return provider, provider.get_tracer("pd-router")
