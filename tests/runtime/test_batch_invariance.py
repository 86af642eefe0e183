"""Batch-invariant decoding (`--deterministic`, runtime/determinism.py) on the bundled model: one greedy
request gives bit-identical log-probabilities, hence tokens, alone, in batches of 3 and 16 mixed
requests, prefilled in chunks, after a prefix-cache hit, through speculative verifies, and resumed from
its prompt plus its first tokens (what a retraction or a migration re-prefills). With the flag off, on
every CPU kind measured, some of these differ (docs/reliability.md); the cap test runs the portable
AVX2 kernels in a child process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.config import RuntimeConfig
from pdserve.decode.stepper import make_stepper
from pdserve.runtime.determinism import DeterminismError, resolve_batch_invariance
from pdserve.runtime.engine import Engine, GenerateOutput
from pdserve.runtime.loader import load_model
from pdserve.sampling_params import SamplingParams

TEXTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Once upon a time",
    "Repeat: apple, banana, cherry, apple, banana, cherry, apple,",
    "In 1492, Columbus",
    "Water boils at",
    "Explain gravity to a child.",
    "My favourite food is",
    "import numpy as np\n",
    "Tell me a joke.",
    "The sun rises in the",
    "How many legs does a spider have?",
    "Translate 'hello' to French:",
    "Roses are red,",
]
TARGET = 1  # the request followed through every situation
NEW = 20
SPLIT = 8  # the resumed request's tokens already produced


def params(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)


def engine(loaded, **kw) -> Engine:
    spec = kw.pop("speculative", False)
    cfg = RuntimeConfig(device="cpu", max_total_tokens=8192, deterministic="on", **kw)
    return Engine(cfg, loaded, make_stepper if spec else None)


def same(o: GenerateOutput, ref: GenerateOutput, skip: int = 0) -> None:
    assert o.output_ids == ref.output_ids[skip:]
    # bit for bit: the same kernels in the same order, not merely close
    assert o.output_logprobs == ref.output_logprobs[skip:]


def check_invariance(loaded, prompts: list[list[int]]) -> None:
    assert loaded.batch_invariant
    plain = engine(loaded, disable_radix_cache=True)
    alone = plain.generate([prompts[TARGET]], params())[0]
    same(plain.generate(prompts[:3], params())[TARGET], alone)
    mixed = [params(n) for n in (5, NEW, 30, 1) * 4]  # other requests finish and leave mid-way
    same(plain.generate(prompts, mixed)[TARGET], alone)
    # the prompt prefilled 3 tokens at a time, in steps shared with the other prompts' chunks
    same(
        engine(loaded, disable_radix_cache=True, chunked_prefill_size=3).generate(prompts[:3], params())[
            TARGET
        ],
        alone,
    )
    # resumed: the prompt plus the first SPLIT tokens prefilled at once, as a retraction or a migration does
    resumed = plain.generate([prompts[TARGET] + alone.output_ids[:SPLIT]], params(NEW - SPLIT))[0]
    same(resumed, alone, SPLIT)
    # a prefix-cache hit: the first request leaves its pages, the second reads them
    cached = engine(loaded, page_size=2)
    cached.generate([prompts[TARGET][:-2]], params(2))
    hit = cached.generate([prompts[TARGET]], params())[0]
    assert hit.cached_tokens > 0
    same(hit, alone)
    # speculative decoding: drafts verified several tokens a forward, the batch mixed
    spec = engine(loaded, disable_radix_cache=True, speculative=True, speculative_algorithm="NGRAM")
    outs = spec.generate(prompts[:6], params())
    assert sum(o.stats.get("spec_num_correct_drafts", 0) for o in outs) > 0  # some drafts were accepted
    same(outs[TARGET], alone)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t).input_ids for t in TEXTS]


@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [
        ("auto", "auto"),
        ("float32", "w4a8"),
        ("float32", "w4a16"),
        ("auto", "w8a16_int8"),
        ("auto", "w8a8_int8"),
    ],
)
def test_one_request_computes_the_same_everywhere(dtype, quantization, prompts) -> None:
    loaded = load_model(None, dtype=dtype, device="cpu", quantization=quantization, deterministic="on")
    # no dense copy is kept: the kernel runs at every row count
    assert all(getattr(m, "dense", None) is None for m in loaded.model.modules())
    check_invariance(loaded, prompts)


def test_portable_kernels_too(tmp_path) -> None:
    """The same checks under PDSERVE_CPU_ISA=avx2 (the AVX2 kernels, as on an AVX2-only EPYC), where
    auto resolves on for the GGUF's own w4a8."""
    env = {**os.environ, "PDSERVE_CPU_ISA": "avx2", "PDSERVE_INVARIANCE_CHILD": "1"}
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "child"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed" in done.stdout


@pytest.mark.skipif(not os.environ.get("PDSERVE_INVARIANCE_CHILD"), reason="run by test_portable_kernels_too")
def test_child_under_the_cap(prompts) -> None:
    loaded = load_model(None, dtype="float32", device="cpu", quantization="w4a8", deterministic="auto")
    assert loaded.batch_invariant, loaded.batch_invariant_why
    check_invariance(loaded, prompts)


def test_on_where_it_cannot_run_is_refused_with_the_reason() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(DeterminismError, match="needs a quantized model"):
        resolve_batch_invariance("on", "none", cpu, "auto")
    with pytest.raises(DeterminismError, match="--attention-backend cpu"):
        resolve_batch_invariance("on", "w4a16", cpu, "torch")
    with pytest.raises(DeterminismError, match="CPU ones"):
        resolve_batch_invariance("on", "w4a16", torch.device("meta"), "auto")
    with pytest.raises(DeterminismError, match="choose auto, on, off"):
        resolve_batch_invariance("yes", "w4a16", cpu, "auto")
    # auto never refuses: it says why it is off
    on, why = resolve_batch_invariance("auto", "none", cpu, "auto")
    assert not on and "quantized" in why
    assert resolve_batch_invariance("off", "w4a8", cpu, "auto") == (False, "--deterministic off")


def test_cli_names_the_problem() -> None:
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "pdserve.cli",
        "generate",
        "hi",
        "--dtype",
        "float32",
        "--deterministic",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "--deterministic on: it needs a quantized model" in done.stderr
