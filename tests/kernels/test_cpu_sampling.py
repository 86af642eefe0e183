"""Greedy sampling in C++ (kernels/cpu_sampling.py) against `max(dim=-1).indices`, edge cases included,
and the sampler taking it on CPU."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_sampling

INF, NAN = float("inf"), float("nan")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_sampling.load(), "the pdserve_cpu kernels did not build"


@pytest.mark.parametrize("B,V", [(1, 1), (3, 7), (5, 16), (4, 17), (2, 100), (64, 49152)])
def test_random_rows_match_torch(B, V):
    x = torch.randn(B, V, generator=torch.Generator().manual_seed(B * V))
    assert torch.equal(cpu_sampling.greedy(x), cpu_sampling.greedy_ref(x))


def _row(V: int, **at: float) -> torch.Tensor:
    r = torch.randn(V, generator=torch.Generator().manual_seed(V))
    for k, v in at.items():
        r[int(k[1:])] = v
    return r


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(_row(49152, i100=1e9, i40000=1e9), id="tie-first-wins"),
        pytest.param(torch.full((49152,), -INF), id="all-minus-inf"),
        pytest.param(_row(49152, i777=NAN, i30000=NAN), id="first-nan"),
        pytest.param(_row(49152, i49151=1e9), id="last-element"),
        pytest.param(_row(49152, i3=INF, i4=INF), id="two-infs"),
        pytest.param(_row(20, i18=NAN), id="nan-in-tail"),
        pytest.param(_row(20, i17=1e9, i19=1e9), id="tie-in-tail"),
        pytest.param(_row(33, i5=7.0, i21=7.0, i32=7.0), id="tie-across-lanes"),
    ],
)
def test_edge_rows_match_torch(row):
    x = torch.stack([row, row.flip(0)])
    assert torch.equal(cpu_sampling.greedy(x), cpu_sampling.greedy_ref(x))


def test_a_strided_view_and_bad_input():
    x = torch.randn(8, 300)[:, ::3]
    assert torch.equal(cpu_sampling.greedy(x), cpu_sampling.greedy_ref(x))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_sampling.greedy(torch.randn(2, 5, dtype=torch.bfloat16))


def test_the_sampler_takes_it_on_cpu():
    from torch.profiler import profile

    from pdserve.runtime.sampler import _greedy

    x = torch.randn(4, 1000)
    with profile() as prof:
        got = _greedy(x)
    assert "pdserve_cpu::greedy" in {e.key for e in prof.key_averages()}
    assert torch.equal(got, x.argmax(dim=-1))
