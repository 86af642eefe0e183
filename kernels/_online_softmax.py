"""The inner loop shared by the paged attention kernels: load a K/V tile through the page table and
fold it into a running (max, sum, accumulator) softmax, in base 2."""

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
