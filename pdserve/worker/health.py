"""A worker's health port for Kubernetes probes and Prometheus: a tiny HTTP server on a daemon thread.

Workers talk only zmq and torch.distributed, so the kubelet needs this to tell their state:
  GET /livez    200 while the process answers and its engine threads run (a wedged interpreter
                fails it; so does a dead KV transfer I/O thread: `failure`), 503 with the reason.
  GET /health   the same as /livez.
  GET /readyz   200 once registered with the gateway and until draining starts; 503 with the
                reason otherwise. Start-up probes use it too, so they cover weight loading.
The server binds to the worker's --host, not every interface.
  GET /metrics  the load the worker reports to the gateway, in Prometheus text format.
Stdlib HTTP on purpose: the worker process stays free of an asyncio loop and a web framework.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.worker.drain import DrainSignal
from pdserve.worker.link import WorkerLink

Failure = Callable[[], str | None]  # None: healthy; else why not (e.g. KVSender.io_failure)


def _no_failure() -> str | None:
    return None


def readiness(link: WorkerLink, signals: DrainSignal, failure: Failure = _no_failure) -> str | None:
    """None when the worker should be in rotation, else why not."""
    why = failure()
    if why is not None:
        return why
    if link.refused:
        return f"registration refused: {link.refused}"
    if signals.draining.is_set():
        return "draining"
    if not link.registered.is_set():
        return "not registered with the gateway yet"
    return None


class _LoadCollector(Collector):
    def __init__(self, link: WorkerLink, signals: DrainSignal, failure: Failure) -> None:
        self._link, self._signals, self._failure = link, signals, failure

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ld, wid = self._link.load, self._link.worker_id
        values = {
            "queued_requests": ("requests waiting for pages or a forward", ld.queued),
            "running_requests": ("requests being computed or transferred", ld.running),
            "free_kv_tokens": ("free KV pool capacity in tokens", ld.free_tokens),
            "draining": ("1 while draining", int(self._signals.draining.is_set())),
            "ready": (
                "1 while in rotation",
                int(readiness(self._link, self._signals, self._failure) is None),
            ),
            "healthy": ("0 once an engine thread died", int(self._failure() is None)),
        }
        for name, (doc, value) in values.items():
            g = GaugeMetricFamily(f"pdserve_worker_{name}", doc, labels=["worker_id"])
            g.add_metric([wid], value)
            yield g


class HealthServer:
    def __init__(
        self, host: str, port: int, link: WorkerLink, signals: DrainSignal, failure: Failure = _no_failure
    ) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_LoadCollector(link, signals, failure))

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                path = self.path.split("?", 1)[0]
                if path in ("/livez", "/health"):
                    dead = failure()
                    self._reply(200, b"ok\n") if dead is None else self._reply(503, dead.encode() + b"\n")
                elif path == "/readyz":
                    why = readiness(link, signals, failure)
                    self._reply(200, b"ok\n") if why is None else self._reply(503, why.encode() + b"\n")
                elif path == "/metrics":
                    self._reply(200, generate_latest(registry), "text/plain; version=0.0.4")
                else:
                    self._reply(404, b"not found\n")

            def _reply(self, status: int, body: bytes, ctype: str = "text/plain") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            # Probes come every few seconds: keep logs clean.
            def log_message(self, format: str, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="health", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def start_health_server(
    host: str, port: int, link: WorkerLink, signals: DrainSignal, failure: Failure = _no_failure
) -> HealthServer | None:
    """Serve /livez, /health, /readyz and /metrics on host:port (None when port is 0: no health port)."""
    if not port:
        return None
    return HealthServer(host, port, link, signals, failure)
