"""Paged split-K decode attention against its torch reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.decode_attention import decode_attention, decode_attention_ref

F32, BF16 = torch.float32, torch.bfloat16

# (seq_lens, kv_heads, group, head_dim, page_size, dtype, num_splits): a representative slice of
# batch sizes x ragged lengths (1, off page boundaries) x GQA 1/3/8 x page 1/16/64 x dtypes.
CASES = [
    ([1], 1, 1, 64, 16, F32, None),
    ([1, 17, 40], 2, 3, 64, 16, F32, None),
    ([5, 33], 1, 8, 64, 1, F32, 2),
    ([70, 3, 64, 129, 1], 2, 1, 64, 64, F32, 3),
    ([1, 200], 1, 3, 32, 16, F32, 4),  # the 1-token request leaves 3 splits empty
    ([23, 1, 9], 2, 8, 64, 16, BF16, None),
    ([100, 2], 1, 3, 64, 64, BF16, 2),
    ([1, 31, 16], 1, 1, 64, 1, BF16, 2),
    ([50, 7], 1, 2, 80, 16, F32, 2),  # head_dim not a power of two
]


@pytest.mark.parametrize("seq_lens,hkv,group,dim,page,dtype,splits", CASES)
def test_decode_matches_reference(
    make_paged_kv, check, device, seq_lens, hkv, group, dim, page, dtype, splits
):
    k, v, table = make_paged_kv(seq_lens, page, hkv, dim, dtype, seed=len(seq_lens) + dim)
    B = len(seq_lens)
    q = torch.randn(B, hkv * group, dim, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    got = decode_attention(q, k, v, table, lens, dim**-0.5, max(seq_lens), num_splits=splits, out=out)
    assert got.data_ptr() == out.data_ptr()
    check(out, decode_attention_ref(q, k, v, table, lens, dim**-0.5))


def test_split_count_does_not_change_result(make_paged_kv, device):
    seq_lens = [150, 90]
    k, v, table = make_paged_kv(seq_lens, 16, 1, 64, F32)
    q = torch.randn(2, 3, 64).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    one = decode_attention(q, k, v, table, lens, 0.125, 150, num_splits=1)
    many = decode_attention(q, k, v, table, lens, 0.125, 150, num_splits=5, block_n=16)
    torch.testing.assert_close(one, many, atol=2e-6, rtol=2e-6)
    # and the result depends on the context: dropping the last token changes it
    shorter = decode_attention(q, k, v, table, lens - 1, 0.125, 150)
    assert not torch.allclose(shorter, one, atol=1e-3)


def test_strided_query_view(make_paged_kv, check, device):
    """q as a slice of a fused qkv projection (token stride larger than Hq * D)."""
    k, v, table = make_paged_kv([12, 30], 16, 2, 64, F32)
    qkv = torch.randn(2, (6 + 2 + 2) * 64).to(device)
    q = qkv[:, : 6 * 64].view(2, 6, 64)
    lens = torch.tensor([12, 30], dtype=torch.int32, device=device)
    check(
        decode_attention(q, k, v, table, lens, 0.125, 30), decode_attention_ref(q, k, v, table, lens, 0.125)
    )


def test_wrapper_rejects_bad_arguments(make_paged_kv, device):
    k, v, table = make_paged_kv([4], 16, 2, 64, F32)
    lens = torch.tensor([4], dtype=torch.int32, device=device)
    q = torch.randn(1, 6, 64).to(device)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention(torch.randn(1, 5, 64).to(device), k, v, table, lens, 0.1, 4)
    with pytest.raises(TypeError, match="dtype"):
        decode_attention(q.to(BF16), k, v, table, lens, 0.1, 4)
    with pytest.raises(TypeError, match="page_table"):
        decode_attention(q, k, v, table.long(), lens, 0.1, 4)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(torch.randn(1, 6, 32).to(device), k, v, table, lens, 0.1, 4)
    with pytest.raises(ValueError, match="cannot hold"):
        decode_attention(q, k, v, table, lens, 0.1, 17)
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, table, lens, 0.1, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_decode_large_gpu(make_paged_kv, check, dtype):
    seq_lens = [4096 - 37 * i for i in range(64)]
    k, v, table = make_paged_kv(seq_lens, 16, 8, 128, dtype)
    q = torch.randn(64, 64, 128, device="cuda").to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k, v, table, lens, 128**-0.5, max(seq_lens), out=out)
    check(out, decode_attention_ref(q, k, v, table, lens, 128**-0.5))
