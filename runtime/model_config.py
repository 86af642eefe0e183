"""The architecture description pdserve's models are built from, read from a Hugging Face config.

One decoder covers the supported families; their differences are flags here, not forks of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# HF `architectures[0]` -> (qkv bias, q/k norm). Mistral is supported without sliding window.
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    context_length: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> ModelSpec:
        archs = getattr(config, "architectures", None) or []
        arch = archs[0] if archs else _arch_from_model_type(getattr(config, "model_type", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "MistralForCausalLM" and getattr(config, "sliding_window", None):
            # Treated as full attention: exact only while the context stays within the window.
            pass
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        if arch.startswith("Llama"):
            qkv_bias = bool(getattr(config, "attention_bias", False))
        heads = config.num_attention_heads
        eos = getattr(config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            context_length=getattr(config, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            eos_token_ids=eos_ids,
        )


def _arch_from_model_type(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }.get(model_type, model_type or "<unknown>")


def rope_inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE type (llama3, linear, yarn...).

    Non-default types are computed by transformers' own functions so scaling rules stay in one place.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if rope_type == "default":
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModelError(f"RoPE type {rope_type!r} is not supported")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv.float(), float(scaling)
