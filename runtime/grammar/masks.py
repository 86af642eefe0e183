"""Token masks on logits, where the sampling happens: one bitmask row per constrained logits row.

`apply_grammar_masks` serves one-token steps (the prefill node's first token, the decode node's plain
step): row i is masked by request i's matcher. `fill_verify_masks` serves speculative verification:
a request with k drafts owns k + 1 verify rows, row j predicting the token after drafts[:j]. Its
matcher accepts the drafts one by one, filling each row's mask before each accept, and stops at the
first draft the grammar refuses (that draft can never be accepted: its masked probability is 0, so
the rows after it are never used); then it rolls back every draft it accepted, leaving the matcher
where it was. `Request.append_token` then feeds it the tokens verification actually emitted.

Masked logits are -inf, so every later sampling stage (penalties, temperature, top-k/p, min-p, the
seeded draw, rejection sampling) sees the constrained distribution. Reported logprobs are taken from
the unmasked logits (callers keep a copy when logprobs are asked for): the model's own distribution,
as without a grammar, and never -inf, which JSON cannot carry. Rows without a grammar are
untouched, and a batch without any grammar costs one Python scan of the requests.
"""

from __future__ import annotations

import torch

from pdserve.runtime.grammar.matcher import GrammarMatcher


def _bitmask(rows: int, vocab: int) -> torch.Tensor:
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab)  # [rows, ceil(vocab / 32)] int32, all allowed


def _apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)


def apply_grammar_masks(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> None:
    """Mask logits [B, V] in place: row i to what matchers[i] allows next (None: unconstrained)."""
    rows = [i for i, g in enumerate(matchers) if g is not None]
    if not rows:
        return
    bitmask = _bitmask(logits.shape[0], logits.shape[1])
    for i in rows:
        matchers[i].fill_mask(bitmask, i)  # type: ignore[union-attr]
    _apply(logits, bitmask, rows)


def fill_verify_masks(
    logits: torch.Tensor, matchers: list[GrammarMatcher | None], drafts: list[list[int]]
) -> None:
    """Mask verify logits [sum(k_i + 1), V] in place, request-major; see the module docstring."""
    if all(g is None for g in matchers):
        return
    bitmask = _bitmask(logits.shape[0], logits.shape[1])
    rows: list[int] = []
    start = 0
    for g, d in zip(matchers, drafts, strict=True):
        if g is not None:
            accepted = 0
            for j in range(len(d) + 1):
                g.fill_mask(bitmask, start + j)
                rows.append(start + j)
                if j == len(d) or not g.accept(d[j]):
                    break
                accepted += 1
                if g.is_terminated():  # a drafted stop token: nothing can follow it
                    break
            g.rollback(accepted)
        start += len(d) + 1
    _apply(logits, bitmask, rows)
