"""The sampler's randomness: exponential noise for the exponential race `argmax(probs / E)`, which
samples exactly from `probs`, and uniforms from the same streams.

Seeded rows draw with a counter-based hash of (seed, step, salt, vocab index), so a row's noise
depends only on its own seed and step: its tokens do not change with the other requests in the
batch or their order. Unseeded rows use torch's global generator.
"""

from __future__ import annotations

import torch

from pdserve.runtime.sampling_batch import SamplingBatch

_MASK32 = 0xFFFFFFFF


def exponential_noise(
    shape: torch.Size, batch: SamplingBatch, steps: torch.Tensor | list[int], salt: int, device: torch.device
) -> torch.Tensor:
    """[B, V] exponential noise: seeded rows from their hash streams, the rest from torch's generator."""
    vocab = shape[1]
    if not batch.any_seeded:
        return _global_exponential(shape, device)
    seeded = -torch.log(hash_uniform(batch, steps, salt, vocab, device))  # [S, V]
    if not batch.any_unseeded:
        return seeded
    noise = _global_exponential(shape, device)
    noise[batch.seeded_rows] = seeded
    return noise


def _global_exponential(shape: torch.Size, device: torch.device) -> torch.Tensor:
    # A zero would turn 0 / 0 into NaN, which argmax would pick.
    return torch.empty(shape, device=device).exponential_().clamp_min_(1e-20)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective 32-bit integer hash (xorshift-multiply) on int64 holding values in [0, 2**32).

    Both multipliers are below 2**31, so products stay below 2**63: no signed overflow anywhere.
    """
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def hash_uniform(
    batch: SamplingBatch, steps: torch.Tensor | list[int], salt: int, n: int, device: torch.device
) -> torch.Tensor:
    """[S, n] float32 uniforms in (0, 1) for the seeded rows at counters 0..n-1."""
    seeds = batch.seeds[batch.seeded_rows].to(device)  # [S]
    step = torch.as_tensor(steps, dtype=torch.int64, device=device)[batch.seeded_rows.to(device)]  # [S]
    # Two independent 32-bit row keys, so that different (seed, step) pairs never share a noise
    # vector up to a permutation of the vocabulary.
    key = _mix32(seeds & _MASK32)
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32(key ^ (step & _MASK32))
    key = _mix32(key ^ ((step >> 32) & _MASK32))
    key_a = _mix32(key ^ (salt & _MASK32))  # [S]
    key_b = _mix32(key_a ^ 0x9E3779B9)  # [S]
    counter = torch.arange(n, dtype=torch.int64, device=device)[None, :]  # [1, n]
    h = _mix32(_mix32(counter ^ key_a[:, None]) ^ key_b[:, None])  # [S, n]
    # 23 random bits -> odd multiples of 2**-24: exact in float32 and strictly inside (0, 1).
    return ((h >> 9) * 2 + 1).to(torch.float32) * (2.0**-24)
