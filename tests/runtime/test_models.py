"""Our decoder against transformers: same logits, prompt by prompt, from one batched extend forward."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.gpu_parity import extend_logits
from pdserve.runtime.loader import load_model

REL_TOL = 1e-4  # max |ours - ref| / max |ref|
TINY_NAMES = ["llama3-rope-tied", "llama-untied", "qwen2-bias", "qwen3-qknorm"]


def hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()  # [len, V]


def assert_close_to_ref(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, what
    rel = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert rel < REL_TOL, f"{what}: max|diff| / max|ref| = {rel:.2e}"


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_bundled_model_matches_transformers(bundled, hf_bundled, tokenizer):
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        "Hi",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    ]
    prompts = [tokenizer(t).input_ids for t in texts]
    assert len({len(p) for p in prompts}) == len(prompts), "want mixed lengths"
    ours = extend_logits(bundled, prompts, page_size=16)
    for i, p in enumerate(prompts):
        assert_close_to_ref(ours[i], hf_logits(hf_bundled, p), f"prompt {i} ({len(p)} tokens)")


@pytest.mark.parametrize("name", TINY_NAMES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_tiny_models_match_transformers(tiny_folders, name, page_size):
    from transformers import AutoModelForCausalLM

    folder = tiny_folders[name]
    ours = load_model(folder, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = _prompts(ours.spec.vocab_size, [9, 1, 23, 5, 40], seed=TINY_NAMES.index(name))
    logits = extend_logits(ours, prompts, page_size)
    for i, p in enumerate(prompts):
        assert_close_to_ref(logits[i], hf_logits(hf, p), f"{name} prompt {i} ({len(p)} tokens)")


def test_tiny_specs_carry_the_family_features(tiny_folders):
    """Guards the parity test above against configs that silently lost their distinguishing feature."""
    specs = {n: load_model(tiny_folders[n], dtype="float32").spec for n in TINY_NAMES}
    assert specs["qwen2-bias"].qkv_bias and not specs["qwen2-bias"].qk_norm
    assert specs["qwen3-qknorm"].qk_norm and specs["qwen3-qknorm"].head_dim == 32
    assert not specs["llama-untied"].tie_word_embeddings
    assert specs["llama3-rope-tied"].tie_word_embeddings
    assert all(s.num_heads > s.num_kv_heads for s in specs.values())


def test_llama3_rope_scaling_is_applied(tiny_folders):
    """llama3 scaling changes low frequencies: our logits equal transformers' on prompts longer than
    original_max_position_embeddings (32), where default RoPE would give different ones."""
    from transformers import AutoModelForCausalLM

    from pdserve.runtime.loader import load_hf_config

    folder = tiny_folders["llama3-rope-tied"]
    assert load_hf_config(folder).rope_parameters["original_max_position_embeddings"] == 32
    ours = load_model(folder, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = _prompts(ours.spec.vocab_size, [33, 64, 120], seed=7)
    logits = extend_logits(ours, prompts, page_size=4)
    for i, p in enumerate(prompts):
        assert_close_to_ref(logits[i], hf_logits(hf, p), f"prompt {i} ({len(p)} tokens)")
