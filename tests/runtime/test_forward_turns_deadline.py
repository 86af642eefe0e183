"""Forward turns have a deadline (runtime/forward_turns.py): a holder that is stopped mid-turn (SIGSTOP)
keeps its flock, and a waiter runs anyway after the bound, names the holder, and gets its turns back
once the holder lets go."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pdserve.runtime import forward_turns as ft
from pdserve.runtime.forward_turns import ForwardTurns

# A worker stand-in that takes one turn and holds it for a minute (it is stopped inside it).
HOLDER = """
import sys, time
from pdserve.runtime.forward_turns import ForwardTurns
turns = ForwardTurns(sys.argv[1], name=sys.argv[2])
with turns.turn():
    print("in turn", flush=True)
    time.sleep(60)
"""


def _stopped_holder(path: str, name: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-P", "-c", HOLDER, path, name], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "in turn"
    os.kill(p.pid, signal.SIGSTOP)
    return p


def _timed_turn(turns: ForwardTurns, limit_s: float) -> float | None:
    """Seconds one turn() took to start, or None if it did not within limit_s (today's code blocks)."""
    took: list[float] = []

    def run() -> None:
        t0 = time.monotonic()
        with turns.turn():
            took.append(time.monotonic() - t0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    return took[0] if took else None


def _lock_is_free(path: str) -> bool:
    """Whether another process could take the turn now (a probe in its own process)."""
    probe = "import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\ntry:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(1)\n"
    return subprocess.run([sys.executable, "-P", "-c", probe, path]).returncode == 0


@pytest.mark.timeout(60)
def test_a_stopped_holder_does_not_block_a_waiter_past_the_bound(tmp_path, caplog):
    path = str(tmp_path / "cpu-forward.lock")
    holder = _stopped_holder(path, "prefill-7")
    try:
        turns = ForwardTurns(path)  # the derived bound: MIN_WAIT_S before any forward
        caplog.set_level(logging.WARNING, logger=ft.__name__)
        took = _timed_turn(turns, 10)
        assert took is not None, "a stopped holder blocked the waiter"
        assert ft.MIN_WAIT_S - 0.1 <= took <= ft.MIN_WAIT_S + 4
        warned = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
        assert len(warned) == 1, caplog.text
        assert f"pid {holder.pid} (prefill-7), which is STOPPED" in warned[0]
        assert turns.stall is not None and turns.stall.holder is not None and turns.stall.holder.stopped
        # The episode goes on: the next forwards do not wait again, and warn no more.
        for _ in range(3):
            took = _timed_turn(turns, 5)
            assert took is not None and took < 0.5
        assert sum("waited" in r.getMessage() for r in caplog.records) == 1
        # The holder dies: the turn comes back, and the next forward holds it again.
        holder.kill()
        holder.wait(10)
        deadline = time.monotonic() + 10

        # The waiting thread clears the stall, then logs outside its lock: wait for both.
        def came_back() -> bool:
            return any("came back" in r.getMessage() for r in caplog.records)

        while (turns.stall is not None or not came_back()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert turns.stall is None
        assert came_back()
        assert _lock_is_free(path)  # given back: nobody forwards now
        with turns.turn():
            assert not _lock_is_free(path), "the forward after the episode ran without the turn"
        turns.close()
    finally:
        holder.kill()
        holder.wait(10)


@pytest.mark.timeout(60)
def test_a_stopped_holder_resumed_gives_the_turn_back(tmp_path):
    path = str(tmp_path / "cpu-forward.lock")
    holder = _stopped_holder(path, "prefill-8")
    try:
        turns = ForwardTurns(path, wait_bound_s=0.3)
        took = _timed_turn(turns, 10)
        assert took is not None and took < 3
        os.kill(holder.pid, signal.SIGCONT)  # it sleeps out its turn, then releases it
        os.kill(holder.pid, signal.SIGTERM)
        holder.wait(10)
        deadline = time.monotonic() + 10
        while turns.stall is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert turns.stall is None
        turns.close()
    finally:
        holder.kill()
        holder.wait(10)


def test_the_holder_writes_its_pid_and_worker_id_in_the_lock_file(tmp_path):
    path = str(tmp_path / "cpu-forward.lock")
    turns = ForwardTurns(path, name="decode-3")
    with turns.turn():
        with open(path, "rb") as f:
            assert f.read().split() == [str(os.getpid()).encode(), b"decode-3"]
    turns.close()


def test_the_bound_is_a_few_recent_forwards_within_limits(tmp_path):
    turns = ForwardTurns(str(tmp_path / "cpu-forward.lock"))
    assert turns.wait_bound_s() == ft.MIN_WAIT_S
    with turns.turn():
        time.sleep(0.6)
    assert 4 * 0.6 <= turns.wait_bound_s() < 4 * 0.6 + 0.5
    turns._durations.append(60.0)  # a forward of a minute does not make a neighbour wait four
    assert turns.wait_bound_s() == ft.MAX_WAIT_S
    assert ForwardTurns(str(tmp_path / "other.lock"), wait_bound_s=0.25).wait_bound_s() == 0.25
    turns.close()


@pytest.mark.timeout(60)
def test_an_offer_during_an_episode_keeps_the_queue(tmp_path):
    """A forward run without the turn offers nothing (its helper thread holds `.next`, queued), and a
    process waiting on the same lock is not let through by it."""
    path = str(tmp_path / "cpu-forward.lock")
    holder = _stopped_holder(path, "prefill-9")
    try:
        turns = ForwardTurns(path, wait_bound_s=0.2)
        with turns.turn() as turn:
            assert turns.stall is not None
            assert turn.offer() is False
            fd = os.open(path + ".next", os.O_RDWR)
            with pytest.raises(BlockingIOError):  # still queued on `.next`
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.close(fd)
        turns.close()
    finally:
        holder.kill()
        holder.wait(10)
