"""Structured output: grammars (JSON schema, regex, EBNF) compiled for the model's tokenizer, and the
token masks that keep sampling inside them. See `backend.py` for the design."""

from pdserve.runtime.grammar.backend import (
    GRAMMAR_BACKENDS,
    CompileStats,
    GrammarBackend,
    InvalidGrammar,
    make_grammar_backend,
)
from pdserve.runtime.grammar.masks import apply_grammar_masks, fill_verify_masks
from pdserve.runtime.grammar.matcher import DEAD_END, GrammarMatcher

__all__ = [
    "DEAD_END",
    "GRAMMAR_BACKENDS",
    "CompileStats",
    "GrammarBackend",
    "GrammarMatcher",
    "InvalidGrammar",
    "apply_grammar_masks",
    "fill_verify_masks",
    "make_grammar_backend",
]
