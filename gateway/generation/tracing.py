"""OpenTelemetry traces, one per request, exported over OTLP (http/protobuf or gRPC).

The root span `request` opens when the gateway starts the generation (its parent: an incoming
`traceparent` header, else none) and its context travels to both workers in
`GenerateRequest.traceparent`. The child spans are built at the request's end from the stitched,
offset-corrected timeline (request_trace.py) with explicit start and end times, so every span lies on
the gateway's clock whatever the workers' clocks say. With tracing off the gateway holds no `Tracing`
and pays one `is None` check per request.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlparse

from pdserve.gateway.generation.request_trace import RequestTrace

log = logging.getLogger(__name__)

PROTOCOLS = ("http/protobuf", "grpc")
# One export's limit, its retries included: what an unreachable collector can add to the gateway's stop
# (the spans of that batch are dropped, with the SDK's log line saying so).
EXPORT_TIMEOUT_S = 3.0


def default_protocol(endpoint: str) -> str:
    """`http(s)://...` is OTLP/HTTP; a bare `host:port` (SGLang's `localhost:4317`) is gRPC."""
    return "http/protobuf" if endpoint.startswith(("http://", "https://")) else "grpc"


def _ns(t: float) -> int:
    return int(t * 1e9)


class Tracing:
    def __init__(self, endpoint: str, protocol: str | None = None, service_name: str = "pdserve") -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        protocol = protocol or default_protocol(endpoint)
        exporter: Any
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

            target = endpoint.split("://", 1)[-1]
            exporter = Grpc(
                endpoint=target, insecure=not endpoint.startswith("https://"), timeout=EXPORT_TIMEOUT_S
            )
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

            url = endpoint if "://" in endpoint else f"http://{endpoint}"
            if urlparse(url).path in ("", "/"):
                url = url.rstrip("/") + "/v1/traces"
            exporter = Http(endpoint=url, timeout=EXPORT_TIMEOUT_S)
        else:
            raise ValueError(f"unknown OTLP protocol {protocol!r}; one of {', '.join(PROTOCOLS)}")
        self.endpoint, self.protocol = endpoint, protocol
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("pdserve.gateway")
        self.propagator = TraceContextTextMapPropagator()

    def begin(self, start: float, traceparent: str | None) -> RequestSpan:
        """The root span of one request, opened at `start` (gateway clock)."""
        from opentelemetry import trace

        parent = self.propagator.extract({"traceparent": traceparent}) if traceparent else None
        root = self.tracer.start_span(
            "request", context=parent, start_time=_ns(start), kind=trace.SpanKind.SERVER
        )
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(root))
        return RequestSpan(self, root, carrier.get("traceparent"))

    def shutdown(self) -> None:
        """Export what is queued, then stop."""
        self.provider.shutdown()


class RequestSpan:
    """One request's open root span; ended by `finish` (the whole trace) or `fail`."""

    def __init__(self, tracing: Tracing, root: Any, traceparent: str | None) -> None:
        self._tracing, self._root, self.traceparent = tracing, root, traceparent
        self._ended = False

    def finish(self, t: RequestTrace) -> None:
        from opentelemetry import trace

        ctx = trace.set_span_in_context(self._root)
        for s in t.spans:
            span = self._tracing.tracer.start_span(
                s.name, context=ctx, start_time=_ns(s.start), attributes=s.attributes
            )
            span.end(end_time=_ns(s.end))
        self._root.set_attributes(t.attributes)
        self._end(t.end)

    def fail(self, message: str, end: float) -> None:
        from opentelemetry.trace import Status, StatusCode

        if self._ended:
            return
        self._root.set_status(Status(StatusCode.ERROR, message))
        self._end(end)

    def _end(self, end: float) -> None:
        if not self._ended:
            self._ended = True
            self._root.end(end_time=_ns(end))
