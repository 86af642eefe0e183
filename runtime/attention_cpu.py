"""Attention backend for CPU decode: `make_attention_backend("cpu")`, what `auto` picks on CPU.

Decode batches (one new token per request) run the C++ paged decode attention
(kernels/cpu_decode_attention.py), which reads every request's cached K and V where they lie in the
pool. Everything else (prefills, extends over a cached prefix, speculative verifies) is the torch
backend's, unchanged. `--attention-backend torch` keeps the torch path for decode too: the reference.

Batch-invariant (`every_query`, runtime/determinism.py): the queries of every other forward go through
the extend kernel (`paged_extend_attention`), which computes each query over its own request's pool rows
up to and including its own position, after the new keys and values are stored, with the decode
kernel's arithmetic. A prompt's token then attends exactly as it would as a decode step, whatever the
chunking, the cached prefix or the batch. The cost is the prompt's attention without flash's matrix
blocking (docs/reliability.md).
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_decode_attention
from pdserve.kernels.cpu_decode_layer import DecodeAttention
from pdserve.runtime.attention import TorchAttention
from pdserve.runtime.batch import ForwardBatch
from pdserve.runtime.kv_pool import KVPool


class CpuAttention(TorchAttention):
    def __init__(self, every_query: bool = False) -> None:
        super().__init__()
        if not cpu_decode_attention.load():
            raise RuntimeError("the CPU paged decode attention kernel could not be built (see the log)")
        self.every_query = every_query
        self._decode = False
        self._query_rows: torch.Tensor | None = None  # [B, max_len] each request's key rows (every_query)
        self._prefix = self._qo = torch.empty(0, dtype=torch.long)

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:
        self._decode = max(batch.extend_lens_cpu) == 1  # a CPU backend: make_attention_backend checks
        self._query_rows = None
        if not self._decode and self.every_query:
            self._prepare_queries(batch, pool)
            return
        if not self._decode:
            super().prepare(batch, pool)
            return
        self._batch = batch
        self._out_rows = pool.slot_rows(batch.out_cache_loc)
        self._rows = pool.rows()
        # [B, max_len] pool row of each position; each request reads its own seq_len of them, the new
        # token's included (forward writes it first).
        self._key_rows = pool.key_rows(batch.page_table, max(batch.seq_lens_cpu)).view(batch.batch_size, -1)
        self._lens = batch.seq_lens.long()

    def _prepare_queries(self, batch: ForwardBatch, pool: KVPool) -> None:
        """An extend batch for the extend kernel: each request's key rows, its positions before its
        first new token, and where its queries lie."""
        self._batch = batch
        self._out_rows = pool.slot_rows(batch.out_cache_loc)
        self._rows = pool.rows()
        lmax = max(batch.seq_lens_cpu)
        self._query_rows = pool.key_rows(batch.page_table, lmax).view(batch.batch_size, lmax)
        self._prefix = (batch.seq_lens - batch.extend_lens).long()
        self._qo = batch.qo_indptr.long()

    def decode_args(self, layer: int, pool: KVPool) -> DecodeAttention | None:
        """What `forward` passes the kernel for this layer of a decode batch (None for other batches):
        the one-call decode layer (kernels/cpu_decode_layer.py) makes that call itself."""
        if not self._decode:
            return None
        k_offset, v_offset = pool.row_offset(layer, 0), pool.row_offset(layer, 1)
        return DecodeAttention(self._rows, self._key_rows, self._lens, k_offset, v_offset, self._out_rows)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, pool: KVPool, scale: float
    ) -> torch.Tensor:
        if self._query_rows is not None:
            k_off, v_off = pool.row_offset(layer, 0), pool.row_offset(layer, 1)
            # stored first (in the pool's dtype), then every query reads its keys from the pool: as a
            # decode step reads them
            self._rows.index_copy_(0, self._out_rows + k_off, k.to(self._rows.dtype))
            self._rows.index_copy_(0, self._out_rows + v_off, v.to(self._rows.dtype))
            return cpu_decode_attention.paged_extend_attention(
                q, self._rows, self._query_rows, self._prefix, self._qo, k_off, v_off, scale
            )
        a = self.decode_args(layer, pool)
        if a is None:
            return super().forward(q, k, v, layer, pool, scale)
        # the new token's K and V stored, then attended to with the cached ones: one call
        return cpu_decode_attention.paged_decode_attention_store(
            q, a.rows, a.key_rows, a.lens, a.k_offset, a.v_offset, scale, a.new_rows, k, v
        )
