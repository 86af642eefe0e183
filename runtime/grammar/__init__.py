"""Structured output: grammars (JSON schema, regex, EBNF) compiled for the model's tokenizer, and the
token masks that keep sampling inside them. See `backend.py` for the design, `waits.py` for how a
worker's request waits for its compile."""

from pdserve.runtime.grammar.backend import (
    GRAMMAR_BACKENDS,
    CompileStats,
    CompileTimeout,
    GrammarBackend,
    InvalidGrammar,
    make_grammar_backend,
)
from pdserve.runtime.grammar.masks import apply_grammar_masks, fill_verify_masks
from pdserve.runtime.grammar.matcher import DEAD_END, GrammarMatcher
from pdserve.runtime.grammar.waits import GrammarWaits

__all__ = [
    "DEAD_END",
    "GRAMMAR_BACKENDS",
    "CompileStats",
    "CompileTimeout",
    "GrammarBackend",
    "GrammarMatcher",
    "GrammarWaits",
    "InvalidGrammar",
    "apply_grammar_masks",
    "fill_verify_masks",
    "make_grammar_backend",
]
