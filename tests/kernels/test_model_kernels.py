"""Which kernels the model runs: the Triton RMSNorm and rotary on CUDA, torch's ops on CPU.

The kernels themselves are checked against their torch references in test_rmsnorm.py and
test_rotary.py; here the model's dispatch is checked, and on a GPU that the model's greedy output
with the kernels equals its output on CPU.
"""

from __future__ import annotations

import pytest
import torch

import pdserve.kernels.rmsnorm as rmsnorm_mod
import pdserve.kernels.rotary as rotary_mod
from pdserve.runtime.loader import load_model
from pdserve.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 42, 91, 7], [8, 9, 10, 11]]


@pytest.fixture
def kernel_calls(monkeypatch) -> dict[str, int]:
    """Counts calls of the two kernel wrappers (they still run)."""
    calls = {"rms_norm": 0, "apply_rotary_": 0}
    for mod, name in ((rmsnorm_mod, "rms_norm"), (rotary_mod, "apply_rotary_")):
        real = getattr(mod, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(mod, name, counted)
    return calls


def _greedy(make_engine, folder: str, device: str) -> list[list[int]]:
    loaded = load_model(folder, dtype="float32", device=device)
    engine = make_engine(loaded, device=device)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    return [o.output_ids for o in engine.generate(PROMPTS, params)]


def test_cpu_model_runs_torch_ops(tiny_folders, make_engine, kernel_calls):
    assert len(_greedy(make_engine, tiny_folders["qwen3-qknorm"], "cpu")[0]) == 8
    assert kernel_calls == {"rms_norm": 0, "apply_rotary_": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_runs_triton_norm_and_rotary(tiny_folders, make_engine, kernel_calls):
    folder = tiny_folders["qwen3-qknorm"]  # q/k norm too: the norm kernel on [T*H, D] rows
    on_cpu = _greedy(make_engine, folder, "cpu")
    assert kernel_calls == {"rms_norm": 0, "apply_rotary_": 0}
    assert _greedy(make_engine, folder, "cuda") == on_cpu
    assert kernel_calls["rms_norm"] > 0 and kernel_calls["apply_rotary_"] > 0
