"""The weight-only int8 GEMM against its torch reference (and against torch's CPU int8 kernel)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.int8_gemm import int8_weight_only_mm, int8_weight_only_mm_ref

F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    "m,n,k,dtype", [(1, 64, 64, F32), (5, 96, 160, F32), (17, 130, 64, BF16), (3, 64, 96, BF16)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(check, device, m, n, k, dtype, with_bias):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(device)
    s = (torch.rand(n, generator=g) * 0.02 + 0.001).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if with_bias else None
    got = int8_weight_only_mm(x, q, s, b)
    assert got.dtype == dtype and got.shape == (m, n)
    check(got, int8_weight_only_mm_ref(x, q, s, b))
    if device.type == "cpu" and not with_bias:  # a second opinion: torch's own int8 weight-only kernel
        check(got, torch.ops.aten._weight_int8pack_mm(x, q, s))


def test_rejects_bad_arguments(device):
    x = torch.randn(2, 64).to(device)
    q = torch.zeros(32, 64, dtype=torch.int8).to(device)
    s = torch.ones(32).to(device)
    with pytest.raises(TypeError, match="qweight"):
        int8_weight_only_mm(x, q.float(), s)
    with pytest.raises(ValueError, match="qweight"):
        int8_weight_only_mm(x, q[:, :32], s)
    with pytest.raises(ValueError, match="scale"):
        int8_weight_only_mm(x, q, s[:16])
