"""Tiny random checkpoints of every supported family, for tests and for the GPU check.

They cover each family's distinguishing feature (llama3 RoPE scaling, untied head, Qwen2 qkv bias,
Qwen3 q/k norm with an explicit head_dim), all with GQA ratio > 1, and are written with
`save_pretrained`, so pdserve's loader reads them exactly as it reads real ones.
"""

from __future__ import annotations

import torch

# name -> (config class name, config kwargs)
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama3-rope-tied": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "llama-untied": (
        "LlamaConfig",
        dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "qwen2-bias": (
        "Qwen2Config",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "qwen3-qknorm": (
        "Qwen3Config",
        # head_dim 32 != hidden / heads (16): the explicit head_dim must be honoured.
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
}

TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random, so a tensor the loader drops or misplaces changes the logits.

    (HF initializes biases to zero and norms to one, which would hide such bugs.)
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(1.0 + noise if "norm" in name else noise * 2.0 if p.dim() == 1 else noise)


def write_tiny_checkpoint(name: str, folder: str, seed: int = 0) -> str:
    import transformers

    cls_name, kwargs = TINY_CONFIGS[name]
    config = getattr(transformers, cls_name)(**TINY_COMMON, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


SHAPED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_shaped_checkpoint(like: str, folder: str, seed: int = 0) -> str:
    """A checkpoint of `like`'s architecture and tokenizer with transformers' random initialisation,
    in bf16: what the GPU check serves where the real weights cannot travel. Only `like`'s config and
    tokenizer files (SHAPED_FILES) are read."""
    import shutil
    from pathlib import Path

    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(like)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    for name in SHAPED_FILES[1:]:
        if (Path(like) / name).is_file():
            shutil.copy(Path(like) / name, Path(folder) / name)
    return folder
