"""Every `pdserve bench` command starts: its --help answers (a benchmark whose entry point does not
take the command line it is given fails here, not on the first machine that runs it)."""

from __future__ import annotations

import subprocess

import pytest

from pdserve.cli import BENCHMARKS
from pdserve.launch.supervisor import pdserve_command


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_help(name):
    r = subprocess.run(
        pdserve_command("bench", name, "--help"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage" in r.stdout.lower(), r.stdout[:500]
