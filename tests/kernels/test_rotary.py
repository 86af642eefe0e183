"""In-place rotary embedding against the torch reference and HF's rotate_half formula."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.rotary import apply_rotary_, apply_rotary_ref

F32, BF16 = torch.float32, torch.bfloat16


def _cache(max_pos: int, dim: int, full: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)  # [max_pos, dim/2]
    if full:
        freqs = torch.cat([freqs, freqs], dim=-1)  # HF layout [max_pos, dim]
    return freqs.cos().to(device), freqs.sin().to(device)


@pytest.mark.parametrize(
    "tokens,hq,hkv,dim,dtype,full",
    [
        (1, 4, 4, 64, F32, False),
        (9, 9, 3, 64, F32, True),
        (6, 8, 1, 128, BF16, True),
        (5, 6, 2, 96, BF16, False),
    ],
)
def test_rotary_matches_reference(check, device, tokens, hq, hkv, dim, dtype, full):
    cos, sin = _cache(512, dim, full, device)
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, hq, dim, generator=g).to(dtype).to(device)
    k = torch.randn(tokens, hkv, dim, generator=g).to(dtype).to(device)
    pos = torch.randint(0, 512, (tokens,), generator=g).to(device)
    want_q, want_k = apply_rotary_ref(q, k, cos, sin, pos)
    apply_rotary_(q, k, cos, sin, pos)
    check(q, want_q)
    check(k, want_k)


def test_reference_is_hf_rotate_half(device):
    """The reference equals q * cos + rotate_half(q) * sin with HF's full-width cache."""
    cos, sin = _cache(64, 32, True, device)
    q = torch.randn(5, 2, 32).to(device)
    pos = torch.tensor([0, 3, 63, 7, 7], device=device)
    rotate_half = torch.cat([-q[..., 16:], q[..., :16]], dim=-1)
    hf = q * cos[pos][:, None] + rotate_half * sin[pos][:, None]
    torch.testing.assert_close(apply_rotary_ref(q, q, cos, sin, pos)[0], hf)
    half_cos, half_sin = _cache(64, 32, False, device)
    torch.testing.assert_close(apply_rotary_ref(q, q, half_cos, half_sin, pos)[0], hf)


def test_strided_views_of_fused_qkv(check, device):
    """q and k as views into one qkv buffer, rotated in place; v untouched."""
    cos, sin = _cache(100, 64, False, device)
    qkv = torch.randn(4, (4 + 2 + 2) * 64).to(device)
    before = qkv.clone()
    q = qkv[:, : 4 * 64].view(4, 4, 64)
    k = qkv[:, 4 * 64 : 6 * 64].view(4, 2, 64)
    pos = torch.tensor([1, 50, 2, 99], device=device)
    want_q, want_k = apply_rotary_ref(q, k, cos, sin, pos)
    apply_rotary_(q, k, cos, sin, pos)
    check(q, want_q)
    check(k, want_k)
    torch.testing.assert_close(qkv[:, 6 * 64 :], before[:, 6 * 64 :], atol=0, rtol=0)


def test_wrapper_rejects_bad_arguments(device):
    cos, sin = _cache(10, 64, False, device)
    q, k = torch.randn(2, 2, 64).to(device), torch.randn(2, 1, 64).to(device)
    with pytest.raises(ValueError, match="head_dim/2"):
        apply_rotary_(q, k, cos[:, :16], sin[:, :16], torch.tensor([0, 1], device=device))
    with pytest.raises(TypeError, match="positions"):
        apply_rotary_(q, k, cos, sin, torch.tensor([0.0, 1.0], device=device))
    with pytest.raises(ValueError, match="positions"):
        apply_rotary_(q, k, cos, sin, torch.tensor([0], device=device))
