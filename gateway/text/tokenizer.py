"""The model's tokenizer as the gateway uses it: prompts in, token text out.

Only the tokenizer is loaded (transformers, no model weights). The chat template is rendered to
text and then encoded without adding special tokens again: the template already holds them, and
this matches `apply_chat_template(..., tokenize=True)` token for token.

transformers imports torch as soon as it is imported, wherever torch is installed (its configuration
module does, for RoPE helpers), though a tokenizer never uses it: about 150 MB of a gateway's memory.
`auto_tokenizer_class` imports transformers while torch reads as absent, so that it settles on its
tokenizers-only mode; torch is importable again right after, for whatever needs it later (xgrammar,
at the first structured-output request).
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.gateway.errors import bad_request
from pdserve.model_source import ModelSource, resolve_model_source
from pdserve.runtime import gguf_folder

if TYPE_CHECKING:
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass
class Tokenizer:
    """A thin, typed wrapper over a transformers tokenizer."""

    hf: PreTrainedTokenizerBase

    @classmethod
    def load(cls, model_path: str | None) -> Tokenizer:
        src = resolve_model_source(model_path)
        hf: PreTrainedTokenizerBase
        if src.gguf_path is None:
            # transformers: a heavy import, kept out of module import time.
            hf = auto_tokenizer_class().from_pretrained(src.folder)
        else:
            hf = _load_gguf_cached(src)
        log.info("tokenizer loaded from %s (vocab %d)", src.gguf_path or src.folder, len(hf))
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.hf.eos_token_id
        return eos if isinstance(eos, int) else None

    def encode(self, text: str, max_tokens: int | None = None, param: str = "prompt") -> list[int]:
        """A raw prompt, with whatever special tokens the tokenizer adds by itself (as SGLang).
        `max_tokens`: refuse at once a text too long to fit in that many tokens (`check_chars`)."""
        self.check_chars(text, max_tokens, param)
        return list(self.hf.encode(text))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: the longest token string (byte-level tokens
        have one character per byte, so at least as many as the text it decodes to)."""
        vocab = self.hf.get_vocab()
        return max(len(t) for t in list(vocab) + list(self.hf.all_special_tokens))

    def check_chars(self, text: str, max_tokens: int | None, param: str) -> None:
        """A text of more than `max_tokens x max_token_chars` characters cannot encode to `max_tokens`
        tokens or fewer: a 400 before any time is spent tokenizing it."""
        if max_tokens is not None and len(text) > max_tokens * self.max_token_chars:
            raise bad_request(
                f"the prompt has {len(text)} characters, more than {max_tokens} tokens (the context "
                f"length) can hold with this tokenizer ({self.max_token_chars} characters per token at most)",
                param,
            )

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text; `template_kwargs` become variables of the template (e.g. enable_thinking)."""
        text = self.hf.apply_chat_template(
            messages,
            tools=[*tools] if tools is not None else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(template_kwargs or {}),
        )
        assert isinstance(text, str)  # tokenize=False: the rendered text
        return text

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> list[int]:
        text = self.chat_prompt(messages, tools, template_kwargs)
        self.check_chars(text, max_tokens, "messages")
        return self.encode_rendered(text)

    def encode_rendered(self, text: str) -> list[int]:
        """A prompt the chat template rendered: it holds its special tokens already."""
        return list(self.hf.encode(text, add_special_tokens=False))

    @functools.cached_property
    def template_supports_tools(self) -> bool:
        """The chat template reads a `tools` variable (else tools go into the prompt: function_call/prompt.py)."""
        import jinja2
        import jinja2.meta

        template = self.hf.chat_template
        if not isinstance(template, str):
            return False
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))

    def is_special(self, text: str) -> bool:
        """`text` is one special token (decoding skips it unless asked not to)."""
        return text in set(self.hf.all_special_tokens) or text in {
            t.content for t in self.hf.added_tokens_decoder.values() if t.special
        }

    def token_id(self, text: str) -> int | None:
        """The id of `text` if it is a single token of the vocabulary."""
        ids = self.hf.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)  # one sequence in, one text out
        return text

    def token_text(self, token_id: int) -> str:
        """One token's text as OpenAI logprobs show it (bytes of a partial character become U+FFFD)."""
        text = self.hf.decode([token_id], skip_special_tokens=False)
        assert isinstance(text, str)
        return text


# transformers was imported here without torch (`auto_tokenizer_class`): it cannot read GGUF metadata.
_torch_free = False


def auto_tokenizer_class() -> type[AutoTokenizer]:
    """transformers' AutoTokenizer; where this process has imported neither transformers nor torch yet,
    transformers is imported without torch (module docstring).

    A None entry for torch in sys.modules makes `importlib.util.find_spec("torch")`, transformers' test
    for torch, answer None, and an `import torch` fail as for a missing package; the entry is there
    only while transformers is imported (its answer is cached), and so is the variable that silences
    its advice that PyTorch was not found. Tokenizers load and encode the same either way; only
    building one from GGUF metadata needs torch (`_load_gguf_cached` does that in a child process)."""
    global _torch_free
    if "transformers" in sys.modules or "torch" in sys.modules:
        from transformers import AutoTokenizer as auto

        return auto
    advice = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    sys.modules["torch"] = None  # type: ignore[assignment]
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    try:
        from transformers import AutoTokenizer as auto

        _torch_free = True
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
        if advice is None:
            del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = advice
    return auto


def _load_gguf_cached(source: ModelSource) -> PreTrainedTokenizerBase:
    """A GGUF model's tokenizer from its config-and-tokenizer folder in the cache, the one its workers read
    (runtime/gguf_folder.py): building it from the file's metadata takes seconds, so the first process
    that needs it builds it, under that folder's lock, for all (at a cold start the gateway and both
    workers used to build it at once). transformers reads GGUF metadata only with torch: a process that
    has not imported torch builds the folder in a child process and loads the saved copy without torch.
    Where the folder cannot be written (a read-only cache), the tokenizer is built here from the file."""
    folder = gguf_folder.ready_meta_folder(source)
    if folder is None and "torch" not in sys.modules:
        _build_in_child(source)
        folder = gguf_folder.ready_meta_folder(source)
    try:
        folder = folder or gguf_folder.meta_folder(source)
    except OSError as e:
        log.warning("GGUF tokenizer not cached (%s); building it from the file", e)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)
    return auto_tokenizer_class().from_pretrained(folder)


def _build_in_child(source: ModelSource) -> None:
    """`gguf_folder.meta_folder` in a child process (it imports torch; this one need not). Where the child
    fails, it says why in the log and no folder appears."""
    code = (
        "import sys; from pdserve.model_source import ModelSource; from pdserve.runtime.gguf_folder import "
        "meta_folder; meta_folder(ModelSource(*sys.argv[1:]))"
    )
    argv = [sys.executable, "-P", "-c", code, source.folder, source.gguf_file or ""]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("tokenizer not built in a child process: %s", e)
        return
    if r.returncode != 0:
        log.warning("tokenizer not built in a child process: %s", r.stderr.strip()[-2000:])
