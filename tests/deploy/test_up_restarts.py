"""`pdserve up`'s restart policy with a worker that crashes at every start.

A missing STANDALONE draft model fails every decode worker at startup (after its target model
loaded), while the prefill worker, which never drafts, starts fine: exactly one role crash-loops.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
from harness import process_alive, start_up

pytestmark = pytest.mark.timeout(300)


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


def test_crash_looping_decode_stops_the_launcher_naming_it(tmp_path):
    c = start_up(
        tmp_path, extra=_crashing_decode(tmp_path, ["--max-restarts", "1", "--restart-backoff", "0.5"])
    )
    try:
        up = c.procs[0]
        rc = up.wait(timeout=240)
        log = (tmp_path / "up.log").read_text()
        assert rc == 1, log
        assert "no decode left: decode-0 crash-looped" in log, log
        assert re.search(r"decode-0 exited with 2 and was restarted 1 times .*: it stays down", log), log
        # The limit holds: the first start and one restart, no spinning; prefill never crashed.
        names = [n for n, _ in _starts(log)]
        assert names.count("decode-0") == 2 and names.count("prefill-0") == 1, names
        assert "prefill-0 exited" not in log, log
        decode_log = (tmp_path / "decode-0.log").read_text()
        assert "no-such-draft-model" in decode_log, decode_log
        assert [n for n, pid in _starts(log) if process_alive(pid)] == []
    finally:
        c.stop()


def test_ctrl_c_during_a_restart_backoff_stops_everything(tmp_path):
    c = start_up(tmp_path, extra=_crashing_decode(tmp_path, ["--restart-backoff", "120"]))
    try:
        up = c.procs[0]
        log = _wait_log(tmp_path / "up.log", r"decode-0 exited with 2; restarting in 120 s", 240, up)
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
