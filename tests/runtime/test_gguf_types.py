"""Every GGUF weight type pdserve loads, from a small file this test writes (random weights in a real
file layout, benchmarks/model_writer.py), checked against the file's own dequantized weights as
transformers reads them (the `gguf` package's dequantizers):

- `--dtype float32` (no quantization): pdserve's logits equal transformers' on the same file.
- `--quantization w4a16`: a 4-bit block type (Q4_0, Q4_1, Q4_K) is repacked, not rounded again: every
  projection multiplies by the file's own weights (Q4_K's sub-block scales rounded to fp16 at most);
  a wider type (Q5_K, Q6_K, Q8_0, F16) is rounded to 4 bits in groups of 32, with the error that costs.
  The logits are compared by cosine similarity and top-1 agreement over every position.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_quant_linear

REPACKED = {"q4_0", "q4_1", "q4_k"}
ROUNDED = {"q5_k", "q6_k", "q8_0", "f16"}
PROMPT = [1, 17, 305, 2048, 77, 9000, 4, 12, 640, 31, 123, 8]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[tuple[str, str], str]:
    from pdserve.bench.model_shapes import SHAPES
    from pdserve.bench.model_writer import write_gguf

    root = tmp_path_factory.mktemp("gguf-types")
    out = {}
    for shape in ("tiny", "tiny-qwen2"):
        for quant in sorted(REPACKED | ROUNDED | {"f32", "q4_k_m"}):
            if shape == "tiny-qwen2" and quant not in ("q4_k", "q6_k", "f32"):
                continue
            out[(shape, quant)] = write_gguf(
                str(root / f"{shape}-{quant}.gguf"), SHAPES[shape], quant, seed=3
            )
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> object:
    """One cache folder for the module: each file's config and tokenizer are read once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


def reference(path: str):
    import os

    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def ours(path: str, dtype: str, quantization: str) -> tuple[torch.Tensor, object]:
    from pdserve.bench.gpu_parity import extend_logits
    from pdserve.runtime.loader import load_model

    loaded = load_model(path, dtype, "cpu", quantization, "off")
    return extend_logits(loaded, [PROMPT], page_size=16)[0].float(), loaded


def hf_logits(hf) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0].float()


def agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(the lowest cosine similarity of two positions' logits, the share of positions whose top-1 agrees)."""
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    return cos, top1


@pytest.mark.parametrize(
    ("shape", "quant"),
    [("tiny", q) for q in sorted(REPACKED | ROUNDED | {"f32", "q4_k_m"})]
    + [("tiny-qwen2", q) for q in ("f32", "q4_k", "q6_k")],
)
def test_float32_equals_transformers_on_the_same_file(files, cache, shape, quant) -> None:
    path = files[(shape, quant)]
    logits, loaded = ours(path, "float32", "auto")
    assert loaded.quantization == "none"  # --dtype float32: the exactness reference
    ref = hf_logits(reference(path))
    rel = (logits - ref).abs().max().item() / ref.abs().max().item()
    assert rel < 1e-4, f"{shape} {quant}: max|diff| / max|ref| = {rel:.2e}"


def unpacked(module) -> torch.Tensor:
    """A packed int4 projection's weights [N, K], as its kernel multiplies by them."""
    w_t = torch.empty(module.in_features, module.out_features)
    cpu_quant_linear.int4_unpack_t_(module.packed, w_t)
    return w_t.t()


@pytest.mark.skipif(not cpu_quant_linear.support()[0], reason="no int4 kernel in this host's build")
@pytest.mark.parametrize("quant", sorted(REPACKED | ROUNDED | {"q4_k_m"}))
def test_w4a16_multiplies_by_the_files_own_weights(files, cache, quant) -> None:
    path = files[("tiny", quant)]
    logits, loaded = ours(path, "float32", "w4a16")
    hf = reference(path)
    state = hf.state_dict()
    layer = loaded.model.model.layers[1]
    for fused, parts in (
        (layer.self_attn.qkv_proj, ["q_proj", "k_proj", "v_proj"]),
        (layer.mlp.down_proj, ["down_proj"]),
    ):
        names = [f"model.layers.1.{'mlp' if p == 'down_proj' else 'self_attn'}.{p}.weight" for p in parts]
        want = torch.cat([state[n] for n in names])
        err = ((unpacked(fused) - want).abs().max() / want.abs().max()).item()
        # repacked: the file's codes and scales; Q4_K's scales (d x a 6-bit integer) rounded to fp16
        bound = {"q4_0": 1e-6, "q4_1": 1e-6, "q4_k": 4e-3}.get(quant, 0.1)
        assert err < bound, f"{quant} {names}: max rel error {err:.2e}"
    cos, top1 = agreement(logits, hf_logits(hf))
    assert cos > (0.999 if quant in REPACKED else 0.98), f"{quant}: cosine {cos:.4f}, top-1 {top1:.2f}"


def test_q4_k_m_defaults_load_and_run(files, cache) -> None:
    """The quantization most GGUF files on the hubs use, with every default: 4-bit kernels, not 8-bit."""
    logits, loaded = ours(files[("tiny", "q4_k_m")], "auto", "auto")
    if loaded.dtype != torch.float32 or cpu_quant_linear.support()[0]:
        assert loaded.quantization in ("w4a16", "w4a8"), loaded.quantization
    assert torch.isfinite(logits).all()
