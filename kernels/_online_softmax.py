"""The loop shared by the paged attention kernels: walk a request's context through its page-table row,
load each K/V tile and fold it into a running (max, sum, accumulator) softmax, in base 2."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(Cache, page, in_page, stride_p, stride_s, head_off, offs_d, mask, UPCAST: tl.constexpr):
    """[BLOCK_N, BLOCK_D] rows of one KV head at (page, in_page); fp32 when UPCAST."""
    tile = tl.load(
        Cache + page[:, None] * stride_p + in_page[:, None] * stride_s + head_off + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def online_softmax_step(q, k, v, visible, m_i, l_i, acc, sm_scale_log2, DOT_PRECISION: tl.constexpr):
    """Fold keys k / values v [BLOCK_N, BLOCK_D] into the running state of queries q [ROWS, BLOCK_D];
    `visible` [ROWS or 1, BLOCK_N] masks keys out. Returns the new (m_i, l_i, acc)."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # [ROWS, BLOCK_N]
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def attend_pages(
    q,
    q_pos,
    K,
    V,
    pt_row,
    start,
    end,
    stride_kp,
    stride_ks,
    k_head_off,
    stride_vp,
    stride_vs,
    v_head_off,
    sm_scale_log2,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The softmax state of queries q [ROWS, BLOCK_D] over context positions [start, end) of one request,
    read BLOCK_N at a time through its page-table row `pt_row`; with CAUSAL, row r sees only the keys at
    positions <= q_pos[r] (q_pos is unused otherwise). Returns (m_i, l_i, acc): the running max and sum
    and the unnormalised output."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        kpos = n0 + offs_n  # [BLOCK_N] positions in the request's context
        mask_n = kpos < end
        page = tl.load(pt_row + kpos // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_page = kpos % PAGE_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = load_kv_tile(K, page, in_page, stride_kp, stride_ks, k_head_off, offs_d, kv_mask, UPCAST)
        v = load_kv_tile(V, page, in_page, stride_vp, stride_vs, v_head_off, offs_d, kv_mask, UPCAST)
        if CAUSAL:
            # Key 0 is in the first block and visible to every row, so the running max is finite from
            # then on.
            visible = (kpos[None, :] <= q_pos[:, None]) & mask_n[None, :]
        else:
            visible = mask_n[None, :]
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, sm_scale_log2, DOT_PRECISION)
    return m_i, l_i, acc
