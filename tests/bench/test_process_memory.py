"""The PSS of a process tree (benchmarks/process_memory.py) against real processes: a child of a child
that allocates and touches 200 MiB, then frees it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdserve.bench.process_memory import MemorySampler, process_tree, pss_bytes, rss_bytes, tree_pss_bytes

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux /proc/PID/smaps_rollup"
)

MIB = 2**20
# The grandchild: touches 200 MiB when told, frees it when told, exits when told.
CHILD = """
import sys
print("ready", flush=True)
sys.stdin.readline()
x = b"\\x01" * (200 << 20)
print("touched", flush=True)
sys.stdin.readline()
del x
print("freed", flush=True)
sys.stdin.readline()
"""
# The root: starts the grandchild on its own stdin and stdout, and waits for it.
ROOT = f"import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', {CHILD!r}]).returncode)"


def _tell(proc: subprocess.Popen, expect: str | None) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    if expect is not None:
        assert proc.stdout.readline().strip() == expect


@pytest.mark.timeout(60)
def test_tree_pss_follows_a_grandchild_that_touches_200_mib():
    root = subprocess.Popen(
        [sys.executable, "-c", ROOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    sampler = MemorySampler({"tree": root.pid}, interval_s=0.05)
    try:
        assert root.stdout is not None and root.stdout.readline().strip() == "ready"
        tree = process_tree(root.pid)
        assert tree[0] == root.pid and len(tree) == 2, tree  # the root and its child
        child = tree[1]
        base = tree_pss_bytes(root.pid)
        assert base == sum(pss_bytes(p) or 0 for p in tree) and base > 0
        sampler.start()
        sampler.take_peaks()

        _tell(root, "touched")
        held = tree_pss_bytes(root.pid)
        assert 190 * MIB <= held - base <= 215 * MIB, (held - base) / MIB
        assert (rss_bytes(child) or 0) >= 200 * MIB and (pss_bytes(child) or 0) >= 190 * MIB
        time.sleep(0.3)  # a few background samples while it is held

        _tell(root, "freed")
        assert tree_pss_bytes(root.pid) < held - 150 * MIB
        peak = sampler.take_peaks()["tree"]
        assert peak >= base + 190 * MIB, (peak - base) / MIB  # the window kept the high one
        assert sampler.take_peaks()["tree"] < held - 150 * MIB  # a new window: low again

        _tell(root, None)
        assert root.wait(timeout=30) == 0
        assert pss_bytes(child) is None and tree_pss_bytes(root.pid) == 0  # gone: counts nothing
    finally:
        sampler.stop()
        if root.poll() is None:
            root.kill()
            root.wait()
