"""A side thread's parallel torch op must not make the forward's OpenMP threads sleep between its
regions (pdserve/side_threads.py). Each case runs in a fresh interpreter: libgomp's thread count is
process-wide state that the test process has already changed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import os, sys, threading, time
import torch
from pdserve.side_threads import serial_openmp

torch.set_num_threads(2)
a, b = torch.randn(64, 2048), torch.randn(2048, 256)


def switches():  # voluntary context switches of every thread of this process
    total = 0
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{tid}/status") as f:
            total += int(f.read().split("\nvoluntary_ctxt_switches:")[1].split()[0])
    return total


done = threading.Event()


def side():
    if sys.argv[1] == "serial":
        serial_openmp()
    torch.ones(1 << 22).sum()  # a parallel op in this thread
    done.wait()


for _ in range(50):
    a @ b
t = threading.Thread(target=side)
t.start()
time.sleep(0.5)
before = switches()
for _ in range(300):
    a @ b  # small parallel regions back to back
print(switches() - before)
done.set()
t.join()
"""


def _sleeps(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-P", "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs for a team of two threads")
def test_a_side_thread_with_serial_openmp_leaves_the_forward_threads_spinning() -> None:
    # Measured quiet: 299-301 sleeps without it, 0 with it. A loaded machine makes spinning threads wait
    # too (31 seen beside the rest of the suite under -n 2), so each side gets three tries and the bound
    # for "spinning" is a quarter of the 300 regions, half of the one for "sleeping".
    # Without it, libgomp manages more threads than CPUs and stops spinning: about one sleep a region.
    assert max(_sleeps("parallel") for _ in range(3)) > 150
    # With it, the side thread's op runs inline and the forward's second thread stays awake.
    assert min(_sleeps("serial") for _ in range(3)) < 75
