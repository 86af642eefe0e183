"""Launched servers' starts (benchmarks/launch_servers.py): one at a time, timed from spawn to healthy,
weighed meanwhile, a `pdserve up` only once all its workers are in rotation, a cold one in an empty
cache folder; against small fake servers, so no model loads."""

from __future__ import annotations

import json
import os
import sys

import pytest

from pdserve.bench.bench_serving import parse_args
from pdserve.bench.launch_servers import Planned, plan_launches, start_in_turn
from pdserve.bench.page_cache import cached_share, resident_bytes, weight_files
from pdserve.bench.process_memory import tree_pss_bytes

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux /proc/PID/smaps_rollup"
)

MIB = 2**20
# A server that starts like a real one: /health 503 for `delay` s, holding `mib` MiB meanwhile (the
# load's peak), then 200 with that freed; /workers lists `workers` workers, `late` of them in rotation
# only `late_s` s after /health turned 200 (401 with workers < 0); /env shows PDSERVE_CACHE_DIR.
FAKE = """
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, delay, mib, workers, late, late_s = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), \\
    int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
t0 = time.monotonic()
held = b"\\x01" * (mib << 20)
ready = [None]

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def answer(self, code, body=b""):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        up = time.monotonic() - t0 >= delay
        if self.path == "/health":
            return self.answer(200 if up else 503)
        if self.path == "/env":
            return self.answer(200, os.environ.get("PDSERVE_CACHE_DIR", "").encode())
        if self.path == "/workers":
            if workers < 0:
                return self.answer(401)
            in_rotation = workers - late if time.monotonic() - t0 < delay + late_s else workers
            listed = [{"state": "healthy" if i < in_rotation else "draining"} for i in range(workers)]
            return self.answer(200, json.dumps({"workers": listed}).encode())
        self.answer(404)

server = ThreadingHTTPServer(("127.0.0.1", port), H)
while time.monotonic() - t0 < delay:
    server.timeout = 0.05
    server.handle_request()
del held
server.serve_forever()
"""


def _fake(name: str, port: int, delay: float, mib: int = 0, workers: int = 0, late: int = 0,
          late_s: float = 0.0, **kw) -> Planned:  # fmt: skip
    argv = [sys.executable, "-c", FAKE, str(port), str(delay), str(mib), str(workers), str(late), str(late_s)]
    return Planned(name, argv, port, workers=workers or None, **kw)


def _port(offset: int) -> int:
    return 41000 + (os.getpid() % 2000) * 4 + offset


@pytest.mark.timeout(60)
def test_servers_start_one_after_another_timed_and_weighed(tmp_path):
    """The second server spawns only once the first is healthy; each start is timed from spawn and its
    peak PSS includes what the start held and then freed; the page-cache share of its weights is read."""
    weights = tmp_path / "w.gguf"
    weights.write_bytes(os.urandom(4 * MIB))  # just written: in the page cache
    planned = [_fake("slow", _port(0), 1.5, mib=150, weights=[str(weights)]), _fake("quick", _port(1), 0.3)]
    said = []
    started = start_in_turn(planned, str(tmp_path), 30, said.append)
    try:
        slow, quick = started
        assert [s.name for s in said] == ["slow", "quick"]
        assert slow.start is not None and quick.start is not None
        assert 1.5 <= slow.start.healthy_s < 3.5, slow.start
        assert 0.3 <= quick.start.healthy_s < 2.5, quick.start
        assert quick.spawned_at >= slow.spawned_at + slow.start.healthy_s  # in turn, not together
        idle = tree_pss_bytes(slow.proc.pid)
        assert slow.start.peak_pss is not None and slow.start.peak_pss >= idle + 120 * MIB
        assert slow.start.page_cache_share == pytest.approx(1.0, abs=0.01)
        assert quick.start.page_cache_share is None and slow.start.cold is None
    finally:
        for s in started:
            s.stop()
    assert all(s.proc.poll() is not None for s in started)


@pytest.mark.timeout(60)
def test_pdserve_is_healthy_once_every_worker_is_in_rotation(tmp_path):
    """/health 200 means a prefill and a decode in rotation; a cluster of 3 counts once /workers lists all
    3 in rotation. Where /workers refuses (a cluster with an admin key), /health alone counts."""
    (full,) = start_in_turn([_fake("pd", _port(2), 0.2, workers=3, late=1, late_s=1.5)], str(tmp_path), 30)
    (keyed,) = start_in_turn([_fake("keyed", _port(3), 0.2, workers=-1)], str(tmp_path), 30)
    try:
        assert full.start is not None and full.start.healthy_s >= 1.7, full.start
        assert keyed.start is not None and keyed.start.healthy_s < 1.5, keyed.start
    finally:
        full.stop()
        keyed.stop()


@pytest.mark.timeout(60)
def test_a_failed_start_stops_the_servers_already_up(tmp_path):
    broken = Planned("broken", [sys.executable, "-c", "raise SystemExit(3)"], _port(1))
    first = _fake("first", _port(0), 0.1)
    said = []
    with pytest.raises(RuntimeError, match="broken exited with 3"):
        start_in_turn([first, broken], str(tmp_path), 30, said.append)
    (up,) = said
    assert up.proc.poll() is not None  # stopped on the way out


@pytest.mark.timeout(60)
def test_a_cold_start_gets_an_empty_cache_folder_removed_at_stop(tmp_path, monkeypatch):
    import httpx

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache" / "pdserve"))
    (s,) = start_in_turn([_fake("pdserve", _port(0), 0.1, cold=True)], str(tmp_path), 30)
    try:
        cache = httpx.get(s.url + "/env", timeout=5).text
        assert s.start is not None and s.start.cold is True
        assert os.path.dirname(cache) == str(tmp_path / "cache") and os.listdir(cache) == []
    finally:
        s.stop()
    assert not os.path.exists(cache)


def test_launch_plans_read_pdserve_ups_own_flags(tmp_path):
    """Workers to wait for and weight files come from the flags as `pdserve up` reads them; llama-server
    reads its -m file; --cold-start marks every `pdserve up`."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    args = parse_args(["--launch-pdserve", "--pdserve-args", f"--model-path {model} --num-decode 2",
                       "--launch-pdserve-variant", "one=--num-decode 1", "--cold-start",
                       "--launch-llama-server", str(exe), "--llama-server-model", str(model)])  # fmt: skip
    pd, one, llama = plan_launches(args, str(tmp_path))
    assert (pd.name, pd.workers, pd.weights, pd.cold) == ("pdserve", 3, [str(model)], True)
    assert (one.name, one.workers, one.cold) == ("one", 2, True)  # the variant's flag comes last
    assert (llama.name, llama.workers, llama.weights) == ("llama-server", None, [str(model)])
    assert llama.cold is None
    bundled = plan_launches(parse_args(["--launch-pdserve"]), str(tmp_path))[0]
    assert bundled.workers == 2 and bundled.weights[0].endswith(".gguf") and bundled.cold is False


def test_page_cache_share_of_files(tmp_path):
    f = tmp_path / "a.safetensors"
    f.write_bytes(os.urandom(MIB))
    (tmp_path / "b.json").write_text(json.dumps({}))
    assert weight_files(str(tmp_path)) == [str(f)] and weight_files(str(f)) == [str(f)]
    assert resident_bytes(str(f)) == (MIB, MIB)  # just written
    assert cached_share([str(f)]) == 1.0 and cached_share([]) is None
    assert cached_share([str(tmp_path / "missing")]) is None
    empty = tmp_path / "e.gguf"
    empty.write_bytes(b"")
    assert resident_bytes(str(empty)) == (0, 0)
