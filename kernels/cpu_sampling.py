"""Greedy sampling on CPU (cpu_sampling.cpp): `greedy(logits [B, V] float32) -> [B] int64`, each row's
index of its largest value, the first of equal ones and the first NaN where there is one, as
`logits.max(dim=-1).indices` (`greedy_ref`), in one vectorized pass (3.1 against 6.0 ms for [64, 49152]
floats, measured once on a loaded machine). Part of the `pdserve_cpu` library (kernels/cpu_library.py).
"""

from __future__ import annotations

import torch

from pdserve.kernels.cpu_library import load

__all__ = ["greedy", "greedy_ref", "load"]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.pdserve_cpu.greedy(logits)
    return out


def greedy_ref(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(dim=-1).indices
