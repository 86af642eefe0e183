"""`pdserve up`'s restart policy: a worker that crashes at every start, or is killed again and again.

A missing STANDALONE draft model fails every decode worker at startup (after its target model
loaded), while the prefill worker, which never drafts, starts fine: exactly one role crash-loops.
Past --max-restarts a worker is retried every 30 s (the longest backoff) and the launcher goes on:
it used to leave the worker down and exit 1 once a role had no member left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import pytest
from harness import process_alive, start_up
from reliability.calls import body, generate, wait_for

pytestmark = pytest.mark.timeout(300)
CRASH_LOOP = (
    r"decode-0 exited with (-?\d+)(?: \(.+\))? and was restarted 1 times within 300 s: crash-looping, "
    r"retried every 30 s"
)


def _starts(log: str) -> list[tuple[str, int]]:
    return [(name, int(pid)) for name, pid in re.findall(r"started (\S+) pid (\d+)", log)]


def _crashing_decode(tmp_path, policy: list[str]) -> list[str]:
    missing = os.path.join(tmp_path, "no-such-draft-model")
    return ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", missing, *policy]


def _wait_log(path, pattern: str, timeout_s: float, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if re.search(pattern, text):
            return text
        assert proc.poll() is None, f"pdserve up exited with {proc.returncode}:\n{text}"
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} not in the log within {timeout_s} s")


def test_crash_looping_decode_at_startup_is_retried_and_the_launcher_waits(tmp_path):
    """It used to exit 1 ("no decode left: decode-0 crash-looped") after --max-restarts."""
    c = start_up(
        tmp_path, extra=_crashing_decode(tmp_path, ["--max-restarts", "1", "--restart-backoff", "0.5"])
    )
    try:
        up = c.procs[0]
        log = _wait_log(tmp_path / "up.log", CRASH_LOOP, 240, up)
        assert re.search(CRASH_LOOP, log).group(1) == "2", log
        time.sleep(2)  # the old launcher gave up here
        assert up.poll() is None, (tmp_path / "up.log").read_text()
        log = (tmp_path / "up.log").read_text()
        assert "no decode left" not in log and "stays down" not in log, log
        # The first start and one restart so far (the next comes 30 s later); prefill never crashed.
        names = [n for n, _ in _starts(log)]
        assert names.count("decode-0") == 2 and names.count("prefill-0") == 1, names
        assert "prefill-0 exited" not in log, log
        assert "no-such-draft-model" in (tmp_path / "decode-0.log").read_text()
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0, (tmp_path / "up.log").read_text()
        assert [n for n, pid in _starts(log) if process_alive(pid)] == []
    finally:
        c.stop()


def _decode_pid(log_path, nth: int, proc: subprocess.Popen) -> int:
    """The pid of decode-0's `nth` start (1: the first), once the launcher has printed it."""
    deadline = time.monotonic() + 120
    while True:
        pids = [pid for n, pid in _starts(log_path.read_text()) if n == "decode-0"]
        if len(pids) >= nth:
            return pids[nth - 1]
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.05)


def _listed(url: str) -> dict[str, dict]:
    return {w["worker_id"]: w for w in httpx.get(url + "/workers?all=1", timeout=10).json()["workers"]}


def test_a_worker_killed_past_the_limit_is_retried_at_the_cap_and_the_cluster_goes_on(tmp_path):
    c = start_up(tmp_path, extra=["--max-restarts", "1", "--restart-backoff", "0.5"])
    try:
        c.wait_healthy(workers=2)
        up, log_path = c.procs[0], tmp_path / "up.log"
        os.kill(_decode_pid(log_path, 1, up), signal.SIGKILL)
        os.kill(_decode_pid(log_path, 2, up), signal.SIGKILL)  # its restart, killed at once
        log = _wait_log(log_path, CRASH_LOOP, 60, up)
        t_loop = time.monotonic()
        # Between attempts the gateway lists it as down (its last registration), with /workers?all=1.
        wait_for(lambda: _listed(c.url)["decode-0"]["state"] == "down", 30, "decode-0 listed down")
        third = _decode_pid(log_path, 3, up)
        waited = time.monotonic() - t_loop
        assert 25 < waited < 45, waited  # the cap (30 s), not the 1 s the doubling would give
        assert up.poll() is None
        c.wait_healthy(workers=2)
        out = generate(c.url, body(8))
        assert out.ok, out.error
        log = log_path.read_text()
        assert len(re.findall(r"crash-looping", log)) == 1, log  # said once, not per attempt
        assert process_alive(third) and "no decode left" not in log
        print(f"decode-0 restarted {waited:.1f} s into its crash loop; serving again")
    finally:
        c.stop()


def test_ctrl_c_during_a_restart_backoff_stops_everything(tmp_path):
    c = start_up(tmp_path, extra=_crashing_decode(tmp_path, ["--restart-backoff", "120"]))
    try:
        up = c.procs[0]
        log = _wait_log(
            tmp_path / "up.log",
            r"decode-0 exited with 2 \(pdserve decode: .+\); restarting in 120 s",
            240,
            up,
        )
        children = _starts(log)
        assert {n for n, _ in children} == {"gateway", "prefill-0", "decode-0"}, log
        t0 = time.monotonic()
        up.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends to the launcher
        assert up.wait(timeout=60) == 0, (tmp_path / "up.log").read_text()
        print(f"pdserve up stopped {time.monotonic() - t0:.1f} s after SIGINT during a restart backoff")
        deadline = time.monotonic() + 10
        while any(process_alive(pid) for _, pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [n for n, pid in children if process_alive(pid)] == []
        log = (tmp_path / "up.log").read_text()
        assert [n for n, _ in _starts(log)].count("decode-0") == 1, "restarted after Ctrl-C"
    finally:
        c.stop()
