"""A real OTLP trace receiver for tests: OTLP/HTTP (protobuf) and OTLP/gRPC, decoded with the official
`opentelemetry-proto` types. Collected spans are plain dicts."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class SpanStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[dict[str, Any]] = []
        self.requests = 0

    def add(self, req: trace_service_pb2.ExportTraceServiceRequest) -> None:
        got = []
        for rs in req.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        {
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex(),
                            "name": s.name,
                            "start": s.start_time_unix_nano / 1e9,
                            "end": s.end_time_unix_nano / 1e9,
                            "attributes": {a.key: _value(a.value) for a in s.attributes},
                            "status": s.status.code,
                            "resource": resource,
                        }
                    )
        with self._lock:
            self.spans.extend(got)
            self.requests += 1

    def traces(self) -> dict[str, list[dict[str, Any]]]:
        with self._lock:
            out: dict[str, list[dict[str, Any]]] = {}
            for s in self.spans:
                out.setdefault(s["trace_id"], []).append(s)
            return out

    def wait_roots(self, n: int, timeout_s: float = 30.0) -> dict[str, list[dict[str, Any]]]:
        """The traces once `n` root spans (`request`) arrived."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            tr = self.traces()
            if sum(1 for spans in tr.values() for s in spans if s["name"] == "request") >= n:
                return tr
            time.sleep(0.1)
        raise AssertionError(f"fewer than {n} traces arrived in {timeout_s} s: {len(self.traces())}")


class HttpReceiver:
    """POST /v1/traces with an ExportTraceServiceRequest (application/x-protobuf)."""

    def __init__(self) -> None:
        self.store = SpanStore()
        store = self.store

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ok = (
                    self.path == "/v1/traces" and self.headers.get("Content-Type") == "application/x-protobuf"
                )
                if ok:
                    req = trace_service_pb2.ExportTraceServiceRequest()
                    req.ParseFromString(body)
                    store.add(req)
                payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GrpcReceiver:
    """The OTLP TraceService over gRPC (insecure)."""

    def __init__(self) -> None:
        import grpc

        self.store = SpanStore()
        store = self.store

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
                store.add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"127.0.0.1:{port}"

    def close(self) -> None:
        self.server.stop(grace=None)
