"""One request's position in its grammar: accept tokens, roll them back, fill its token mask.

A matcher is created per request from the shared compiled grammar (backend.py) and lives on the
`Request` (`Request.grammar`). `Request.append_token` feeds it every token the request emits, so it
always sits just after the request's last output token, on the prefill node (for the first token)
and on the decode node (which first accepts the prompt-side first token it received with the KV).
A token it refuses can only come from a dead end (no token was allowed): the request then ends with
finish reason `DEAD_END`. Reaching the grammar's end (its stop token accepted) ends the request like
EOS does.

Masks are bit-packed: int32 words, bit j of word w allowing token 32 * w + j (xgrammar's layout).
"""

from __future__ import annotations

from typing import Any

import torch

DEAD_END = "grammar_dead_end"  # the finish reason type (pdserve/protocol/vocabulary.py DeadEndFinish)


class GrammarMatcher:
    def __init__(self, compiled: Any, vocab_size: int):
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size

    def accept(self, token: int) -> bool:
        """Advance past `token`; False (state unchanged) when the grammar does not allow it here."""
        return bool(self._m.accept_token(token))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative drafts)."""
        if num_tokens > 0:
            self._m.rollback(num_tokens)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] ([rows, ceil(V / 32)] int32, on the CPU)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())
