"""pdserve.supervisor with real (tiny) processes: restart with backoff, crash-loop limit, drained
workers let go, the roles that keep a cluster alive, and a stop that leaves nothing behind."""

from __future__ import annotations

import re
import sys
import time

import pytest

from pdserve.supervisor import Child, ChildState, RestartPolicy, Supervisor

FAST = RestartPolicy(backoff_initial_s=0.2, backoff_max_s=0.8, max_restarts=3, window_s=60)


def _child(name: str, code: str) -> Child:
    return Child(name, [sys.executable, "-c", code], {})


def _run_until(sup: Supervisor, done, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, sup.states()
        sup.poll()
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_crash_loop_backs_off_then_stays_down(tmp_path, capsys):
    sup = Supervisor(str(tmp_path), stop_timeout_s=5, policy=FAST)
    sup.start(_child("decode-0", "import sys; sys.exit(3)"))
    sup.start(_child("decode-1", "import time; time.sleep(60)"))
    try:
        _run_until(sup, lambda: sup.states()["decode-0"] == ChildState.DOWN)
        out = capsys.readouterr()
        starts = re.findall(r"started decode-0 pid \d+", out.out)
        assert len(starts) == 1 + FAST.max_restarts, out.out
        delays = [float(d) for d in re.findall(r"decode-0 exited with 3; restarting in ([\d.]+) s", out.err)]
        assert len(delays) == FAST.max_restarts, out.err
        assert "stays down" in out.err
        # decode-1 still runs: the cluster goes on with it.
        assert sup.states()["decode-1"] == ChildState.RUNNING and sup.fatal() is None
    finally:
        sup.stop()
    assert all(s.proc.poll() is not None for s in sup.slots.values())


@pytest.mark.timeout(60)
def test_backoff_doubles_up_to_the_cap(tmp_path):
    sup = Supervisor(str(tmp_path), stop_timeout_s=5, policy=FAST)
    sup.start(_child("prefill-0", "import sys; sys.exit(1)"))
    gaps = []
    try:
        last_pid = sup.proc("prefill-0").pid
        died_at = None
        while len(gaps) < 3:
            sup.poll()
            slot = sup.slots["prefill-0"]
            if slot.state == ChildState.BACKOFF and died_at is None:
                died_at = time.monotonic()
            if slot.proc.pid != last_pid:
                gaps.append(time.monotonic() - died_at)
                last_pid, died_at = slot.proc.pid, None
            time.sleep(0.01)
    finally:
        sup.stop()
    # 0.2, 0.4, 0.8 s (the cap): each at least its delay, and not much more.
    for gap, want in zip(gaps, [0.2, 0.4, 0.8]):
        assert want <= gap < want + 0.5, gaps


@pytest.mark.timeout(60)
def test_a_role_with_no_member_left_is_fatal(tmp_path):
    sup = Supervisor(str(tmp_path), stop_timeout_s=5, policy=FAST)
    sup.start(_child("gateway", "import time; time.sleep(60)"))
    sup.start(_child("prefill-0", "import sys; sys.exit(2)"))
    try:
        _run_until(sup, lambda: sup.fatal() is not None)
        assert sup.fatal() == "no prefill left: prefill-0 crash-looped"
    finally:
        sup.stop()


@pytest.mark.timeout(60)
def test_drained_worker_is_let_go_but_a_gateway_exit_is_a_crash(tmp_path):
    sup = Supervisor(str(tmp_path), stop_timeout_s=5, policy=FAST)
    sup.start(_child("decode-0", "pass"))  # exits 0: drained on request
    sup.start(_child("gateway", "import sys, time; time.sleep(0.3); sys.exit(0)"))
    first_gateway = sup.proc("gateway").pid
    try:
        _run_until(sup, lambda: sup.proc("gateway").pid != first_gateway)
        assert sup.states()["decode-0"] == ChildState.DRAINED
        assert sup.slots["decode-0"].total_restarts == 0 and sup.fatal() is None
    finally:
        sup.stop()


@pytest.mark.timeout(60)
def test_restart_runs_the_argv_set_for_it(tmp_path):
    marker = tmp_path / "second-run"
    sup = Supervisor(str(tmp_path), stop_timeout_s=5, policy=FAST)
    sup.start(_child("gateway", "import sys; sys.exit(1)"))
    sup.set_argv("gateway", [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"])
    try:
        _run_until(sup, marker.exists)
    finally:
        sup.stop()


@pytest.mark.timeout(60)
def test_no_restart_while_stopping(tmp_path):
    sup = Supervisor(str(tmp_path), stop_timeout_s=5, policy=FAST)
    sup.start(_child("decode-0", "import sys; sys.exit(1)"))
    first = sup.proc("decode-0").pid
    _run_until(sup, lambda: sup.states()["decode-0"] == ChildState.BACKOFF)
    sup.stopping = True  # what SIGINT/SIGTERM do
    time.sleep(FAST.backoff_initial_s + 0.1)
    sup.poll()
    assert sup.proc("decode-0").pid == first and sup.states()["decode-0"] == ChildState.BACKOFF
    sup.stop()
