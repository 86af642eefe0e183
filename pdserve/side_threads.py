"""Side threads that run torch ops (KV page copies) keep out of the forward's OpenMP team.

libgomp lets the idle threads of a parallel region spin for a while (~300,000 rounds) before they
sleep, so that the next region finds them awake; but when it manages more threads than the process
may use CPUs, it spins 100 rounds only. A side thread's first parallel torch op starts an OpenMP team
of its own, which puts a worker that gives its forward every core over that line for the rest of its
life: each of a decode step's ~200 parallel calls then wakes a sleeping thread. Measured on the
bundled model (bf16 + w4a16, 2 cores, Xeon Sapphire Rapids class): served, a batch-1 step took
~20 ms, its OpenMP thread sleeping and waking ~130 times a token, against ~10 ms offline.

`serial_openmp()`, called first in such a thread, gives that thread's own parallel regions one thread:
torch's ops then run inline there and no second team exists, and the forward keeps its cores
spinning. A page copy then runs on one core (~4-5 GB/s on the machine above, the shared-memory
transfer benchmark's one-thread figure).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

__all__ = ["serial_openmp"]


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch has loaded (none where torch uses another OpenMP, or none)."""
    try:
        return ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None


def serial_openmp() -> None:
    """Make the calling thread's torch ops use one thread (OpenMP's team size is per thread)."""
    # torch sets a thread's team size at its first parallel use (to the process-wide count): let
    # that happen first, so that it does not undo the setting below.
    torch.get_num_threads()
    lib = _libgomp()
    if lib is not None:
        lib.omp_set_num_threads(1)
