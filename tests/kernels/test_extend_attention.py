"""Extend (prefill over cached prefixes) and speculative verify attention against the reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.decode_attention import decode_attention
from pdserve.kernels.extend_attention import extend_attention, extend_attention_ref

F32, BF16 = torch.float32, torch.bfloat16


def _inputs(make_paged_kv, prefix_lens, extend_lens, hkv, group, dim, page, dtype, device, seed=0):
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k, v, table = make_paged_kv(seq_lens, page, hkv, dim, dtype, seed=seed)
    T = sum(extend_lens)
    q = (
        torch.randn(T, hkv * group, dim, generator=torch.Generator().manual_seed(seed + 1))
        .to(dtype)
        .to(device)
    )
    indptr = torch.tensor(
        [0, *torch.tensor(extend_lens).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k, v, table, indptr, lens


# (prefix_lens, extend_lens, kv_heads, group, head_dim, page_size, dtype)
EXTEND_CASES = [
    ([0], [1], 1, 1, 64, 16, F32),
    ([0, 17, 5], [1, 20, 7], 2, 3, 64, 16, F32),
    ([3, 0], [4, 45], 1, 8, 64, 1, F32),  # 45 tokens x 8 heads: several row blocks
    ([70, 0, 130], [3, 33, 1], 2, 1, 64, 64, F32),
    ([0, 9], [100, 2], 1, 3, 32, 16, F32),  # long prompt: many key blocks, causal trimming
    ([12, 0, 1], [6, 19, 1], 2, 8, 64, 16, BF16),
    ([64, 3], [1, 40], 1, 3, 64, 64, BF16),
    ([0, 5], [10, 10], 1, 1, 64, 1, BF16),
]


@pytest.mark.parametrize("prefix,ext,hkv,group,dim,page,dtype", EXTEND_CASES)
def test_extend_matches_reference(make_paged_kv, check, device, prefix, ext, hkv, group, dim, page, dtype):
    q, k, v, table, indptr, lens = _inputs(make_paged_kv, prefix, ext, hkv, group, dim, page, dtype, device)
    out = torch.full_like(q, float("nan"))
    extend_attention(q, k, v, table, indptr, lens, dim**-0.5, max(ext), out=out)
    check(out, extend_attention_ref(q, k, v, table, indptr, lens, dim**-0.5))


def test_extend_is_causal(make_paged_kv, device):
    """Changing a later new token's K/V must not change earlier queries' outputs."""
    q, k, v, table, indptr, lens = _inputs(make_paged_kv, [5], [8], 1, 2, 64, 16, F32, device)
    before = extend_attention(q, k, v, table, indptr, lens, 0.125, 8)
    last = int(table[0, 12 // 16]) * 16 + 12 % 16  # slot of position 12, the last new token
    k.view(-1, 1, 64)[last] += 3.0
    after = extend_attention(q, k, v, table, indptr, lens, 0.125, 8)
    torch.testing.assert_close(before[:7], after[:7], atol=0, rtol=0)
    assert not torch.allclose(before[7], after[7], atol=1e-3)


# (prefix_lens, num_candidates, kv_heads, group, head_dim, page_size, dtype): k+1 queries per request
VERIFY_CASES = [
    ([0, 7, 33], 4, 2, 3, 64, 16, F32),
    ([1, 64], 2, 1, 8, 64, 64, F32),
    ([15, 2, 40, 9], 5, 1, 1, 64, 1, F32),
    ([31, 100], 4, 2, 8, 64, 16, BF16),
]


@pytest.mark.parametrize("prefix,cand,hkv,group,dim,page,dtype", VERIFY_CASES)
def test_verify_matches_reference(make_paged_kv, check, device, prefix, cand, hkv, group, dim, page, dtype):
    ext = [cand] * len(prefix)
    q, k, v, table, indptr, lens = _inputs(make_paged_kv, prefix, ext, hkv, group, dim, page, dtype, device)
    out = torch.full_like(q, float("nan"))
    # A verify is an extend of k+1 candidates per request: max_extend_len = k+1 sizes one tile.
    extend_attention(q, k, v, table, indptr, lens, dim**-0.5, max_extend_len=cand, out=out)
    check(out, extend_attention_ref(q, k, v, table, indptr, lens, dim**-0.5))


def test_verify_equals_sequential_decode(make_paged_kv, device):
    """Candidate i of a verify sees what a decode step at that position would see."""
    prefix, cand = [9, 20], 4
    q, k, v, table, indptr, lens = _inputs(make_paged_kv, prefix, [cand] * 2, 2, 3, 64, 16, F32, device)
    ver = extend_attention(q, k, v, table, indptr, lens, 0.125, max_extend_len=cand)
    for i in range(cand):
        rows = indptr[:-1].long() + i  # candidate i of each request
        step_lens = torch.tensor([p + i + 1 for p in prefix], dtype=torch.int32, device=device)
        dec = decode_attention(q[rows], k, v, table, step_lens, 0.125, max(prefix) + i + 1)
        torch.testing.assert_close(ver[rows], dec, atol=2e-5, rtol=2e-5)


def test_wrapper_rejects_bad_arguments(make_paged_kv, device):
    q, k, v, table, indptr, lens = _inputs(make_paged_kv, [2], [3], 1, 2, 64, 16, F32, device)
    with pytest.raises(ValueError, match=r"\[B \+ 1\]"):
        extend_attention(q, k, v, table, indptr[:1], lens, 0.1, 3)
    with pytest.raises(TypeError, match="qo_indptr"):
        extend_attention(q, k, v, table, indptr.long(), lens, 0.1, 3)
    with pytest.raises(ValueError, match="out"):
        extend_attention(q, k, v, table, indptr, lens, 0.1, 3, out=torch.empty(2, 2, 64, device=device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_extend_large_gpu(make_paged_kv, check, dtype):
    prefix, ext = [0, 1000, 3000, 17], [2048, 513, 1, 700]
    q, k, v, table, indptr, lens = _inputs(make_paged_kv, prefix, ext, 8, 4, 128, 16, dtype, "cuda")
    out = torch.full_like(q, float("nan"))
    extend_attention(q, k, v, table, indptr, lens, 128**-0.5, max(ext), out=out)
    check(out, extend_attention_ref(q, k, v, table, indptr, lens, 128**-0.5))
