"""Fixtures for cluster tests (the process harness lives in tests/harness.py)."""

from __future__ import annotations

import pytest
from harness import start_up


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A 1 prefill + 1 decode cluster from `pdserve up`, shared by a test module."""
    c = start_up(tmp_path_factory.mktemp("cluster"))
    try:
        c.wait_healthy()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def engine_reference():
    """Greedy token ids from the offline engine (no prefix cache) and from transformers, for prompts as ids."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.config import RuntimeConfig
    from pdserve.model_source import resolve_model_source
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.loader import model_folder
    from pdserve.sampling_params import SamplingParams

    engine = Engine(RuntimeConfig(dtype="float32", max_total_tokens=8192, disable_radix_cache=True))
    folder = model_folder(resolve_model_source(None))  # transformers' own dequantization of the file
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    def run(prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
        params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
        ours = [o.output_ids for o in engine.generate(prompts, params)]
        theirs = []
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)
            theirs.append(out[0, len(p) :].tolist())
        return ours, theirs

    return run


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The weight-update checkpoints: (bundled folder, B: final norm rescaled, bad: that norm one element
    longer) as HF folders (cluster/weights_ckpts.py)."""
    from cluster.weights_ckpts import make_ckpts

    return make_ckpts(tmp_path_factory.mktemp("ckpts"))


@pytest.fixture(scope="module")
def ref_engine():
    """The offline engine on the bundled weights or on checkpoint B (cluster/weights_ckpts.Reference)."""
    from cluster.weights_ckpts import Reference

    return Reference()
