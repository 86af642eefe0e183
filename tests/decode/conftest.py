"""Tiny random Llama checkpoints for the speculative decoding tests (written with save_pretrained)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


def write_tiny_llama(folder: str, vocab: int, seed: int, hidden: int = 32, sharpness: float = 1.0) -> str:
    """A random 2-layer Llama; `sharpness` scales the output head (larger: peakier next-token distributions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.randn_like(emb))
        head = model.lm_head.weight
        head.copy_(torch.randn_like(head) * sharpness / hidden**0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama() -> Callable[..., str]:
    return write_tiny_llama
