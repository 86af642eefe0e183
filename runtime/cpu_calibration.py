"""What this CPU computes faster, measured once per host and cached: the choice behind `--dtype auto`.

A flag alone does not say it: torch runs bf16 matmuls on any x86 CPU, through AMX or AVX512-BF16 where
they exist (2-10x fp32's speed) and emulated elsewhere (an AVX2 EPYC: 8x slower than fp32). So the
first worker on a host times one matmul of the bundled model's shape (32 rows of a 576 x 1536 weight,
the middle of a decode batch's range) in bf16 and in fp32, best of 5, about 20 ms, and saves the
answer in pdserve's cache folder under a name that hashes the CPU's flags (as PDSERVE_CPU_ISA leaves
them), torch's version and its CPU capability; later workers read it, so that every worker of a host
picks the same dtype (a prefill and a decode worker must agree on their KV's). bf16 is taken only
where it is at least `MARGIN` times faster: fp32 is the exactness reference.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve import env
from pdserve.kernels import cpu_isa

MARGIN = 1.3
ROWS, IN, OUT = 32, 576, 1536


@dataclass(frozen=True)
class MatmulSpeeds:
    fp32_us: float
    bf16_us: float

    @property
    def bf16_wins(self) -> bool:
        return self.fp32_us >= MARGIN * self.bf16_us

    def why(self) -> str:
        ratio = self.fp32_us / self.bf16_us
        verdict = "bfloat16" if self.bf16_wins else "float32"
        return f"{verdict}: a {ROWS}-row matmul took {self.fp32_us:.0f} us in fp32, {self.bf16_us:.0f} in bf16 ({ratio:.2f}x)"


def _operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, IN, generator=g).to(dtype)
    w = torch.randn(OUT, IN, generator=g).to(dtype)
    F.linear(x, w)  # warm
    return x, w


def _time_once_us(x: torch.Tensor, w: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for _ in range(4):
        F.linear(x, w)
    return (time.perf_counter() - t0) / 4 * 1e6


def measure() -> MatmulSpeeds:
    """Time the matmul in both dtypes now (uncached): best of 5 each, the two dtypes taking turns, so
    that a neighbour busy for part of the measurement slows both alike (a cold start measured bf16 at
    370 us against its usual 100-150 while another process was still writing, and chose fp32)."""
    f32, b16 = _operands(torch.float32), _operands(torch.bfloat16)
    fp32_us = bf16_us = float("inf")
    for _ in range(5):
        fp32_us = min(fp32_us, _time_once_us(*f32))
        bf16_us = min(bf16_us, _time_once_us(*b16))
    return MatmulSpeeds(fp32_us=fp32_us, bf16_us=bf16_us)


def _cache_path() -> Path:
    key = hashlib.sha256(" ".join(sorted(cpu_isa.flags())).encode())
    key.update(f"{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}|{MARGIN}|{ROWS}".encode())
    return Path(env.cache_dir()) / "host" / f"matmul-{key.hexdigest()[:16]}.json"


def matmul_speeds() -> MatmulSpeeds:
    """This host's speeds: from the cache, or measured now (under a lock: workers that start together
    measure once, one at a time) and cached."""
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                saved = json.loads(path.read_text())
                return MatmulSpeeds(float(saved["fp32_us"]), float(saved["bf16_us"]))
            except (OSError, ValueError, KeyError, TypeError):
                pass
            speeds = measure()
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"fp32_us": speeds.fp32_us, "bf16_us": speeds.bf16_us}))
            tmp.replace(path)
            return speeds
    except OSError:  # no writable cache: measure for this process alone
        return measure()
