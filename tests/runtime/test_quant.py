"""--quantization: each quantized linear against its fp32 reference, a Q4_1 weight kept exactly, bad
flag values refused, and the bundled model generating with each mode close to the fp32 model."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import RuntimeConfig
from pdserve.launch.flag import GENERATE
from pdserve.launch.flags import add_flags
from pdserve.runtime.loader import load_model
from pdserve.runtime.quant import QuantizationError, check_quantization, quantized_linear
from pdserve.runtime.quant_int4 import Int4WeightOnlyLinear, int4_grouped
from pdserve.runtime.quant_int8 import W8A8_MIN_ROWS
from pdserve.runtime.quant_plan import DENSE_MIN_ROWS, DENSE_MIN_ROWS_AMX, a8_multiplies_faster
from pdserve.sampling_params import SamplingParams

MODES = ["w8a16_int8", "w8a8_int8", "w4a16", "w4a8"]
# max |y - x W^T| / max |x W^T| on random Gaussian weights and activations; measured well below:
# int8 per channel ~0.01, int4 in groups of 32 ~0.07-0.10 (bf16 activations add ~0.01).
TOLERANCE = {"w8a16_int8": 0.03, "w8a8_int8": 0.04, "w4a16": 0.2, "w4a8": 0.2}


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dense_from", [DENSE_MIN_ROWS_AMX, DENSE_MIN_ROWS])  # the AMX host's and the others'
def test_quantized_linear_matches_fp32(mode: str, dtype: torch.dtype, dense_from: int) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g)
    b = torch.randn(96, generator=g)
    lin = quantized_linear(w, b, mode, dtype)
    lin.dense_min_rows = dense_from
    # Row counts on both sides of each switch (weight-only kernel, _int_mm, dense copy), and a 3-d input.
    for rows in (1, W8A8_MIN_ROWS - 1, W8A8_MIN_ROWS, dense_from - 1, dense_from, 33):
        x = torch.randn(rows, 128, generator=g)
        ref = x @ w.t() + b
        y = lin(x.to(dtype))
        assert y.dtype == dtype and y.shape == (rows, 96)
        assert _rel_err(y, ref) < TOLERANCE[mode], (mode, dtype, rows)
    x3 = torch.randn(2, 5, 128, generator=g)
    assert lin(x3.to(dtype)).shape == (2, 5, 96)
    # The dense copy holds the same quantized weights as the kernels: a row gets (nearly) the same
    # result in a small batch as in a big one.
    x = torch.randn(dense_from, 128, generator=g).to(dtype)
    few, many = lin(x[:1]), lin(x)[:1]
    exact = mode == "w8a16_int8" and dtype == torch.float32  # the others round activations differently
    assert _rel_err(few, many.float()) < (1e-4 if exact else 0.03)


def test_int4_keeps_a_q4_1_weight_exactly() -> None:
    """A weight made of GGUF Q4_1 blocks (d * q + m, q in 0..15 over 32 values, both ends used) is
    quantized back to the same values: the w4a16 matmul equals the fp32 one up to float rounding."""
    g = torch.Generator().manual_seed(1)
    n, k = 64, 128
    d = torch.rand(n, k // 32, 1, generator=g) * 0.05 + 0.01
    m = -torch.rand(n, k // 32, 1, generator=g)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    w = (q * d + m).reshape(n, k)
    codes, scale, lo = int4_grouped(w, 32)
    back = (codes.reshape(n, k // 32, 32).float() * scale[..., None] + lo[..., None]).reshape(n, k)
    assert (back - w).abs().max() < 1e-6
    x = torch.randn(7, k, generator=g)
    y = Int4WeightOnlyLinear(w, None, torch.float32, 32)(x)
    # The codes are kept exactly; bf16 activations and scales (the kernel's) leave ~1% of rounding.
    ref = x.bfloat16().float() @ w.t()
    assert _rel_err(y, ref) < 0.02


def test_bad_values_refused() -> None:
    with pytest.raises(ValueError, match="--quantization must be one of"):
        RuntimeConfig(quantization="int3")
    with pytest.raises(ValueError, match="--dtype float32 serves the unquantized weights"):
        RuntimeConfig(dtype="float32", quantization="w4a16")
    RuntimeConfig(dtype="bfloat16", quantization="w4a16")  # a valid pair
    with pytest.raises(QuantizationError, match="CPU only"):
        check_quantization("w8a8_int8", torch.device("meta"), torch.bfloat16)
    with pytest.raises(QuantizationError, match="bfloat16 or float32"):
        check_quantization("w4a16", torch.device("cpu"), torch.float16)
    with pytest.raises(QuantizationError, match="unknown --quantization"):
        check_quantization("fp8", torch.device("cpu"), torch.float32)
    import argparse

    parser = argparse.ArgumentParser()
    add_flags(parser, GENERATE)
    assert parser.parse_args(["--quantization", "w4a16"]).quantization == "w4a16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "q4_0"])


# Greedy agreement with fp32 on the bundled model (bf16 activations), 8 chat prompts x 24 tokens, batched:
# decode steps of 8 rows run the few-row kernels (w8a8 through _int_mm), the prompts the dense path;
# the fraction of identical tokens before each output's first difference, averaged. Measured here:
# none (bf16) 0.75, w8a16_int8 0.78, w8a8_int8 0.53, w4a16 0.90 (the bundled Q4_1 weights are kept
# exactly; only bf16 rounding differs). The floors leave about two prompts' worth of margin (one
# prompt diverging at its first token costs 0.125), yet lie far above unrelated text (~0).
AGREEMENT_FLOOR = {"none": 0.5, "w8a16_int8": 0.4, "w8a8_int8": 0.2, "w4a16": 0.5, "w4a8": 0.3}
PROMPTS = [
    "What is the capital of France?",
    "Name four planets of the solar system.",
    "Write a Python function that reverses a string.",
    "Why do cats purr?",
    "What is 17 multiplied by 3?",
    "Describe how a bicycle works.",
    "Give me three tips for learning a new language.",
    "Explain what a prime number is to a child.",
]


@pytest.fixture(scope="module")
def chat_prompts(tokenizer) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


@pytest.fixture(scope="module")
def fp32_outputs(bundled, chat_prompts) -> list[list[int]]:
    from pdserve.runtime.engine import Engine

    eng = Engine(RuntimeConfig(device="cpu", max_total_tokens=2048, attention_backend="torch"), bundled)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    return [o.output_ids for o in eng.generate(chat_prompts, params)]


@pytest.mark.parametrize("mode", ["none", *MODES])
def test_engine_agrees_with_fp32(mode: str, chat_prompts, fp32_outputs, make_engine, tokenizer) -> None:
    loaded = load_model(None, "bfloat16", "cpu", mode)
    assert loaded.quantization == mode
    eng = make_engine(loaded, max_total_tokens=2048)
    assert eng.runner.fingerprint()["quantization"] == mode
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = [o.output_ids for o in eng.generate(chat_prompts, params)]
    prefix = []
    for ref, got in zip(fp32_outputs, outs):
        eq = [a == b for a, b in zip(ref, got)]
        prefix.append((eq.index(False) if False in eq else len(eq)) / len(ref))
    agreement = sum(prefix) / len(prefix)
    assert agreement >= AGREEMENT_FLOOR[mode], (mode, agreement)
    # The capital question is answered right in every mode but w4a8: its first token is a near-tie in
    # fp32 ('The' 25.33 against 'L' 25.24), which int8 activations turn into "L'Etoile, la Marseillaise",
    # the very answer llama-server gives with the same file (the same Q4_1 x Q8_1 arithmetic).
    if mode != "w4a8":
        assert "Paris" in tokenizer.decode(outs[0])


def test_startup_line_names_the_choice() -> None:
    from pdserve.runtime.host import cpu_flags, cpu_has_bf16, startup_line

    line = startup_line(torch.device("cpu"), torch.bfloat16, "w4a16")
    assert "dtype bfloat16" in line and "quantization w4a16" in line
    assert f"bf16 {'yes' if cpu_has_bf16() else 'no'}" in line
    assert cpu_has_bf16() == bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    hint = "runs --dtype bfloat16 faster"
    assert (hint in startup_line(torch.device("cpu"), torch.float32, "none")) == cpu_has_bf16()
    assert hint not in line


def test_auto_serves_a_gguf_in_its_own_quantization(tiny_folders) -> None:
    """The defaults: the bundled Q4_1 GGUF on CPU is served in the host's fastest dtype, as w4a8 where
    that is float32 and the int4 kernel would multiply in fp32 (AVX2), else w4a16; --dtype float32 (the
    exactness reference) and an HF checkpoint get unquantized weights."""
    from pdserve.model_source import resolve_model_source
    from pdserve.runtime.cpu_calibration import matmul_speeds
    from pdserve.runtime.gguf_folder import weight_types
    from pdserve.runtime.loader import resolve_dtype, resolve_quantization

    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if matmul_speeds().bf16_wins else torch.float32)
    assert RuntimeConfig().quantization == "auto" and RuntimeConfig(dtype="float32").quantization == "auto"
    bundled = resolve_model_source(None)
    assert weight_types(bundled) == {"Q4_1": 210}  # every projection of the 30 layers
    mode, why = resolve_quantization("auto", "auto", cpu, bundled)
    a8 = resolve_dtype("auto", cpu) == torch.float32 and a8_multiplies_faster()
    assert (mode, why.startswith("the GGUF's Q4_1 weights")) == ("w4a8" if a8 else "w4a16", True)
    assert resolve_quantization("auto", "float32", cpu, bundled)[0] == "none"
    assert resolve_quantization("auto", "float16", cpu, bundled)[0] == "none"
    assert resolve_quantization("auto", "auto", torch.device("meta"), bundled)[0] == "none"
    assert resolve_quantization("w8a8_int8", "auto", cpu, bundled) == ("w8a8_int8", "asked")
    hf = resolve_model_source(tiny_folders["llama-untied"])
    assert resolve_quantization("auto", "auto", cpu, hf)[0] == "none"
    loaded = load_model(None)  # every default
    assert loaded.quantization == mode and loaded.dtype == resolve_dtype("auto", cpu)
    assert load_model(None, "float32").quantization == "none"


def test_a_tied_embedding_reads_the_heads_int8_codes(tiny_folders) -> None:
    """Where the int8 head keeps no dense copy, a tied model's embedding is the head's codes: each row
    is q * scale, exactly the weights the head multiplies by, and the float table is gone."""
    from pdserve.runtime.quant_int8 import PackedInt8Embedding, int8_per_channel
    from pdserve.runtime.quant_plan import dense_plan

    loaded = load_model(tiny_folders["llama3-rope-tied"], dtype="float32", quantization="w4a16")
    model = loaded.model
    emb = model.model.embed_tokens
    if dense_plan().keep or model.lm_head_quant.packed is None:
        assert isinstance(emb, torch.nn.Embedding)
        pytest.skip("this host keeps dense copies: the float table stays")
    assert isinstance(emb, PackedInt8Embedding) and emb.packed is model.lm_head_quant.packed
    reference = load_model(tiny_folders["llama3-rope-tied"], dtype="float32").model.model.embed_tokens.weight
    q, scale = int8_per_channel(reference)
    ids = torch.tensor([[0, 5, 17], [reference.shape[0] - 1, 3, 3]])
    assert torch.equal(emb(ids), (q.float() * scale[:, None])[ids])
    assert torch.equal(emb.weight, q.float() * scale[:, None])
