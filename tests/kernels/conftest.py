"""Kernel tests run the Triton kernels on CPU through Triton's interpreter when there is no GPU.

Triton reads TRITON_INTERPRET when `import triton` builds its language library and when each
`@triton.jit` runs (a kernel module's import), so it must be set before triton is first imported.
If something collected earlier imported triton already, the kernels stay compiled-for-GPU and the
wrappers raise a clear error on CPU tensors; setting TRITON_INTERPRET=1 in the environment (or in
a top-level conftest) avoids that.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        warnings.warn(
            "triton was imported before TRITON_INTERPRET=1 could be set: kernel tests will fail on CPU",
            stacklevel=1,
        )
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# bf16 on the interpreter: fp32 -> bf16 conversions truncate instead of rounding to nearest,
# so even pure data movement with a cast can differ from torch by one ulp.
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert not torch.isnan(actual).any(), "output has NaN: an element was not written (or read poison)"
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[expected.dtype])


def paged_kv(
    seq_lens: list[int], page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A scrambled paged cache holding random K/V for every request's first seq_len tokens.

    Returns k_cache, v_cache [num_pages, page_size, Hkv, D] and page_table [B, max_pages] int32.
    Every slot no request owns, including page 0 (which pads short page-table rows, as in
    ForwardBatch), is NaN: a kernel that reads past a request's context produces NaN.
    """
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page_size) for n in seq_lens]
    num_pages = 1 + sum(pages_per) + 2
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    k = torch.randn((num_pages, page_size, kv_heads, head_dim), generator=g).to(dtype)
    v = torch.randn((num_pages, page_size, kv_heads, head_dim), generator=g).to(dtype)
    owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
    table = torch.zeros((len(seq_lens), max(pages_per)), dtype=torch.int32)
    for b, (n, np_) in enumerate(zip(seq_lens, pages_per)):
        pages = [perm.pop() for _ in range(np_)]
        table[b, :np_] = torch.tensor(pages, dtype=torch.int32)
        for i in range(n):
            owned[pages[i // page_size] * page_size + i % page_size] = True
    k.view(-1, kv_heads, head_dim)[~owned] = float("nan")
    v.view(-1, kv_heads, head_dim)[~owned] = float("nan")
    return k.to(DEVICE), v.to(DEVICE), table.to(DEVICE)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def make_paged_kv():
    return paged_kv


@pytest.fixture
def check():
    return assert_close
