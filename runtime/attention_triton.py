"""Attention backend on the Triton kernels: the GPU path behind `make_attention_backend("triton")`.

Same contract as TorchAttention: store the new tokens' K/V at `out_cache_loc`, then each new query
attends causally to its request's prefix plus the new tokens up to itself. A batch where every
request brings exactly one token runs the split-K decode kernel; anything else (prompts, chunks,
speculative verify) runs the extend kernel, which reads the just-stored K/V from the pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.decode_attention import decode_attention, default_num_splits
from pdserve.kernels.extend_attention import extend_attention
from pdserve.kernels.kv_copy import store_kv
from pdserve.runtime.batch import ForwardBatch
from pdserve.runtime.kv_pool import KVPool


@dataclass(frozen=True)
class _Plan:
    """Host-side launch sizes, fixed for every layer of one forward."""

    decode: bool
    max_seq_len: int
    max_extend_len: int
    num_splits: int


class TritonAttention:
    def __init__(self) -> None:
        self._batch: ForwardBatch | None = None
        self._plan: _Plan | None = None

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:
        # Plans from the host copies only: no device reads, so no synchronization per forward.
        max_ext = max(batch.extend_lens_cpu)
        max_len = max(batch.seq_lens_cpu)
        geo = pool.geometry
        self._batch = batch
        self._plan = _Plan(
            decode=max_ext == 1,
            max_seq_len=max_len,
            max_extend_len=max_ext,
            num_splits=default_num_splits(batch.batch_size, geo.kv_heads, max_len, batch.seq_lens.device),
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, pool: KVPool, scale: float
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]."""
        batch, plan = self._batch, self._plan
        assert batch is not None and plan is not None, "prepare() must run before forward()"
        k_cache = pool.k(layer)  # [num_pages, page_size, Hkv, D]
        v_cache = pool.v(layer)
        store_kv(k_cache, v_cache, k, v, batch.out_cache_loc)
        if plan.decode:
            # One token per request: row b of q is request b.
            return decode_attention(
                q, k_cache, v_cache, batch.page_table, batch.seq_lens, scale,
                max_seq_len=plan.max_seq_len, num_splits=plan.num_splits,
            )  # fmt: skip
        return extend_attention(
            q, k_cache, v_cache, batch.page_table, batch.qo_indptr, batch.seq_lens, scale,
            max_extend_len=plan.max_extend_len,
        )  # fmt: skip
