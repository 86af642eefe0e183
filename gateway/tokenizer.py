"""The model's tokenizer as the gateway uses it: prompts in, token text out.

Only the tokenizer is loaded (transformers, no model weights). The chat template is rendered to
text and then encoded without adding special tokens again: the template already holds them, and
this matches `apply_chat_template(..., tokenize=True)` token for token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.model_source import resolve_model_source

log = logging.getLogger(__name__)


@dataclass
class Tokenizer:
    """A thin, typed wrapper over a transformers tokenizer."""

    hf: object  # transformers PreTrainedTokenizerBase

    @classmethod
    def load(cls, model_path: str | None) -> Tokenizer:
        from transformers import AutoTokenizer  # heavy import, kept out of module import time

        src = resolve_model_source(model_path)
        hf = AutoTokenizer.from_pretrained(src.folder, gguf_file=src.gguf_file)
        log.info("tokenizer loaded from %s (vocab %d)", src.gguf_path or src.folder, len(hf))
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        """A raw prompt, with whatever special tokens the tokenizer adds by itself (as SGLang)."""
        return list(self.hf.encode(text))

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.hf.encode(self.chat_prompt(messages), add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text as OpenAI logprobs show it (bytes of a partial character become U+FFFD)."""
        return self.hf.decode([token_id], skip_special_tokens=False)
