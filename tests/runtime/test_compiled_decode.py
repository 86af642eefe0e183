"""The compiled decode step (--enable-torch-compile) against the eager one, in fp32.

Two runners on the same weights, fed the same tokens: every decode step's logits must agree, for a
batch of uneven requests and for a single one, and the steps after the first read the KV the compiled
steps wrote into the pool. Compiling takes a while, so one tiny model covers the features the step
must carry (q/k norm, a head_dim other than hidden / heads, tied embeddings, grouped KV heads).
The compiled step runs each CPU attention path: a gather and SDPA (`torch`) and the C++ paged
kernel (`cpu`); the eager reference is always the torch backend."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.config import RuntimeConfig
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.loader import load_model
from pdserve.runtime.request import Request
from pdserve.runtime.runner import ModelRunner
from pdserve.sampling_params import SamplingParams

MAX_BATCH = 3


@pytest.fixture(scope="module", params=["torch", "cpu"])
def runners(request, tiny_folders):
    loaded = load_model(tiny_folders["qwen3-qknorm"], dtype="float32")
    base = dict(device="cpu", max_total_tokens=1024, page_size=4, max_running_requests=MAX_BATCH)
    eager = ModelRunner(RuntimeConfig(**base, attention_backend="torch"), loaded)
    compiled = ModelRunner(
        RuntimeConfig(**base, attention_backend=request.param, enable_torch_compile=True), loaded
    )
    assert eager.compiled is None and compiled.compiled is not None
    assert compiled.compiled.paged_kernel == (request.param == "cpu")
    compiled.compiled.warm_up()
    return eager, compiled


def _decode_side_by_side(
    eager: ModelRunner, compiled: ModelRunner, prompts: list[list[int]], steps: int
) -> None:
    reqs = {}
    for name, runner in (("eager", eager), ("compiled", compiled)):
        rs = [
            Request(f"{name}{i}", p, SamplingParams(max_new_tokens=steps + 1)) for i, p in enumerate(prompts)
        ]
        for r in rs:
            assert runner.reserve(r, len(r.prompt_ids) + steps + 1)
        runner.forward(ForwardMode.EXTEND, rs, [r.prompt_ids for r in rs])
        reqs[name] = rs
    gen = torch.Generator().manual_seed(len(prompts))
    vocab = eager.spec.vocab_size
    try:
        for step in range(steps):
            toks = [[int(t)] for t in torch.randint(3, vocab, (len(prompts),), generator=gen)]
            ref = eager.forward(ForwardMode.DECODE, reqs["eager"], toks)
            got = compiled.forward(ForwardMode.DECODE, reqs["compiled"], toks)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")
    finally:
        for name, runner in (("eager", eager), ("compiled", compiled)):
            for r in reqs[name]:
                runner.release(r)


def test_compiled_steps_match_eager_for_uneven_batches(runners):
    eager, compiled = runners
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    _decode_side_by_side(eager, compiled, prompts, steps=6)
    _decode_side_by_side(eager, compiled, prompts[:2], steps=3)
    _decode_side_by_side(eager, compiled, prompts[1:2], steps=6)
    assert compiled.compiled.eager_steps == 0, "every step ran a graph compiled at warm-up"


def test_a_step_no_graph_fits_runs_eagerly_and_is_counted(runners):
    """Past warm-up a new shape never stalls the worker for a compilation: the first step of a
    one-token prompt has a single cached key, a size the graphs were not compiled for (dynamic sizes
    start at 2), so it runs the same function eagerly, correctly, and is counted; the next steps fit."""
    eager, compiled = runners
    before = compiled.compiled.eager_steps
    _decode_side_by_side(eager, compiled, [[7]], steps=4)
    assert compiled.compiled.eager_steps == before + 1


def test_inductor_caches_apart_per_cpu_kind(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Code compiled under one instruction set and reused under another gave wrong tokens or aborted:
    each CPU kind (here: the same host capped to AVX2) gets its own cache folder under the user's."""
    from pdserve.kernels import cpu_isa
    from pdserve.runtime.compiled_decode import _inductor_cache_per_cpu

    monkeypatch.setattr(cpu_isa, "host_flags", lambda: frozenset({"avx2", "fma", "avx512f", "amx_bf16"}))
    folders = {}
    for level in ("native", "avx2"):
        monkeypatch.setenv(cpu_isa.ISA_ENV, level)
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        folders[level] = _inductor_cache_per_cpu()
        assert _inductor_cache_per_cpu() == folders[level]  # once in place, left alone
    assert folders["native"] != folders["avx2"]
    assert all(os.path.dirname(f) == str(tmp_path) for f in folders.values())
