"""pdserve.launch.supervisor with real (tiny) processes: restart with backoff, crash loops retried at the
longest backoff (never given up on), drained workers let go, and a stop that leaves nothing behind."""

from __future__ import annotations

import re
import sys
import threading
import time

import pytest

from pdserve.launch.supervisor import Child, ChildState, RestartPolicy, Supervisor

FAST = RestartPolicy(backoff_initial_s=0.2, backoff_max_s=0.8, max_restarts=3, window_s=60)


def _child(name: str, code: str) -> Child:
    return Child(name, [sys.executable, "-c", code], {})


def _run_until(sup: Supervisor, done, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, sup.states()
        sup.poll()
        time.sleep(0.02)


def _starts(text: str, name: str) -> int:
    return len(re.findall(rf"started {name} pid \d+", text))


@pytest.mark.timeout(60)
def test_crash_loop_is_retried_at_the_cap_and_said_once(tmp_path, capsys):
    """Past max_restarts within the window a child is retried every backoff_max_s, for good (it used
    to stay down); the log says so once, not at each attempt."""
    sup = Supervisor(str(tmp_path), stop_timeout_s=5, policy=FAST)
    sup.start(_child("decode-0", "import sys; sys.exit(3)"))
    sup.start(_child("decode-1", "import time; time.sleep(60)"))
    extra = 3  # attempts past the limit
    try:
        _run_until(sup, lambda: sup.slots["decode-0"].total_restarts == FAST.max_restarts)
        at_limit = time.monotonic()
        _run_until(sup, lambda: sup.slots["decode-0"].total_restarts == FAST.max_restarts + extra)
        spent = time.monotonic() - at_limit
        out = capsys.readouterr()
        assert _starts(out.out, "decode-0") == 1 + FAST.max_restarts + extra, out.out
        delays = [float(d) for d in re.findall(r"decode-0 exited with 3; restarting in ([\d.]+) s", out.err)]
        assert len(delays) == FAST.max_restarts, out.err  # the attempts in the crash loop add no line
        loops = re.findall(r"decode-0 exited with 3 and was restarted (\d+) times .*: crash-looping", out.err)
        assert loops == [str(FAST.max_restarts)], out.err
        # Each attempt in the loop waited the cap (the last one's crash is not waited for here).
        assert extra * FAST.backoff_max_s <= spent < extra * (FAST.backoff_max_s + 0.5), spent
        assert sup.crash_looping() == ["decode-0"] and "stays down" not in out.err
        assert sup.states()["decode-1"] == ChildState.RUNNING
    finally:
        sup.stop()
    assert all(s.proc.poll() is not None for s in sup.slots.values())


@pytest.mark.timeout(60)
def test_a_child_that_refuses_its_configuration_says_why_in_the_launcher(tmp_path, capsys):
    """Exit code 2 is the CLI refusing its flags or model (a --tp-size the model does not split, say):
    the launcher's line carries the child's own sentence, so `pdserve up` shows it without opening logs."""
    say = "print('loading...'); print('pdserve decode: TP size 2 does not split 9 query heads', flush=True)"
    sup = Supervisor(str(tmp_path), stop_timeout_s=5, policy=FAST)
    sup.start(_child("decode-0", f"{say}; import sys; sys.exit(2)"))
    sup.start(_child("prefill-0", "import sys; sys.exit(3)"))
    try:
        _run_until(sup, lambda: all(s.total_restarts >= 1 for s in sup.slots.values()))
    finally:
        sup.stop()
    err = capsys.readouterr().err
    assert (
        "decode-0 exited with 2 (pdserve decode: TP size 2 does not split 9 query heads); restarting" in err
    )
    assert "prefill-0 exited with 3; restarting" in err  # another crash says only its code


@pytest.mark.timeout(60)
def test_a_child_that_stays_up_leaves_the_crash_loop(tmp_path, capsys):
    """Crashes at its first three starts, then runs: out of the crash loop once its restarts fall
    out of the window, said in one line."""
    count = tmp_path / "starts"
    code = f"p = {str(count)!r}; open(p, 'a').write('x')\nimport sys, time\n"
    code += "sys.exit(1) if len(open(p).read()) <= 3 else time.sleep(60)"
    policy = RestartPolicy(backoff_initial_s=0.1, backoff_max_s=0.5, max_restarts=2, window_s=2.0)
    sup = Supervisor(str(tmp_path), stop_timeout_s=5, policy=policy)
    sup.start(_child("prefill-0", code))
    try:
        _run_until(sup, lambda: sup.crash_looping() == ["prefill-0"])
        _run_until(sup, lambda: sup.crash_looping() == [], timeout_s=10)
        assert sup.states()["prefill-0"] == ChildState.RUNNING and sup.slots["prefill-0"].total_restarts == 3
        err = capsys.readouterr()
        assert len(re.findall(r"prefill-0 has stayed up .*: out of the crash loop", err.out)) == 1, err
    finally:
        sup.stop()


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
def test_a_role_whose_only_member_crash_loops_does_not_end_the_watch(tmp_path):
    """It used to: `watch` returned 1 ("no prefill left") and the launcher stopped everything."""
    sup = Supervisor(str(tmp_path), stop_timeout_s=5, policy=FAST)
    sup.start(_child("gateway", "import time; time.sleep(60)"))
    sup.start(_child("prefill-0", "import sys; sys.exit(2)"))
    result: list[int] = []
    watcher = threading.Thread(target=lambda: result.append(sup.watch()))
    watcher.start()
    try:
        deadline = time.monotonic() + 20
        while sup.slots["prefill-0"].total_restarts < FAST.max_restarts + 2:
            assert watcher.is_alive() and time.monotonic() < deadline, (result, sup.states())
            time.sleep(0.05)
        assert sup.crash_looping() == ["prefill-0"] and watcher.is_alive()
    finally:
        sup.stopping = True  # what SIGINT/SIGTERM do
        watcher.join(10)
        sup.stop()
    assert result == [0]


@pytest.mark.timeout(60)
def test_drained_worker_is_let_go_but_a_gateway_exit_is_a_crash(tmp_path):
    sup = Supervisor(str(tmp_path), stop_timeout_s=5, policy=FAST)
    sup.start(_child("decode-0", "pass"))  # exits 0: drained on request
    sup.start(_child("gateway", "import sys, time; time.sleep(0.3); sys.exit(0)"))
    first_gateway = sup.proc("gateway").pid
    try:
        _run_until(sup, lambda: sup.proc("gateway").pid != first_gateway)
        assert sup.states()["decode-0"] == ChildState.DRAINED
        assert sup.slots["decode-0"].total_restarts == 0
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
