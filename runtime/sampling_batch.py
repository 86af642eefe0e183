"""A batch's sampling parameters as tensors: what `Sampler` reads, built once per batch.

Every per-row parameter is a [B] tensor used as a [B, 1] column, so the sampler's work is a fixed
number of batched tensor ops whatever the batch mix. Flags computed once in `SamplingBatch.build`
(on the host) let the common cases skip whole stages without reading anything back from the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.sampling_params import SamplingParams

# Every per-row integer lands in an int64 tensor, whatever got past validation (a worker may be
# driven by a peer that validates less, and `seed + j` for n > 1 is derived after validation).
_INT64_MAX = 2**63 - 1
# Seeds are taken modulo this, so that every int is a seed and none overflows the hash's int64.
SEED_MODULUS = 2**63
# Below this temperature a row is greedy (as vLLM's _SAMPLING_EPS): dividing by it would overflow
# the logits to inf and the softmax to NaN. NaN and negative temperatures are greedy too.
MIN_TEMPERATURE = 1e-5
# Above this, scaling changes nothing measurable (every logit is ~0); capped so inf never divides.
MAX_TEMPERATURE = 1e4


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row tensors built once per batch from the rows' SamplingParams."""

    temperatures: torch.Tensor  # [B] float32; 1.0 on greedy rows (never divided by zero)
    greedy: torch.Tensor  # [B] bool: temperature 0 or top_k 1
    top_ks: torch.Tensor  # [B] int64; 0 = off
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    presence_penalties: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64; -1 = unseeded
    # logit_bias as (row, token id, bias) triples: [N] int64, [N] int64, [N] float32.
    bias_rows: torch.Tensor
    bias_ids: torch.Tensor
    bias_vals: torch.Tensor
    # min_new_tokens: (row, stop token id) pairs masked while the row has fewer output tokens than
    # min_new_tokens[row]: [M] int64 each; min_new_tokens [B] int64.
    min_new_tokens: torch.Tensor
    min_new_rows: torch.Tensor
    min_new_ids: torch.Tensor
    seeded_rows: torch.Tensor  # [S] int64 row indices with a seed
    unseeded_rows: torch.Tensor  # [B - S] int64
    # Host-side flags: the sampler branches on these, never on device values.
    all_greedy: bool
    any_top_k: bool
    max_top_k: int
    any_top_p: bool
    any_min_p: bool
    any_repetition: bool
    any_freq_presence: bool
    any_logit_bias: bool
    any_min_new: bool
    need_logprobs: bool
    max_top_logprobs: int

    @property
    def size(self) -> int:
        return self.temperatures.shape[0]

    @property
    def any_penalty(self) -> bool:
        """Some row's logits change before sampling (the penalized path needs output_ids)."""
        return self.any_repetition or self.any_freq_presence or self.any_logit_bias or self.any_min_new

    @property
    def any_seeded(self) -> bool:
        return self.seeded_rows.numel() > 0

    @property
    def any_unseeded(self) -> bool:
        return self.unseeded_rows.numel() > 0

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        device: torch.device | str = "cpu",
        eos_token_ids: Sequence[Sequence[int]] | None = None,
        vocab_size: int | None = None,
    ) -> SamplingBatch:
        """`eos_token_ids[row]`: the row's EOS ids, masked (with its stop_token_ids) below min_new_tokens.

        Never raises for any int or float a SamplingParams holds: top_k at or past `vocab_size` is off,
        seeds are reduced modulo `SEED_MODULUS`, token ids outside [0, vocab_size) (or int64) are
        dropped from logit_bias and stop_token_ids, counts are capped to int64, and temperatures below
        `MIN_TEMPERATURE` (or NaN) are greedy."""
        id_limit = vocab_size if vocab_size is not None else _INT64_MAX

        def in_vocab(t: int) -> bool:
            return 0 <= t < id_limit

        greedy = [_is_greedy(p) for p in params]
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items() if in_vocab(t)]
        min_new = [
            (i, t)
            for i, p in enumerate(params)
            if p.min_new_tokens > 0
            for t in sorted(set(p.stop_token_ids) | set(eos_token_ids[i] if eos_token_ids else ()))
            if in_vocab(t)
        ]
        # Filters are meaningless on greedy rows; clearing them keeps the flags honest. A top_k that
        # keeps the whole vocabulary is no filter either.
        top_ks = [
            0 if g or p.top_k <= 0 or p.top_k >= id_limit else p.top_k
            for p, g in zip(params, greedy, strict=True)
        ]
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
        seeds = [-1 if p.seed is None else p.seed % SEED_MODULUS for p in params]
        temperatures = [
            1.0 if g else min(p.temperature, MAX_TEMPERATURE) for p, g in zip(params, greedy, strict=True)
        ]
        min_new_tokens = [min(max(p.min_new_tokens, 0), _INT64_MAX) for p in params]

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            temperatures=f32(temperatures),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_ks=i64(top_ks),
            top_ps=f32(top_ps),
            min_ps=f32(min_ps),
            repetition_penalties=f32([p.repetition_penalty for p in params]),
            frequency_penalties=f32([p.frequency_penalty for p in params]),
            presence_penalties=f32([p.presence_penalty for p in params]),
            seeds=i64(seeds),
            bias_rows=i64([i for i, _, _ in bias]),
            bias_ids=i64([t for _, t, _ in bias]),
            bias_vals=f32([b for _, _, b in bias]),
            min_new_tokens=i64(min_new_tokens),
            min_new_rows=i64([i for i, _ in min_new]),
            min_new_ids=i64([t for _, t in min_new]),
            seeded_rows=i64([i for i, s in enumerate(seeds) if s >= 0]),
            unseeded_rows=i64([i for i, s in enumerate(seeds) if s < 0]),
            all_greedy=all(greedy),
            any_top_k=any(k > 0 for k in top_ks),
            max_top_k=max(top_ks, default=0),
            any_top_p=any(p < 1.0 for p in top_ps),
            any_min_p=any(p > 0.0 for p in min_ps),
            any_repetition=any(p.repetition_penalty != 1.0 for p in params),
            any_freq_presence=any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params),
            any_logit_bias=bool(bias),
            any_min_new=bool(min_new),
            need_logprobs=any(p.logprobs or p.top_logprobs_num > 0 for p in params),
            max_top_logprobs=min(max((p.top_logprobs_num for p in params), default=0), _INT64_MAX),
        )


def _is_greedy(p: SamplingParams) -> bool:
    """Argmax row: temperature 0 (or below MIN_TEMPERATURE, or NaN) or top_k 1."""
    return p.greedy or not p.temperature >= MIN_TEMPERATURE
