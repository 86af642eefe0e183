"""Attention backends: one small interface, the torch backend as the CPU path and the reference.

Contract of `forward`: write the new tokens' K and V into the pool at `batch.out_cache_loc`, then
compute attention for every new query over its own request's cached prefix plus the new tokens up
to and including itself (causal). `prepare` is called once per forward, before the first layer.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from pdserve.runtime.batch import ForwardBatch
from pdserve.runtime.kv_pool import KVPool


class AttentionBackend(Protocol):
    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, pool: KVPool, scale: float
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]."""
        ...


class TorchAttention:
    """Pads the batch to [B, max_new, ...] x [B, max_len, ...] and runs SDPA once per layer.

    A single prompt runs torch's CPU flash kernel without a mask: plain causal when nothing of it is
    cached; with a cached prefix and a new part at least as long (`split_min_new` tokens or more), as
    two calls, the new part over the prefix and over itself, merged by their log-sum-exps. The masked
    call computes every query against every key (the masked triangle included): 17.7 -> 12.9 ms a layer
    at 900 new tokens over 200 cached, 21.5 -> 15.2 at 1,000 over 50 (bf16, 9 query / 3 KV heads,
    2 threads, EPYC); at 300 over 300 or 500 over 2,000 the masked call was as fast or faster.

    With grouped-query attention the G query heads that share a KV head are folded into the query
    length: SDPA sees [B, Hkv, G * max_new, D] queries against [B, Hkv, max_len, D] keys, with the
    mask repeated per group. That is what a paged decode kernel does, and on CPU it avoids SDPA's
    GQA path, which is several times slower in bf16 for short queries.
    """

    split_min_new = 512

    def __init__(self) -> None:
        self._batch: ForwardBatch | None = None
        self._group_masks: dict[int, torch.Tensor] = {}

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:
        self._batch = batch
        dev = batch.input_ids.device
        B = batch.batch_size
        self._qmax = max(batch.extend_lens_cpu)
        lmax = max(batch.seq_lens_cpu)
        self._uniform = min(batch.extend_lens_cpu) == self._qmax
        # A single prompt with no cached prefix needs neither a gather nor a mask: plain causal.
        self._plain_causal = B == 1 and batch.seq_lens_cpu[0] == batch.extend_lens_cpu[0]
        self._out_rows = pool.slot_rows(batch.out_cache_loc)  # [T] rows of the new tokens
        self._prefix_rows: torch.Tensor | None = None
        if self._plain_causal:
            return
        new, cached = batch.extend_lens_cpu[0], batch.seq_lens_cpu[0] - batch.extend_lens_cpu[0]
        if B == 1 and dev.type == "cpu" and new >= max(cached, self.split_min_new):
            self._prefix_rows = pool.key_rows(batch.page_table, cached)  # [cached] rows of the prefix
            return
        j = torch.arange(lmax, device=dev)
        # [B * lmax] pool row of every key position (padding maps into page 0 and is masked out)
        self._key_rows = pool.key_rows(batch.page_table, lmax)
        qi = torch.arange(self._qmax, device=dev)
        self._group_masks = {}
        # One new token per request and every request as long as the longest: each query sees every
        # key, so SDPA runs unmasked (always so for a single decoding request) and no mask is built.
        self._unmasked = self._qmax == 1 and min(batch.seq_lens_cpu) == lmax
        if not self._unmasked:
            seq = batch.seq_lens.long()[:, None]  # [B, 1]
            qpos = seq - batch.extend_lens.long()[:, None] + qi[None]  # [B, qmax]
            # [B, 1, qmax, lmax]: key j visible to query i iff j <= pos(i); padded queries see key 0
            mask = (j[None, None] <= qpos[:, :, None]) & (j[None, None] < seq[:, :, None])
            self._mask = mask[:, None]
        if not self._uniform:
            valid = qi[None] < batch.extend_lens.long()[:, None]  # [B, qmax]
            starts = batch.qo_indptr[:-1].long()[:, None]
            self._q_rows = torch.where(valid, starts + qi[None], 0)  # [B, qmax] row of q to gather
            self._q_valid = valid

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, pool: KVPool, scale: float
    ) -> torch.Tensor:
        batch = self._batch
        assert batch is not None, "prepare() must run before forward()"
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        rows = pool.rows()  # [all rows, Hkv, D]
        k_off, v_off = pool.row_offset(layer, 0), pool.row_offset(layer, 1)
        if rows.dtype != k.dtype:
            # a pool in another dtype (--kv-cache-dtype): the new keys and values are attended to as
            # stored, as every later step reads them
            k, v = k.to(rows.dtype), v.to(rows.dtype)
            rows.index_copy_(0, self._out_rows + k_off, k)
            rows.index_copy_(0, self._out_rows + v_off, v)
            k, v = k.to(q.dtype), v.to(q.dtype)
        else:
            rows.index_copy_(0, self._out_rows + k_off, k)
            rows.index_copy_(0, self._out_rows + v_off, v)
        if self._plain_causal:
            # 4-D, as transformers calls it: torch's CPU flash kernel takes only 4-D inputs; 3-D ones
            # fell back to the math path, 4.5x slower at 1,024 tokens (bf16, 9 q / 3 KV heads, 2 threads)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=True,
                scale=scale,
                enable_gqa=Hq != Hkv,
            )  # [1, Hq, T, D]
            return out[0].transpose(0, 1)
        if self._prefix_rows is not None:
            kp = rows.index_select(0, self._prefix_rows + k_off).to(q.dtype)
            vp = rows.index_select(0, self._prefix_rows + v_off).to(q.dtype)
            return _attend_after_prefix(q, k, v, kp, vp, scale)
        B = batch.batch_size
        # index_select on flat rows, not advanced indexing: several times faster on CPU for this
        # gather, which is most of the decode step's attention time after SDPA.
        keys = rows.index_select(0, self._key_rows + k_off).to(q.dtype).view(B, -1, Hkv, D).transpose(1, 2)
        vals = rows.index_select(0, self._key_rows + v_off).to(q.dtype).view(B, -1, Hkv, D).transpose(1, 2)
        if self._uniform:
            qp = q.view(B, self._qmax, Hq, D)
        else:
            qp = q[self._q_rows]  # [B, qmax, Hq, D]
        G, qmax = Hq // Hkv, self._qmax
        # q head h reads KV head h // G (transformers' repeat_kv order): row g * qmax + i of KV head j
        # is query i of q head j * G + g.
        qg = qp.view(B, qmax, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * qmax, D)
        mask = None if self._unmasked else self._group_mask(G)
        out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask, scale=scale)
        out = out.view(B, Hkv, G, qmax, D).permute(0, 3, 1, 2, 4).reshape(B, qmax, Hq, D)
        if self._uniform:
            return out.reshape(T, Hq, D)
        return out[self._q_valid]  # [T, Hq, D], request-major like q

    def _group_mask(self, G: int) -> torch.Tensor:
        """[B, 1, G * qmax, lmax]: the batch mask repeated once per query head of a group."""
        if G == 1:
            return self._mask
        if G not in self._group_masks:
            self._group_masks[G] = self._mask.repeat(1, 1, G, 1)
        return self._group_masks[G]


