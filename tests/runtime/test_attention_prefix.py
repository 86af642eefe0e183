"""The torch backend's extend over a cached prefix: the split form (prefix and new part through the flash
kernel, merged by log-sum-exp) and the masked form against a float64 softmax over the pool's keys."""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime.attention import TorchAttention
from pdserve.runtime.batch import ForwardBatch, ForwardMode
from pdserve.runtime.kv_pool import KVGeometry, KVPool

F32, BF16 = torch.float32, torch.bfloat16
TOL = {F32: 2e-5, BF16: 3e-2}


def _attend(att, cached, new, hkv, group, dim, dtype, seed=0):
    """One prompt of `cached` + `new` tokens on scattered pages: (backend output, float64 reference)."""
    g = torch.Generator().manual_seed(seed)
    page = 16
    geo = KVGeometry(num_layers=2, kv_heads=hkv, head_dim=dim, page_size=page, dtype=dtype)
    pages = -(-(cached + new) // page)
    table = torch.randperm(pages + 5, generator=g)[:pages].tolist()
    batch = ForwardBatch.build(ForwardMode.EXTEND, [list(range(new))], [cached], [table], page)
    pool = KVPool(geo, pages + 5)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g).to(dtype))
    q = torch.randn(new, hkv * group, dim, generator=g).to(dtype)
    k = torch.randn(new, hkv, dim, generator=g).to(dtype)
    v = torch.randn(new, hkv, dim, generator=g).to(dtype)
    layer, scale = 1, dim**-0.5
    att.prepare(batch, pool)
    out = att.forward(q, k, v, layer, pool, scale)

    rows = pool.key_rows(batch.page_table, cached + new)
    keys = pool.rows()[rows + pool.row_offset(layer, 0)].double().repeat_interleave(group, 1)
    vals = pool.rows()[rows + pool.row_offset(layer, 1)].double().repeat_interleave(group, 1)
    assert torch.equal(keys[cached:, ::group].to(dtype), k), "forward stores the new K first"
    s = torch.einsum("nhd,khd->hnk", q.double(), keys) * scale  # [H, new, cached + new]
    visible = torch.arange(cached + new)[None] <= cached + torch.arange(new)[:, None]
    ref = torch.einsum("hnk,khd->nhd", s.masked_fill(~visible, float("-inf")).softmax(-1), vals)
    return out, ref


@pytest.mark.parametrize(
    "cached,new,hkv,group,dim",
    [
        pytest.param(37, 600, 3, 3, 64, id="gqa"),
        pytest.param(600, 600, 1, 8, 32, id="mqa-equal-parts"),
        pytest.param(1, 513, 2, 1, 64, id="one-cached-token"),
    ],
)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_split_and_masked_forms_match_reference(cached, new, hkv, group, dim, dtype):
    split = TorchAttention()
    out, ref = _attend(split, cached, new, hkv, group, dim, dtype)
    assert split._prefix_rows is not None, "a new part this long takes the split form"
    torch.testing.assert_close(out.double(), ref, rtol=TOL[dtype], atol=TOL[dtype])

    masked = TorchAttention()
    masked.split_min_new = 10**9
    out_m, _ = _attend(masked, cached, new, hkv, group, dim, dtype)
    assert masked._prefix_rows is None
    torch.testing.assert_close(out_m.double(), ref, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("cached,new", [(700, 600), (40, 100)])
def test_short_new_part_keeps_the_masked_form(cached, new):
    att = TorchAttention()
    out, ref = _attend(att, cached, new, 2, 3, 64, F32)
    assert att._prefix_rows is None
    torch.testing.assert_close(out.double(), ref, rtol=TOL[F32], atol=TOL[F32])
