"""TritonAttention against TorchAttention on the same ForwardBatch and KVPool contents."""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime.attention import TorchAttention, make_attention_backend
from pdserve.runtime.attention_triton import TritonAttention
from pdserve.runtime.batch import ForwardBatch, ForwardMode
from pdserve.runtime.kv_pool import KVGeometry, KVPool

F32, BF16 = torch.float32, torch.bfloat16
LAYERS = 2


def _run_both(device, mode, prefix_lens, extend_lens, kv_heads, group, dim, page, dtype, seed=0, tri=None):
    """Random pool + batch; returns (outputs, pools) of the triton (`tri`, default a new
    TritonAttention) and torch backends, per layer."""
    g = torch.Generator().manual_seed(seed)
    geo = KVGeometry(num_layers=LAYERS, kv_heads=kv_heads, head_dim=dim, page_size=page, dtype=dtype)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_per = [-(-s // page) for s in seq_lens]
    num_pages = sum(pages_per) + 3
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in pages_per]
    new_tokens = [list(range(e)) for e in extend_lens]
    batch = ForwardBatch.build(mode, new_tokens, prefix_lens, tables, page, device=device)

    pool_tri = KVPool(geo, num_pages, device=device)
    # Random cache contents everywhere (prefixes included); both backends start from the same.
    pool_tri.kv.copy_(torch.randn(pool_tri.kv.shape, generator=g).to(dtype))
    pool_ref = KVPool(geo, num_pages, device=device)
    pool_ref.kv.copy_(pool_tri.kv)

    T = batch.num_tokens
    outs = {"triton": [], "torch": []}
    tri, ref = tri or TritonAttention(), TorchAttention()
    tri.prepare(batch, pool_tri)
    ref.prepare(batch, pool_ref)
    for layer in range(LAYERS):
        q = torch.randn(T, kv_heads * group, dim, generator=g).to(dtype).to(device)
        k = torch.randn(T, kv_heads, dim, generator=g).to(dtype).to(device)
        v = torch.randn(T, kv_heads, dim, generator=g).to(dtype).to(device)
        outs["triton"].append(tri.forward(q, k, v, layer, pool_tri, dim**-0.5))
        outs["torch"].append(ref.forward(q, k, v, layer, pool_ref, dim**-0.5))
    return outs, pool_tri, pool_ref


CASES = [
    # mode, prefix_lens, extend_lens, kv_heads, group, head_dim, page_size, dtype
    pytest.param(ForwardMode.EXTEND, [0], [13], 2, 3, 64, 16, F32, id="single-prompt"),
    pytest.param(ForwardMode.EXTEND, [0, 21, 5], [9, 1, 30], 1, 8, 64, 16, F32, id="extend-prefixes"),
    pytest.param(ForwardMode.EXTEND, [64, 3], [17, 2], 2, 1, 64, 64, BF16, id="extend-bf16"),
    pytest.param(ForwardMode.DECODE, [0, 16, 40, 7], [1, 1, 1, 1], 2, 3, 64, 16, F32, id="decode"),
    pytest.param(ForwardMode.DECODE, [130, 1], [1, 1], 1, 8, 64, 1, BF16, id="decode-page1-bf16"),
    pytest.param(ForwardMode.VERIFY, [5, 31, 0], [4, 4, 4], 2, 3, 64, 16, F32, id="verify"),
    pytest.param(ForwardMode.VERIFY, [70, 12], [3, 3], 1, 8, 64, 64, BF16, id="verify-bf16"),
]


@pytest.mark.parametrize("mode,prefix,ext,hkv,group,dim,page,dtype", CASES)
def test_triton_backend_matches_torch(check, device, mode, prefix, ext, hkv, group, dim, page, dtype):
    outs, pool_tri, pool_ref = _run_both(device, mode, prefix, ext, hkv, group, dim, page, dtype)
    for got, want in zip(outs["triton"], outs["torch"]):
        check(got, want)
    # the store wrote the same K/V into the same slots of every layer
    torch.testing.assert_close(pool_tri.kv, pool_ref.kv, atol=0, rtol=0)


def test_factory_builds_triton_backend(check, device):
    """`--attention-backend triton` gives the Triton backend, and it computes what torch computes."""
    backend = make_attention_backend("triton", device)
    assert isinstance(backend, TritonAttention)
    outs, pool_tri, pool_ref = _run_both(
        device, ForwardMode.EXTEND, [0, 5], [7, 3], 2, 2, 64, 16, F32, tri=backend
    )
    for got, want in zip(outs["triton"], outs["torch"]):
        check(got, want)
    torch.testing.assert_close(pool_tri.kv, pool_ref.kv, atol=0, rtol=0)


def test_forward_before_prepare_is_an_error(device):
    geo = KVGeometry(num_layers=1, kv_heads=1, head_dim=64, page_size=16, dtype=F32)
    pool = KVPool(geo, 2, device=device)
    x = torch.randn(1, 1, 64).to(device)
    with pytest.raises(AssertionError, match="prepare"):
        TritonAttention().forward(x, x, x, 0, pool, 0.125)
