"""pdserve.worker.health: a worker's /livez, /readyz and /metrics follow its link to a real gateway process."""

from __future__ import annotations

import time

import httpx
import pytest
from harness import start_gateway, stop_processes

from pdserve.protocol import gateway as m
from pdserve.worker.drain import DrainSignal
from pdserve.worker.health import HealthServer, start_health_server
from pdserve.worker.link import WorkerLink


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    proc, _, cport = start_gateway(str(tmp_path_factory.mktemp("gateway")), ["--log-level", "warning"])
    try:
        yield f"127.0.0.1:{cport}"
    finally:
        stop_processes([proc], grace_s=15)


def _link(gateway: str, worker_id: str, arch: str) -> WorkerLink:
    def register() -> m.Register:
        return m.Register(
            worker_id=worker_id,
            role="decode",
            fingerprint={"arch": arch},
            model_name="default",
            max_total_tokens=4096,
            max_running_requests=8,
            context_length=2048,
            vocab_size=49152,
            t_send=time.time(),
        )

    return WorkerLink(gateway, register, time.time)


def _get(server: HealthServer, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{server.port}{path}", timeout=5)


def _metric(text: str, name: str, worker_id: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'pdserve_worker_{name}{{worker_id="{worker_id}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in\n{text}")


@pytest.mark.timeout(90)
def test_readiness_follows_registration_and_drain(gateway):
    assert (
        start_health_server("127.0.0.1", 0, _link(gateway, "unused", "a"), DrainSignal()) is None
    )  # 0: no port
    link, signals = _link(gateway, "h-decode", "a"), DrainSignal()
    server = HealthServer("127.0.0.1", 0, link, signals)
    try:
        assert _get(server, "/livez").status_code == 200
        r = _get(server, "/readyz")
        assert r.status_code == 503 and "not registered" in r.text
        link.start()
        link.wait_registered(30)
        assert _get(server, "/readyz").status_code == 200
        link.load.running, link.load.free_tokens = 3, 1024
        text = _get(server, "/metrics").text
        assert _metric(text, "ready", "h-decode") == 1 and _metric(text, "running_requests", "h-decode") == 3
        assert _metric(text, "free_kv_tokens", "h-decode") == 1024

        signals.draining.set()  # what the first SIGTERM does
        r = _get(server, "/readyz")
        assert r.status_code == 503 and "draining" in r.text
        assert _get(server, "/livez").status_code == 200  # draining is not dead
        text = _get(server, "/metrics").text
        assert _metric(text, "draining", "h-decode") == 1 and _metric(text, "ready", "h-decode") == 0
        assert _get(server, "/nope").status_code == 404
    finally:
        server.close()
        link.close()


@pytest.mark.timeout(60)
def test_refused_registration_is_not_ready(gateway):
    first, second = _link(gateway, "h-a", "a"), _link(gateway, "h-b", "b")
    server = HealthServer("127.0.0.1", 0, second, DrainSignal())
    try:
        first.start()
        first.wait_registered(30)
        second.start()
        with pytest.raises(Exception, match="fingerprint mismatch"):
            second.wait_registered(30)
        r = _get(server, "/readyz")
        assert r.status_code == 503 and "registration refused" in r.text
    finally:
        server.close()
        first.close()
        second.close()


@pytest.mark.timeout(90)
def test_a_worker_whose_kv_io_thread_died_is_unhealthy_leaves_rotation_and_exits(gateway):
    import threading

    import torch

    from pdserve.config import RuntimeConfig, WorkerConfig
    from pdserve.kv_transfer import KVSender, TransferConfig
    from pdserve.kv_transfer.mailbox import Close
    from pdserve.worker.common import EngineDead, serve_until_drained

    sender = KVSender(torch.zeros(4, 1, 2, 4, 1, 8), {"arch": "a"}, "127.0.0.1", 0, TransferConfig())
    sender.start()
    link, signals = _link(gateway, "h-kv", "a"), DrainSignal()
    server = HealthServer("127.0.0.1", 0, link, signals, sender.io_failure)
    try:
        link.start()
        link.wait_registered(30)
        for path in ("/livez", "/health", "/readyz"):
            assert _get(server, path).status_code == 200, path
        sender._mailbox.post(Close())  # forced: the I/O thread ends, the process lives on
        sender._thread.join(5)
        for path in ("/livez", "/health", "/readyz"):
            r = _get(server, path)
            assert r.status_code == 503 and "KV transfer I/O thread stopped" in r.text, (path, r.text)
        text = _get(server, "/metrics").text
        assert _metric(text, "healthy", "h-kv") == 0 and _metric(text, "ready", "h-kv") == 0
        # The worker loop notices, drains (out of rotation) and ends with EngineDead: exit code 1.
        cfg = WorkerConfig(role="decode", runtime=RuntimeConfig(dtype="float32"), worker_id="h-kv")
        done: list[BaseException] = []
        loop = threading.Thread(
            target=lambda: _catch(
                done,
                serve_until_drained,
                cfg,
                link,
                signals,
                lambda: time.sleep(0.01),
                lambda: 0,
                sender.io_failure,
            )
        )
        loop.start()
        loop.join(10)
        assert done and isinstance(done[0], EngineDead) and signals.draining.is_set()
        assert link.load.draining
    finally:
        server.close()
        link.close()
        sender.close()


def _catch(out: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed to the test thread
        out.append(e)
