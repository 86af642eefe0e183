"""Mid-stream migration and transfer retries, with real processes and the bundled model.

A decode worker killed while it streams: every stream moves to the other pair with the tokens it
has (a new prefill computes their KV) and completes with the greedy output of an uninterrupted run.
A generation that cannot move (migrated twice already, or no other decode worker) ends with a clear
error. A failed KV transfer is retried once on another decode worker, never twice.

Each class runs its own cluster (class-scoped, so only one is up at a time on a small machine).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
from harness import start_roles, start_up, start_worker, started_pids
from reliability.calls import (
    GATEWAY_FLAGS,
    PROMPT,
    WORKER_FLAGS,
    body,
    generate,
    metric,
    wait_for,
    worker_flags,
    workers,
)

# Minutes of real clusters killed and restarted: in `make test-all` (CI), not in `make test`.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

N_TOKENS = 48
MIGRATIONS = "pdserve_request_migrations_total"
RETRIES = "pdserve_request_retries_total"


@dataclass
class Streamed:
    """A stream read to its end: the text and ids it showed, and when each chunk arrived."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish: object = None
    meta: dict | None = None
    usage: dict | None = None
    error: str = ""
    times: list[float] = field(default_factory=list)  # monotonic arrival of each chunk with content

    @property
    def longest_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:])), default=0.0)


def _events(r: httpx.Response):
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            if data == "[DONE]":
                return
            yield json.loads(data)
    raise AssertionError("stream ended without [DONE]")


def stream_native(url: str, max_new_tokens: int, on_chunk=None, timeout: float = 180) -> Streamed:
    """/generate streamed (cumulative text and ids per chunk); `on_chunk(s)` after each chunk."""
    s = Streamed()
    with httpx.stream(
        "POST", url + "/generate", json=body(max_new_tokens, stream=True), timeout=timeout
    ) as r:
        assert r.status_code == 200, r.read()
        for ev in _events(r):
            if "error" in ev:
                s.error = ev["error"]["message"]
                continue
            s.times.append(time.monotonic())
            assert ev["text"].startswith(s.text), "text shown earlier was taken back"
            assert ev["output_ids"][: len(s.output_ids)] == s.output_ids, "token ids shown earlier changed"
            s.text, s.output_ids = ev["text"], ev["output_ids"]
            s.finish, s.meta = ev["meta_info"]["finish_reason"], ev["meta_info"]
            if on_chunk is not None:
                on_chunk(s)
    return s


