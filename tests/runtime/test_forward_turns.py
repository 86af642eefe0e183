"""Forward turns (runtime/forward_turns.py): co-located CPU workers' forwards never overlap, a dead
holder never blocks the others, and a runner given the lock computes only while it holds it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pdserve.runtime.forward_turns import ForwardTurns

# A worker stand-in in its own process: takes `n` turns of `hold` seconds, printing each turn's span.
TAKER = """
import sys, time
from pdserve.runtime.forward_turns import ForwardTurns
turns = ForwardTurns(sys.argv[1])
n, hold = int(sys.argv[2]), float(sys.argv[3])
print("ready", flush=True)
for _ in range(n):
    with turns.turn():
        start = time.monotonic()
        time.sleep(hold)
        print(f"{start} {time.monotonic()}", flush=True)
    time.sleep(0.001)
"""


def _taker(path: str, n: int, hold: float) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-P", "-c", TAKER, path, str(n), str(hold)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.timeout(60)
def test_turns_of_two_processes_never_overlap(tmp_path):
    path = str(tmp_path / "cpu-forward.lock")
    procs = [_taker(path, 15, 0.01) for _ in range(2)]
    spans = []
    for p in procs:
        out, _ = p.communicate(timeout=30)
        assert p.returncode == 0
        spans += [tuple(map(float, line.split())) for line in out.splitlines()]
    assert len(spans) == 30
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end, "two turns overlapped"


@pytest.mark.timeout(60)
def test_a_holder_killed_mid_turn_releases_it(tmp_path):
    path = str(tmp_path / "cpu-forward.lock")
    holder = _taker(path, 1, 60.0)  # holds its turn for a minute
    time.sleep(0.2)
    turns = ForwardTurns(path)
    got = threading.Event()

    def take() -> None:
        with turns.turn():
            got.set()

    t = threading.Thread(target=take, daemon=True)
    t.start()
    assert not got.wait(0.5), "took a turn another process holds"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(10)
    assert got.wait(10), "the dead holder's turn was never released"
    turns.close()


@pytest.mark.timeout(120)
def test_a_runner_with_the_lock_computes_only_in_its_turn(tmp_path, tiny_folders):
    from pdserve.config import RuntimeConfig
    from pdserve.runtime.batch import ForwardMode
    from pdserve.runtime.request import Request
    from pdserve.runtime.runner import ModelRunner
    from pdserve.sampling_params import SamplingParams

    path = str(tmp_path / "cpu-forward.lock")
    folder = next(iter(tiny_folders.values()))
    cfg = RuntimeConfig(model_path=folder, device="cpu", max_total_tokens=256, cpu_forward_lock=path)
    runner = ModelRunner(cfg)
    req = Request("r", [1, 2, 3, 4], SamplingParams(max_new_tokens=2))
    assert runner.reserve(req, 8)
    other = ForwardTurns(path)  # another worker's open file: its lock excludes the runner's
    done = threading.Event()

    def forward() -> None:
        runner.forward(ForwardMode.EXTEND, [req], [req.prompt_ids])
        done.set()

    with other.turn():
        t = threading.Thread(target=forward, daemon=True)
        t.start()
        assert not done.wait(1.0), "the runner computed during another worker's turn"
        assert req.num_computed == 0
    assert done.wait(30)
    assert req.num_computed == 4
    other.close()


def test_an_unusable_lock_path_is_named(tmp_path):
    with pytest.raises(ValueError, match="--cpu-forward-lock .*missing"):
        ForwardTurns(str(tmp_path / "missing" / "cpu-forward.lock"))


# A long forward stand-in: one turn of `n` slices of `hold` s, offering the turn between slices.
LONG = """
import sys, time
from pdserve.runtime.forward_turns import ForwardTurns
turns = ForwardTurns(sys.argv[1])
n, hold = int(sys.argv[2]), float(sys.argv[3])
print("ready", flush=True)
with turns.turn() as turn:
    start = time.monotonic()
    for i in range(n):
        if i and turn.offer():
            start = time.monotonic()  # a waiter ran meanwhile: our compute starts again now
        time.sleep(hold)
        print(f"{start} {time.monotonic()}", flush=True)
        start = time.monotonic()
"""


@pytest.mark.timeout(60)
def test_a_long_forward_lets_a_waiting_worker_run_between_its_layers(tmp_path):
    path = str(tmp_path / "cpu-forward.lock")
    long = subprocess.Popen(
        [sys.executable, "-P", "-c", LONG, path, "100", "0.02"], stdout=subprocess.PIPE, text=True
    )
    assert long.stdout is not None and long.stdout.readline().strip() == "ready"
    time.sleep(0.2)  # inside its turn
    short = _taker(path, 5, 0.01)
    short_out, _ = short.communicate(timeout=30)
    t_short_done = time.monotonic()
    long_out, _ = long.communicate(timeout=30)
    assert short.returncode == 0 and long.returncode == 0
    short_spans = [tuple(map(float, line.split())) for line in short_out.splitlines()]
    long_spans = [tuple(map(float, line.split())) for line in long_out.splitlines()]
    assert len(short_spans) == 5 and len(long_spans) == 100
    # The short worker's five turns ran inside the long one, not after it...
    assert t_short_done < long_spans[-1][1] - 0.5
    # ...and never while the long one computed.
    for s0, s1 in short_spans:
        for l0, l1 in long_spans:
            assert s1 <= l0 or l1 <= s0, "a short turn overlapped the long forward's compute"


@pytest.mark.timeout(120)
def test_a_long_runner_forward_offers_its_turn_between_layers(tmp_path, tiny_folders, monkeypatch):
    """A forward of >= OFFER_TURN_MIN_TOKENS tokens offers its turn after every layer but the last (the
    offer itself is the real one, counted on the way); a shorter one never does. (The threshold is
    lowered to fit the tiny model's 128-token context.)"""
    from pdserve.config import RuntimeConfig
    from pdserve.runtime import runner as runner_module
    from pdserve.runtime.batch import ForwardMode
    from pdserve.runtime.request import Request
    from pdserve.runtime.runner import ModelRunner
    from pdserve.sampling_params import SamplingParams

    monkeypatch.setattr(runner_module, "OFFER_TURN_MIN_TOKENS", 64)

    path = str(tmp_path / "cpu-forward.lock")
    folder = next(iter(tiny_folders.values()))
    cfg = RuntimeConfig(model_path=folder, device="cpu", max_total_tokens=1024, cpu_forward_lock=path)
    runner = ModelRunner(cfg)
    assert runner.turns is not None
    offers = []
    real = runner.turns.offer
    runner.turns.offer = lambda: offers.append(1) or real()  # type: ignore[method-assign]
    assert runner.spec.num_layers >= 2
    for n, expected in ((63, 0), (64, runner.spec.num_layers - 1)):
        offers.clear()
        req = Request(f"r{n}", [5] * n, SamplingParams(max_new_tokens=1))
        assert runner.reserve(req, n)
        runner.forward(ForwardMode.EXTEND, [req], [req.prompt_ids])
        runner.release(req)
        assert len(offers) == expected, n
