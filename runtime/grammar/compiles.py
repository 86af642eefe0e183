"""A worker's grammar compiles: the backend, built at the first constrained request (loading the
tokenizer is seconds that an unconstrained worker never pays), and each request's compile on its pool.

The runner (runtime/runner.py) holds one `GrammarCompiles`; workers take the Future (`future`), the
offline engine waits for a matcher (`matcher`).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from pdserve.runtime.grammar.backend import (
    CompileTimeout,
    GrammarBackend,
    InvalidGrammar,
    make_grammar_backend,
)
from pdserve.runtime.grammar.matcher import GrammarMatcher
from pdserve.runtime.model_config import ModelSpec
from pdserve.sampling_params import SamplingParams


class GrammarCompiles:
    def __init__(self, backend: str, timeout_s: float, folder: str, spec: ModelSpec) -> None:
        """`backend`: --grammar-backend; `timeout_s`: --grammar-compile-timeout; `folder`: the model's,
        whose tokenizer the grammars compile for."""
        self.backend_name, self.timeout_s = backend, timeout_s
        self.folder, self.spec = folder, spec
        self._backend: GrammarBackend | None = None

    def future(self, params: SamplingParams) -> Future[Any] | None:
        """The request's compiled grammar, compiling on the backend's pool (None without a
        constraint); the Future raises InvalidGrammar. Raises InvalidGrammar itself with
        --grammar-backend none."""
        constraint = params.constraint
        if constraint is None:
            return None
        if self._backend is None:
            if self.backend_name == "none":
                raise InvalidGrammar(constraint[0], "structured output is off (--grammar-backend none)")
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(self.folder)
            backend = make_grammar_backend(
                self.backend_name, hf, self.spec.vocab_size, self.spec.eos_token_ids, self.timeout_s
            )
            assert backend is not None
            self._backend = backend
        return self._backend.submit(*constraint)

    def matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """A fresh matcher for the request's output constraint (None without one), waiting for its
        compile (at most --grammar-compile-timeout); raises InvalidGrammar (a ValueError) for one that
        does not compile in time or with --grammar-backend none."""
        future = self.future(params)
        if future is None or params.constraint is None:
            return None
        try:
            compiled = future.result(timeout=self.timeout_s)
        except TimeoutError:
            raise CompileTimeout(params.constraint[0], self.timeout_s) from None
        return GrammarMatcher(compiled, self.spec.vocab_size)
