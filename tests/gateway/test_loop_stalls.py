"""The gateway's event loop and its heartbeat under load: a flood of the largest /tokenize requests
allowed leaves /health answering at once and every worker registered, and a stall of the loop itself
never costs a live worker its place (gateway/cluster/liveness.py), while a dead one is still found."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from fastapi.testclient import TestClient
from harness import start_gateway, stop_processes

from pdserve.gateway.text.tokenizer import Tokenizer
from pdserve.worker.link import WorkerLink

from .conftest import WireWorker, control_addr, gateway_client, text_script

USER = {"Authorization": "Bearer user-key"}
ADMIN = {"Authorization": "Bearer admin-key"}
CONTEXT = 8192  # the bundled model's: the caps are production's


@dataclass
class Steady:
    client: TestClient
    workers: list[WireWorker]

    def roster(self) -> set[tuple]:
        """Every worker the gateway lists, lost ones too, with what a removal or a re-registration changes."""
        r = self.client.get("/workers", params={"all": 1}, headers=ADMIN)
        assert r.status_code == 200, r.text
        return {(w["worker_id"], w["state"], w["restarts"], w["registered_at"]) for w in r.json()["workers"]}


@pytest.fixture
def steady(tokenizer: Tokenizer) -> Iterator[Callable[..., Steady]]:
    """A gateway (keys set: two clients) with a prefill and a decode WireWorker whose links never
    re-register on their own within a test: a worker the gateway dropped stays dropped, visibly."""
    made: list[Steady] = []

    def make(**overrides: object) -> Steady:
        client = gateway_client(tokenizer, api_key="user-key", admin_api_key="admin-key", **overrides)
        client.__enter__()
        addr = control_addr(client)
        workers = []
        for wid, role in (("p0", "prefill"), ("d0", "decode")):
            w = WireWorker(addr, wid, role, text_script(tokenizer, "hi"), context_length=CONTEXT)
            w.link = WorkerLink(addr, w._register, w.clock, reregister_after_s=120.0)
            workers.append(w.start())
        made.append(Steady(client, workers))
        return made[-1]

    try:
        yield make
    finally:
        for s in made:
            for w in s.workers:
                if not w._stop.is_set():
                    w.stop()
            s.client.__exit__(None, None, None)


def _largest_tokenize(tokenizer: Tokenizer) -> dict:
    """The most tokens /tokenize gives: 2 tokens a character, as many tokens as the cap allows."""
    limit = CONTEXT * tokenizer.max_token_chars
    return {"prompt": "\U0001f642" * (limit // 2), "return_token_strs": True}


@pytest.fixture
def gateway_process(tmp_path, tokenizer: Tokenizer) -> Iterator[tuple[str, list[WireWorker]]]:
    """`pdserve gateway` as its own process (keys set: two clients; the default 5 s heartbeat timeout)
    with a prefill and a decode WireWorker that never re-register on their own within a test."""
    flags = ["--api-key", "user-key", "--admin-api-key", "admin-key", "--log-level", "warning"]
    proc, port, cport = start_gateway(str(tmp_path), flags, env={"TOKENIZERS_PARALLELISM": "false"})
    addr = f"tcp://127.0.0.1:{cport}"
    workers = []
    try:
        for wid, role in (("p0", "prefill"), ("d0", "decode")):
            w = WireWorker(addr, wid, role, text_script(tokenizer, "hi"), context_length=CONTEXT)
            w.link = WorkerLink(addr, w._register, w.clock, reregister_after_s=120.0)
            workers.append(w.start(wait=False))
        for w in workers:
            w.link.wait_registered(30.0)
        yield f"http://127.0.0.1:{port}", workers
    finally:
        for w in workers:
            w.stop()
        stop_processes([proc], grace_s=10)


def _roster(base: str) -> set[tuple]:
    r = httpx.get(f"{base}/workers", params={"all": 1}, headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return {(w["worker_id"], w["state"], w["restarts"], w["registered_at"]) for w in r.json()["workers"]}


@pytest.mark.timeout(300)
def test_a_flood_of_the_largest_tokenize_requests_leaves_health_and_workers_alone(gateway_process, tokenizer):
    """16 of the largest /tokenize requests allowed (663,552 tokens each, with their strings), from two
    clients at once: /health answers within 1 s throughout, and no worker is removed or re-registers.
    Built on the event loop, each answer held it 4-5 s, and the workers went at the heartbeat."""
    base, _ = gateway_process
    before = _roster(base)
    body = json.dumps(_largest_tokenize(tokenizer)).encode()  # 3.9 MB
    done = threading.Event()
    answers: list[tuple[int, int]] = []

    def one(i: int) -> None:
        headers = {**(USER if i % 2 else ADMIN), "content-type": "application/json"}
        r = httpx.post(f"{base}/tokenize", content=body, headers=headers, timeout=240)
        count = r.json()["count"] if r.status_code == 200 else -1
        answers.append((r.status_code, count))

    def flood() -> None:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(16)))
        done.set()

    threading.Thread(target=flood, daemon=True).start()
    slowest, polls = 0.0, 0
    with httpx.Client(timeout=30) as health:
        while not done.wait(0.05):
            t0 = time.perf_counter()
            assert health.get(f"{base}/health").status_code == 200
            slowest, polls = max(slowest, time.perf_counter() - t0), polls + 1
    print(f"FLOOD slowest {slowest:.3f} polls {polls}")
    assert answers == [(200, CONTEXT * tokenizer.max_token_chars)] * 16, answers
    assert polls >= 10 and slowest < 1.0, f"/health took {slowest:.2f} s during the flood ({polls} polls)"
    assert _roster(base) == before  # nobody removed, nobody re-registered


def test_a_stalled_event_loop_does_not_drop_live_workers(steady):
    """The loop blocked 2.5x the heartbeat timeout: the workers' silence is the gateway's own."""
    c = steady(heartbeat_timeout_s=1.0)
    before = c.roster()
    assert c.client.portal is not None
    for _ in range(2):
        c.client.portal.call(time.sleep, 2.5)  # runs on the gateway's event loop
        time.sleep(0.5)  # heartbeats and pongs go round again
        assert c.roster() == before
        assert c.client.get("/health").status_code == 200
    # A worker that really goes silent is still found, in about the timeout.
    c.workers[1].stop()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        if ("d0", "down") in {(w[0], w[1]) for w in c.roster()}:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("a stopped worker was never found")
    assert c.client.get("/health").status_code == 503