def _attend_after_prefix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, scale: float
) -> torch.Tensor:
    """One prompt's new tokens q/k/v [N, H, D] after its cached prefix kp/vp [P, Hkv, D]: attention over
    the prefix (all visible) and over the new part (causal), each through the CPU flash kernel, which
    returns every row's log-sum-exp; the two softmaxes are merged with weights sigmoid(lse1 - lse2)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qt = q.transpose(0, 1)[None]
    o1, l1 = flash(qt, kp.transpose(0, 1)[None], vp.transpose(0, 1)[None], 0.0, False, scale=scale)
    o2, l2 = flash(qt, k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, True, scale=scale)
    w = torch.sigmoid(l1 - l2).unsqueeze(-1)  # [1, Hq, N, 1]: the prefix's share of each row's mass
    out = torch.lerp(o2.float(), o1.float(), w).to(q.dtype)
    return out[0].transpose(0, 1)


def make_attention_backend(
    name: str, device: torch.device, batch_invariant: bool = False
) -> AttentionBackend:
    """`auto`: Triton on CUDA; on CPU the C++ paged decode kernel where it builds, else torch.
    `batch_invariant` (runtime/determinism.py, which checked the kernel builds): every query through it."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        else:
            from pdserve.kernels import cpu_decode_attention

            name = "cpu" if cpu_decode_attention.load() else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("--attention-backend cpu runs on CPU only")
        from pdserve.runtime.attention_cpu import CpuAttention

        return CpuAttention(every_query=batch_invariant)
    if name == "triton":
        from pdserve.runtime.attention_triton import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch, cpu or triton")