def stream_openai(url: str, max_tokens: int, on_first=None, timeout: float = 180) -> Streamed:
    """/v1/completions streamed (text deltas), with the usage chunk."""
    req = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    s = Streamed()
    with httpx.stream("POST", url + "/v1/completions", json=req, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for ev in _events(r):
            if "error" in ev:
                s.error = ev["error"]["message"]
                continue
            if ev.get("usage"):
                s.usage = ev["usage"]
            for ch in ev["choices"]:
                s.times.append(time.monotonic())
                s.text += ch["text"]
                s.finish = ch["finish_reason"] or s.finish
                if len(s.times) == 1 and on_first is not None:
                    on_first()
    return s


def _kill_group(p: subprocess.Popen) -> None:
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def _on(url: str, role: str) -> list[str]:
    """Workers of `role` holding a request the gateway dispatched."""
    return [wid for wid, w in workers(url).items() if w["role"] == role and w["inflight_requests"] > 0]


# ---- pdserve up --num-decode 2: kill -9 a decode worker while 8 requests stream ----------------


class TestDecodeKilledMidStream:
    @pytest.fixture(scope="class")
    @classmethod
    def cluster(cls, tmp_path_factory):
        # the host's default dtype and quantization, batch-invariant (the default where it is free)
        extra = ["--dtype", "auto", "--deterministic", "on"]
        c = start_up(tmp_path_factory.mktemp("migration-up"), num_decode=2, extra=extra)
        try:
            c.wait_healthy(workers=3)
            ref = httpx.post(c.url + "/generate", json=body(N_TOKENS), timeout=120).json()
            c.reference, c.reference_text = ref["output_ids"], ref["text"]
            c.prompt_tokens = ref["meta_info"]["prompt_tokens"]
            yield c
        finally:
            c.stop()

    def test_every_stream_completes_as_if_uninterrupted(self, cluster, record_property):
        c = cluster
        started = threading.Barrier(9)

        def first_native_chunk(s: Streamed) -> None:
            if len(s.times) == 1:
                started.wait(120)

        migrations_before = metric(c.url, MIGRATIONS)
        with ThreadPoolExecutor(12) as pool:
            native = [pool.submit(stream_native, c.url, N_TOKENS, first_native_chunk) for _ in range(4)]
            openai = [
                pool.submit(stream_openai, c.url, N_TOKENS, lambda: started.wait(120)) for _ in range(4)
            ]
            started.wait(180)  # every stream has shown its first tokens
            # Least-outstanding routing spreads the 8 over both decode workers; kill the busier one.
            held = {wid: w["inflight_requests"] for wid, w in workers(c.url).items() if w["role"] == "decode"}
            victim = max(held, key=lambda wid: held[wid])
            os.kill(started_pids(c.log_dir)[victim][-1], signal.SIGKILL)
            t_kill = time.monotonic()
            # New requests right after the kill (the gateway has not noticed it yet) are served too.
            late = [pool.submit(generate, c.url, body(16), 120) for _ in range(2)]
            n_out = [f.result(timeout=240) for f in native]
            o_out = [f.result(timeout=240) for f in openai]
            late_out = [f.result(timeout=240) for f in late]
        lost = [s.error for s in n_out + o_out if s.error]
        moved = metric(c.url, MIGRATIONS) - migrations_before
        gap = max(s.longest_gap for s in n_out + o_out)
        migrated = [(s.meta or {}).get("num_migrations", 0) for s in n_out]
        print(
            f"kill -9 {victim} holding {held[victim]} of 8 streams: {moved:g} migrated, {len(lost)} lost; "
            f"num_migrations of the native streams {migrated}; longest inter-token gap {gap:.2f} s"
        )
        record_property("longest_migrated_gap_s", gap)
        assert not lost, lost
        for s in n_out:
            assert s.output_ids == c.reference and s.text == c.reference_text
            assert s.meta.get("deterministic") is True
            assert s.finish == {"type": "length", "length": N_TOKENS}
            assert s.meta["completion_tokens"] == N_TOKENS and s.meta["prompt_tokens"] == c.prompt_tokens
        for s in o_out:
            assert s.text == c.reference_text and s.finish == "length"
            # Usage counts every token once; the prompt is the client's, not the migrated one.
            assert s.usage["completion_tokens"] == N_TOKENS and s.usage["prompt_tokens"] == c.prompt_tokens
        # Each stream on the killed worker moved exactly once, and says so; the others did not move.
        # The moved ones waited for the heartbeat timeout (5 s by default), the others did not.
        assert moved == held[victim] >= 1
        assert all(m == (1 if s.longest_gap > 4.0 else 0) for m, s in zip(migrated, n_out)), (
            migrated,
            [s.longest_gap for s in n_out],
        )
        assert sum(migrated) + sum(s.longest_gap > 4.0 for s in o_out) == moved
        assert all(o.ok and o.output_ids == c.reference[:16] for o in late_out), [o.error for o in late_out]
        assert max(o.ended for o in late_out) - t_kill < 60
        # Once the loss is known, a new request goes straight to the surviving worker.
        t0 = time.monotonic()
        o = generate(c.url, body(16))
        assert o.ok and o.output_ids == c.reference[:16] and o.meta.get("num_migrations", 0) == 0
        print(f"a new request after the kill: served in {time.monotonic() - t0:.2f} s")


# ---- separate processes: a generation that cannot move ends with a clear error -----------------


class TestCannotMigrate:
    @pytest.fixture(scope="class")
    @classmethod
    def cluster(cls, tmp_path_factory):
        c = start_roles(
            tmp_path_factory.mktemp("migration-roles"),
            [("prefill", {}, WORKER_FLAGS)] + [("decode", {}, WORKER_FLAGS)] * 3,
            gateway_flags=GATEWAY_FLAGS,
        )
        try:
            c.wait_healthy(workers=4)
            c.by_id = {f"decode-{i}": c.procs[1 + i] for i in (1, 2, 3)}
            c.reference = generate(c.url, body(24)).output_ids
            yield c
        finally:
            c.stop()

    def test_third_failure_is_an_error_not_a_third_migration(self, cluster):
        c = cluster
        shown: list[int] = [0]
        result: dict[str, Streamed] = {}

        def run() -> None:
            result["s"] = stream_native(c.url, 3000, lambda s: shown.__setitem__(0, len(s.output_ids)), 300)

        t = threading.Thread(target=run)
        t.start()
        migrations_before = metric(c.url, MIGRATIONS)
        for k in range(3):
            # Kill the decode worker the stream is on once it has shown new tokens there.
            def moved_on(at: int = shown[0]) -> bool:
                return shown[0] > at and len(_on(c.url, "decode")) == 1

            wait_for(moved_on, 120, f"tokens on leg {k + 1}")
            (victim,) = _on(c.url, "decode")
            _kill_group(c.by_id[victim])
        t.join(timeout=180)
        assert not t.is_alive(), "the stream hung"
        s = result["s"]
        assert s.error and "already migrated 2 times" in s.error, s.error
        assert "decode" in s.error and "stopped responding" in s.error, s.error
        assert s.finish["type"] == "abort", s.finish  # not a silent truncation
        n = len(s.output_ids)
        assert 0 < n < 3000
        assert s.output_ids[:24] == c.reference[:n]  # greedy across both migrations
        assert metric(c.url, MIGRATIONS) - migrations_before == 2

    def test_no_other_decode_worker_is_an_error(self, cluster):
        c = cluster
        c.procs.append(p := start_worker(c, "decode", "decode-4", {}, WORKER_FLAGS))
        wait_for(lambda: "decode-4" in workers(c.url), 240, "a fresh decode worker")
        migrations_before = metric(c.url, MIGRATIONS)
        shown: list[int] = [0]
        result: dict[str, Streamed] = {}
        t = threading.Thread(
            target=lambda: result.update(
                s=stream_native(c.url, 3000, lambda s: shown.__setitem__(0, len(s.output_ids)), 300)
            )
        )
        t.start()
        wait_for(lambda: shown[0] >= 4, 120, "tokens streamed")
        _kill_group(p)
        t.join(timeout=120)
        assert not t.is_alive(), "the stream hung"
        s = result["s"]
        assert "not migrated: no other decode worker in rotation" in s.error, s.error
        assert s.finish["type"] == "abort" and s.output_ids[:24] == c.reference[: len(s.output_ids)]
        assert metric(c.url, MIGRATIONS) == migrations_before


# ---- a failed KV transfer: retried once on another decode worker, never twice ------------------

TRANSFER_TIMEOUT_S = 3.0


class TestTransferRetry:
    @pytest.fixture(scope="class")
    @classmethod
    def cluster(cls, tmp_path_factory):
        # prefill-0 announces every transfer and then holds its data back: the decode's receive
        # times out (--transfer-timeout) and the decode leg fails with code "transfer".
        flags = [*worker_flags(TRANSFER_TIMEOUT_S), "--kv-wait-timeout", "20"]
        c = start_roles(
            tmp_path_factory.mktemp("transfer-retry"),
            [
                ("prefill", {}, [*flags, "--test-stall-kv-data", "30", "--kv-transport", "dist"]),
                ("prefill", {}, flags),
                ("decode", {}, flags),
                ("decode", {}, flags),
            ],
            gateway_flags=GATEWAY_FLAGS,
        )
        try:
            c.wait_healthy(workers=4)
            yield c
        finally:
            c.stop()

    def test_failed_transfer_is_retried_on_the_other_decode_worker(self, cluster):
        c = cluster
        retries_before = metric(c.url, RETRIES)
        failures_before = metric(c.url, "pdserve_kv_transfer_failures_total")
        with ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda _: generate(c.url, body(8), 120), range(6)))
        assert all(o.ok for o in outs), [o.error for o in outs]
        assert len({tuple(o.output_ids) for o in outs}) == 1
        retried = metric(c.url, RETRIES) - retries_before
        print(f"6 requests, {retried:g} retried after a failed transfer, all completed")
        # Routing spread the 6 over both prefill workers; those on prefill-0 were retried once.
        assert retried >= 1 and metric(c.url, "pdserve_kv_transfer_failures_total") > failures_before
        assert all(o.meta.get("num_migrations", 0) == 0 for o in outs)

    def test_a_transfer_failing_again_is_an_error_not_a_second_retry(self, cluster):
        c = cluster
        _kill_group(c.procs[2])  # prefill-1: every pair now runs through the stalled prefill-0
        wait_for(lambda: "prefill-1" not in workers(c.url), 30, "prefill-1 removed")
        retries_before = metric(c.url, RETRIES)
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda _: generate(c.url, body(8), 120), range(2)))
        for o in outs:
            assert not o.ok and o.status == 503
            assert "transfer" in o.error and "decode leg" in o.error, o.error
        # One retry each (on the other decode worker), then the error.
        assert metric(c.url, RETRIES) - retries_before == 2
