"""A worker started with a `--test-*` hook (a hidden row of the flag table) says so in its log, one WARNING
line per hook, before it loads anything (pdserve/worker/test_hooks.py warn_test_hooks)."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import time

import pytest

from pdserve.launch.flag import DECODE, PREFILL
from pdserve.launch.flags import add_flags, flags_of
from pdserve.launch.supervisor import pdserve_command
from pdserve.worker.test_hooks import warn_test_hooks


def parsed(role: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser, role)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("role", [PREFILL, DECODE])
def test_each_hook_set_is_one_warning_and_none_by_default(role, caplog) -> None:
    hooks = [f.name for f in flags_of(role) if f.hidden]
    assert hooks and all(name.startswith("--test-") for name in hooks)
    assert warn_test_hooks(parsed(role), role) == [] and not caplog.records
    argv = [a for name in hooks for a in (name, "3")]
    lines = warn_test_hooks(parsed(role, *argv), role)
    assert len(lines) == len(hooks)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == lines
    for name, line in zip(hooks, lines):
        assert line.startswith(f"{name} 3") and "for tests only" in line


def test_a_worker_started_with_a_hook_logs_it(tmp_path) -> None:
    """A real prefill worker process: the warning is in its log within seconds of its start."""
    proc = subprocess.Popen(
        pdserve_command("prefill", "--test-clock-skew", "5", "--gateway", "127.0.0.1:9"),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path)},
    )
    assert proc.stderr is not None
    seen: list[str] = []
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            if "WARNING --test-clock-skew 5.0 is set: a hook for tests only" in line:
                break
    finally:
        proc.kill()
        proc.wait(30)
    assert any("WARNING --test-clock-skew 5.0 is set: a hook for tests only" in s for s in seen), seen
