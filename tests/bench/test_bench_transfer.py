"""`pdserve bench transfer` moves real KV between two processes over both transports, between TP layouts
too, and refuses layouts that do not map."""

from __future__ import annotations

import re
import subprocess

import pytest

from pdserve.launch.supervisor import pdserve_command

pytestmark = pytest.mark.timeout(300)


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = pdserve_command("bench", "transfer", "--tokens", "64", "--reps", "1", *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("p,d", [(1, 3), (3, 1)])
def test_between_tp_layouts_both_transports_report_throughput(p, d) -> None:
    out = _bench("--prefill-tp", str(p), "--decode-tp", str(d))
    assert out.returncode == 0, out.stderr
    assert f"prefill {'TP 1 (KV heads 0-2)' if p == 1 else 'TP 3 (KV heads 0 | 1 | 2)'}" in out.stdout
    assert "each decode rank receives " + ("33% | 33% | 33%" if d == 3 else "100%") in out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if re.match(r"^\s+64\s+(random|runs)\b", line)]
    assert len(rows) == 2
    for row in rows:  # tokens, order, MiB, dist GB/s, dist ms, shm GB/s, shm ms, shm/dist, raw GB/s
        assert all(float(x) > 0 for x in row[2:]), row


def test_a_layout_that_does_not_map_is_refused() -> None:
    out = _bench("--prefill-tp", "2")
    assert out.returncode == 2
    assert "cannot map prefill layout TP 2 (TP 2 does not split 3 KV heads" in out.stderr


def test_checksum_modes_run_side_by_side_and_report_their_cost() -> None:
    out = _bench("--transports", "shm", "--kv-checksum", "off", "all")
    assert out.returncode == 0, out.stderr
    assert "shm/off GB/s" in out.stdout and "shm/all GB/s" in out.stdout, out.stdout
    cost = re.search(
        r"checksum all on shm, time against off: 64 random ([+-]\d+\.\d)%, 64 runs ([+-]\d+\.\d)%", out.stdout
    )
    assert cost is not None, out.stdout
