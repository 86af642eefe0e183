"""Paged decode attention: one query token per request, grouped-query heads, split-K.

Stage 1 runs one program per (request, kv head, split): the program loads the query rows of the
whole GQA group at once (so each K/V page is read once per group, not once per query head),
walks its slice of the request's context through the page table and writes a partial output and
its log-sum-exp. Stage 2 merges the splits. Splitting long contexts keeps the GPU busy when the
batch is small; with one split the merge is a cheap copy.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import (
    cdiv,
    check_launchable,
    check_paged_attention,
    interpreted,
    next_pow2,
    output_like,
)
from pdserve.kernels._online_softmax import attend_pages

_LOG2E = 1.4426950408889634
# A split shorter than this costs more in the merge than it wins in parallelism.
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 64


@triton.jit
def _decode_partial_kernel(
    Q,  # [B, Hq, D]
    K,  # [num_pages, page_size, Hkv, D]
    V,
    PageTable,  # [B, max_pages] int32
    SeqLens,  # [B] int32
    MidO,  # [B, Hq, S, D] fp32
    MidLse,  # [B, Hq, S] fp32, log2 domain
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    sm_scale_log2,
    split_len,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h  # [BLOCK_H] query heads sharing this kv head
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    pt_row = PageTable + b.to(tl.int64) * stride_pt
    m_i, l_i, acc = attend_pages(
        q, heads, K, V, pt_row, start, end,
        stride_kp, stride_ks, kvh * stride_kh, stride_vp, stride_vs, kvh * stride_vh, sm_scale_log2,
        BLOCK_H, HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, False, DOT_PRECISION, UPCAST,
    )  # fmt: skip

    # An empty split (context shorter than start) contributes weight 0 to the merge.
    has = l_i > 0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    mo = (
        MidO
        + b.to(tl.int64) * stride_mob
        + heads[:, None] * stride_moh
        + split * stride_mos
        + offs_d[None, :]
    )
    tl.store(mo, o, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(MidLse + b.to(tl.int64) * stride_mlb + heads * stride_mlh + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    MidO,  # [B, Hq, S, D] fp32
    MidLse,  # [B, Hq, S] fp32
    Out,  # [B, Hq, D]
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(MidLse + b * stride_mlb + h * stride_mlh + offs_s, mask=mask_s, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # [BLOCK_S]; empty splits get 0
    o = tl.load(
        MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough (request, kv head, split) programs for a few waves, never splits under 256 tokens."""
    if device.type != "cuda":
        return max(1, min(4, cdiv(max_seq_len, 64)))
    target = 4 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    want = cdiv(target, max(1, batch * kv_heads))
    return max(1, min(want, cdiv(max_seq_len, _MIN_SPLIT_TOKENS), _MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention of one new query per request over its paged context (new token included).

    q [B, Hq, D]; k_cache/v_cache [num_pages, page_size, Hkv, D]; page_table [B, max_pages] int32;
    seq_lens [B] int32 (context length per request, >= 1); `max_seq_len` is a host-side upper bound
    of seq_lens (sizes the splits without reading the device). Returns out [B, Hq, D].
    """
    page_size, Hkv = check_paged_attention(q, k_cache, v_cache, page_table, seq_lens)
    B, Hq, D = q.shape
    if page_table.shape[0] != B or seq_lens.shape[0] != B:
        raise ValueError(
            f"page_table {tuple(page_table.shape)} and seq_lens {tuple(seq_lens.shape)} need batch {B}"
        )
    if page_table.shape[1] * page_size < max_seq_len:
        raise ValueError(f"page_table of {page_table.shape[1]} pages cannot hold max_seq_len {max_seq_len}")
    out = output_like(q, out)
    if B == 0:
        return out
    dev = q.device
    check_launchable(_decode_partial_kernel, dev)
    max_seq_len = max(1, int(max_seq_len))
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, max_seq_len, dev)
    split_len = cdiv(cdiv(max_seq_len, num_splits), block_n) * block_n  # rounded up to BLOCK_N
    num_splits = cdiv(max_seq_len, split_len)

    group = Hq // Hkv
    mid_o = torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=dev)
    mid_lse = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=dev)
    block_d = max(16, next_pow2(D))
    _decode_partial_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        scale * _LOG2E,
        split_len,
        HEAD_DIM=D, GROUP=group, PAGE_SIZE=page_size,
        BLOCK_H=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreted(_decode_partial_kernel),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    _decode_merge_kernel[(B, Hq)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        num_splits,
        HEAD_DIM=D, BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d,
        num_warps=4,
    )  # fmt: skip
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference (fp32 math, one request at a time): same arguments, same result."""
    B, Hq, D = q.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=q.device)
        slots = page_table[b, pos // page_size].long() * page_size + pos % page_size  # [n]
        k = k_cache.reshape(-1, Hkv, D)[slots].float().repeat_interleave(Hq // Hkv, dim=1)  # [n, Hq, D]
        v = v_cache.reshape(-1, Hkv, D)[slots].float().repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale  # [Hq, n]
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out
