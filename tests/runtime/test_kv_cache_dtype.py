"""--kv-cache-dtype: the KV pool in another dtype than the model computes in (runtime/runner.py
`kv_cache_dtype`): auto halves the pool of a quantized float32 model on CPU, and a step over the half pool
gives the float32 pool's tokens, its log-probabilities within the rounding of the keys and values."""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime.kv_sizing import kv_cache_dtype
from pdserve.runtime.loader import load_model
from pdserve.sampling_params import SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_w4(tiny_folders):
    return load_model(tiny_folders["llama-untied"], dtype="float32", device="cpu", quantization="w4a16")


def test_auto_halves_only_a_quantized_float32_model(tiny_w4, tiny_folders) -> None:
    assert kv_cache_dtype("auto", tiny_w4, CPU) == (
        torch.float16,
        "auto: float16 for a quantized float32 model on CPU",
    )
    # an unquantized float32 model is the exactness reference: its pool stays float32
    exact = load_model(tiny_folders["llama-untied"], dtype="float32", device="cpu")
    assert kv_cache_dtype("auto", exact, CPU) == (torch.float32, "auto: the model's dtype")
    assert kv_cache_dtype("bfloat16", exact, CPU) == (torch.bfloat16, "asked")
    assert kv_cache_dtype("float32", tiny_w4, CPU) == (torch.float32, "asked")
    with pytest.raises(ValueError, match="only CPU workers"):
        kv_cache_dtype("float16", exact, torch.device("meta"))
    with pytest.raises(ValueError, match="choose auto"):
        kv_cache_dtype("fp8", exact, CPU)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_half_pool_gives_the_float32_pool_tokens(tiny_w4, make_engine, backend) -> None:
    half = make_engine(tiny_w4, attention_backend=backend)
    full = make_engine(tiny_w4, attention_backend=backend, kv_cache_dtype="float32")
    assert half.runner.pool.kv.dtype == torch.float16 and full.runner.pool.kv.dtype == torch.float32
    assert half.runner.geometry.bytes_per_token * 2 == full.runner.geometry.bytes_per_token
    # the fingerprint carries the pool's dtype: a decode worker with another pool refuses the KV
    assert half.runner.fingerprint()["kv_dtype"] == "float16"
    prompts = [[5, 17, 99, 3, 42, 8] * k for k in (1, 3, 7)]
    params = SamplingParams(
        max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs_num=2
    )
    got = half.generate(prompts, params)
    want = full.generate(prompts, params)
    agreed = [_agreed_steps(a, b, tol=2e-2) for a, b in zip(got, want)]
    # a random tiny model has near-ties; most steps must still agree
    assert sum(agreed) >= 0.75 * sum(len(b.output_ids) for b in want), agreed


def _agreed_steps(a, b, tol: float) -> int:
    """Steps on which the half pool gave the float32 pool's token, with its log-probability within
    `tol`; a first different token is allowed only where the float32 pool's top two were within
    `tol` of each other (a tie under the keys' rounding), and ends the comparison."""
    for t, (x, y) in enumerate(zip(a.output_ids, b.output_ids)):
        if x != y:
            (_, first), (_, second) = b.output_top_logprobs[t][:2]
            assert first - second < tol, (t, x, y, b.output_top_logprobs[t])
            return t
        assert abs(a.output_logprobs[t] - b.output_logprobs[t]) < tol, t
    return len(b.output_ids)
