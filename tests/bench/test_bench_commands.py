"""Every `pdserve bench` command starts: its --help answers (a benchmark whose entry point does not
take the command line it is given fails here, not on the first machine that runs it)."""

from __future__ import annotations

import subprocess

import pytest

from pdserve.bench.commands import BENCH_COMMANDS
from pdserve.launch.supervisor import pdserve_command


def test_bench_help_lists_every_command_with_its_line():
    """`pdserve bench --help` is read from the table: each command once, with its help line."""
    r = subprocess.run(pdserve_command("bench", "--help"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    listed = r.stdout.split("commands:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in listed] == list(BENCH_COMMANDS)
    for line, command in zip(listed, BENCH_COMMANDS.values()):
        assert line.split(None, 1)[1] == command.help


@pytest.mark.parametrize("name", list(BENCH_COMMANDS))
def test_bench_help(name):
    r = subprocess.run(
        pdserve_command("bench", name, "--help"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage" in r.stdout.lower(), r.stdout[:500]


def test_bench_cpu_prints_each_kernel_beside_torch():
    """One tiny round of `pdserve bench cpu`: a row per row count and per batch, each with its ratio."""
    from pdserve.kernels import cpu_quant_linear

    r = subprocess.run(
        pdserve_command(
            "bench", "cpu", "--rows", "1,3", "--batches", "1", "--context", "20", "--repeats", "1"
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if not all(cpu_quant_linear.support()) or not cpu_quant_linear.int4_a8_support():
        assert r.returncode == 1 and "not built" in r.stdout
        return
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("pdserve_cpu kernels: ")
    rows = [line.split() for line in lines if line.split() and line.split()[0] in ("1", "3")]
    assert [row[0] for row in rows] == ["1", "3", "1"]  # two linear rows, one attention row
    assert all(row[3].endswith("x") and float(row[3][:-1]) > 0 for row in rows[:2])
