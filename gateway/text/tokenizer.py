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
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve import env
from pdserve.gateway.errors import bad_request
from pdserve.model_source import resolve_model_source

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
            hf = _load_gguf_cached(src.gguf_path, src.folder, src.gguf_file)
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


def _cache_root() -> str:
    return os.path.join(env.cache_dir(), "tokenizers")


def _has_entry(cached: str) -> bool:
    return os.path.isfile(os.path.join(cached, "tokenizer_config.json"))


def _load_gguf_cached(gguf_path: str, folder: str, gguf_file: str | None) -> PreTrainedTokenizerBase:
    """Building a tokenizer from GGUF metadata takes seconds; its saved form loads in a fraction.

    The cache key covers the file's path, size and mtime; a cache that cannot be written is skipped.
    transformers reads GGUF metadata only with torch: a process that has not imported torch builds a
    missing (or unreadable) entry in a child process and loads the saved copy without torch.
    """
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[
        :24
    ]
    cached = os.path.join(_cache_root(), key)
    if not _has_entry(cached) and "torch" not in sys.modules:
        _build_in_child(folder, gguf_file, cached)
    if _has_entry(cached):
        try:
            return auto_tokenizer_class().from_pretrained(cached)
        except Exception as e:  # a damaged cache entry: rebuild it
            log.warning("tokenizer cache %s unreadable (%s); rebuilding", cached, e)
            shutil.rmtree(cached, ignore_errors=True)
            if _torch_free:  # this process cannot build it
                _build_in_child(folder, gguf_file, cached)
                return auto_tokenizer_class().from_pretrained(cached)
    return build_cache_entry(folder, gguf_file or "", cached)


def _build_in_child(folder: str, gguf_file: str | None, cached: str) -> None:
    """`build_cache_entry` in a child process (it imports torch; this one need not). Where the child
    fails, it says why in the log and no entry appears."""
    code = "import sys; from pdserve.gateway.text.tokenizer import build_cache_entry; build_cache_entry(*sys.argv[1:])"
    argv = [sys.executable, "-P", "-c", code, folder, gguf_file or "", cached]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("tokenizer not built in a child process: %s", e)
        return
    if r.returncode != 0:
        log.warning("tokenizer not built in a child process: %s", r.stderr.strip()[-2000:])


def build_cache_entry(folder: str, gguf_file: str, cached: str) -> PreTrainedTokenizerBase:
    """The tokenizer built from the GGUF file `gguf_file` in `folder` ("": the folder's own) from its
    metadata (this imports torch), saved as the cache entry `cached` where it can be written."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file or None)
    tmp = None
    try:
        os.makedirs(_cache_root(), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=_cache_root(), prefix=".tmp-")
        hf.save_pretrained(tmp)
        os.replace(tmp, cached)  # atomic: readers never see a half-written entry
    except OSError as e:  # read-only home, or another process won the race
        log.info("tokenizer cache not written (%s)", e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return hf
