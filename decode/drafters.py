"""Draft proposers for speculative decoding, behind one small interface.

- `NgramDrafter` (NGRAM): prompt lookup. The request's own prompt + output is indexed incrementally
  (n-gram -> position of the token that followed its latest occurrence); a proposal copies what
  followed the latest earlier occurrence of the longest matching suffix. No model, no device work.
- `DraftModelDrafter` (STANDALONE): a smaller model with the same vocabulary, with its own runner
  and KV pool on the decode node. Its prompt KV is computed here, not transferred: the transfer
  format (and the prefill node) stay independent of the draft model, a prefill node needs no second
  model, and a draft model's prefill costs a small fraction of the target's. The first drafting step
  of a request runs the draft model over the whole prompt in the same batched forward that catches
  the other requests up.

Contract: `propose(reqs, ks)` returns at most `ks[i]` tokens for request i (fewer when it has
nothing to offer). `rollback(reqs)` is called after acceptance, once `req.num_computed` holds the
target's valid KV length, so a drafter with its own KV keeps only positions that still match.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.loader import LoadedModel, load_model
from pdserve.runtime.request import Request
from pdserve.runtime.runner import ModelRunner
from pdserve.runtime.sampling_batch import SamplingBatch

log = logging.getLogger(__name__)

# Salt of the draft model's seeded draws; the verifier uses others (see rejection.py).
DRAFT_SALT = 0x5EED_D4AF


@dataclass
class Drafts:
    tokens: list[list[int]]  # per request, 0..k_i proposed tokens
    # Per request: [k_i, V] float32 distribution each draft was drawn from, or None for a
    # deterministic proposal (q is one-hot at the draft token).
    probs: list[torch.Tensor | None]


class Drafter(Protocol):
    # True when proposing costs no forward pass (the policy then sees what is on offer first).
    free: bool

    def propose(self, reqs: list[Request], ks: list[int]) -> Drafts: ...

    def rollback(self, reqs: list[Request]) -> None: ...

    def forget(self, req: Request) -> None: ...

    def draft_seconds(self, batch_size: int) -> float:
        """Estimated cost of one drafting forward for this batch size (0 for free drafters)."""
        ...


# -- NGRAM ----------------------------------------------------------------------


@dataclass
class _NgramIndex:
    tokens: list[int] = field(default_factory=list)
    # n-gram -> index (into tokens) of the token that followed its latest occurrence
    follow: dict[tuple[int, ...], int] = field(default_factory=dict)


class NgramDrafter:
    """Prompt-lookup drafting with a per-request incremental index: O(max_n) work per new token.

    Matches of `max_n` down to `min_n` tokens; single-token matches (min_n = 1) are nearly always
    available and rarely right, so by default a proposal needs a 2-token match.
    """

    free = True

    def __init__(self, max_n: int = 3, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n, self.min_n = max_n, min_n
        self._index: dict[str, _NgramIndex] = {}

    def _sync(self, req: Request) -> _NgramIndex:
        idx = self._index.get(req.room)
        if idx is None:
            idx = self._index[req.room] = _NgramIndex()
        toks = idx.tokens
        have = len(toks)
        full = len(req.prompt_ids) + len(req.output_ids)
        for t in range(have, full):
            toks.append(
                req.prompt_ids[t] if t < len(req.prompt_ids) else req.output_ids[t - len(req.prompt_ids)]
            )
        # Register the n-grams ending just before each newly known follower position.
        for pos in range(max(have, 1), full):
            for n in range(self.min_n, min(self.max_n, pos) + 1):
                idx.follow[tuple(toks[pos - n : pos])] = pos
        return idx

    def lookup(self, req: Request, k: int) -> list[int]:
        idx = self._sync(req)
        toks = idx.tokens
        L = len(toks)
        if k <= 0:
            return []
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            start = idx.follow.get(tuple(toks[L - n :]))
            # The suffix itself is only registered once its follower exists, so `start < L`.
            if start is None:
                continue
            out: list[int] = []
            for i in range(k):
                j = start + i
                # Past the end, keep copying from the proposal: a periodic pattern continues.
                out.append(toks[j] if j < L else out[j - L])
            return out
        return []

    def propose(self, reqs: list[Request], ks: list[int]) -> Drafts:
        return Drafts([self.lookup(r, k) for r, k in zip(reqs, ks)], [None] * len(reqs))

    def rollback(self, reqs: list[Request]) -> None:
        pass

    def forget(self, req: Request) -> None:
        self._index.pop(req.room, None)

    def draft_seconds(self, batch_size: int) -> float:
        return 0.0


# -- STANDALONE -------------------------------------------------------------------


class DraftModelDrafter:
    """A small draft model run autoregressively for the whole batch: `max(ks)` batched forwards.

    The first forward of a step is an extend that feeds every token the draft KV is missing (the
    whole prompt for a new request; after a step, the accepted tokens it has not seen), the rest
    are single-token decodes for the requests still drafting. Sampled rows draw from the draft's
    own processed distribution q (same sampling parameters) and report it for rejection sampling.
    """

    free = False

    def __init__(self, target: ModelRunner, draft_path: str | None = None, loaded: LoadedModel | None = None):
        cfg = target.cfg
        loaded = loaded or load_model(draft_path, cfg.dtype, str(target.device))
        if loaded.spec.vocab_size != target.spec.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({loaded.spec.vocab_size}) differs from the target's "
                f"({target.spec.vocab_size}); STANDALONE needs the same tokenizer"
            )
        # Its own pool sized in tokens like the target's, so every admitted request fits.
        draft_cfg = replace(
            cfg,
            model_path=draft_path,
            max_total_tokens=target.max_total_tokens,
            context_length=None,
            speculative_algorithm=None,
            # The draft model runs eagerly: compiled, it would compile at its first step, mid-serving.
            enable_torch_compile=False,
            tp_size=1,  # the draft model is small: whole, on rank 0
        )
        self.runner = ModelRunner(draft_cfg, loaded)
        self._shadow: dict[str, Request] = {}
        self._seconds = 0.0  # EMA of one draft forward (decode-shaped)
        self._batch = 0

    def _shadow_of(self, req: Request) -> Request | None:
        s = self._shadow.get(req.room)
        if s is None:
            if req.max_total_tokens > self.runner.context_length:
                return None  # beyond the draft model's context: not drafted
            s = Request(req.room, req.prompt_ids, req.params)
            if not self.runner.reserve(s, req.max_total_tokens):
                return None  # draft pool short: this request is not drafted
            self._shadow[req.room] = s
        return s

    def propose(self, reqs: list[Request], ks: list[int]) -> Drafts:
        tokens: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        active = [i for i, k in enumerate(ks) if k > 0 and self._shadow_of(reqs[i]) is not None]
        first = True
        while active:
            t0 = time.perf_counter()
            shadows = [self._shadow[reqs[i].room] for i in active]
            feed = []
            for i, s in zip(active, shadows):
                r = reqs[i]
                full = r.prompt_ids + r.output_ids + tokens[i]
                feed.append(full[s.num_computed :])  # >= 1 token: the newest is never computed
            mode = ForwardMode.EXTEND if first else ForwardMode.DECODE
            logits = self.runner.forward(mode, shadows, feed)  # [len(active), V]: last row each
            rows = [reqs[i] for i in active]
            new, q = self._sample(rows, [tokens[i] for i in active], logits)
            for j, i in enumerate(active):
                tokens[i].append(new[j])
                if q is not None:
                    qs[i].append(q[j])
            if sum(len(f) for f in feed) <= 2 * len(feed):  # not a draft prefill: a fair sample
                self._observe(len(active), time.perf_counter() - t0)
            first = False
            active = [i for i in active if len(tokens[i]) < ks[i]]
        probs = [torch.stack(q) if q else None for q in qs]
        return Drafts(tokens, probs)

    def _sample(
        self, reqs: list[Request], drafted: list[list[int]], logits: torch.Tensor
    ) -> tuple[list[int], torch.Tensor | None]:
        params = [r.params for r in reqs]
        sb = SamplingBatch.build(params, logits.device)
        if sb.all_greedy and not sb.any_penalty:
            return logits.argmax(dim=-1).tolist(), None  # deliberate sync: drafts feed the next forward
        outs = [r.output_ids + d for r, d in zip(reqs, drafted)]
        sampler = self.runner.sampler
        q = sampler.probs(logits, sb, [r.prompt_ids for r in reqs], outs)  # [B, V]
        steps = [len(o) for o in outs]
        return sampler.draw(q, sb, steps, DRAFT_SALT).tolist(), q

    def _observe(self, batch: int, seconds: float) -> None:
        self._seconds = seconds if self._seconds == 0.0 else 0.9 * self._seconds + 0.1 * seconds
        self._batch = batch

    def rollback(self, reqs: list[Request]) -> None:
        for r in reqs:
            s = self._shadow.get(r.room)
            # Draft KV at positions < the target's valid length holds exactly the accepted tokens.
            if s is not None and s.num_computed > r.num_computed:
                s.num_computed = r.num_computed

    def forget(self, req: Request) -> None:
        s = self._shadow.pop(req.room, None)
        if s is not None:
            self.runner.release(s)

    def draft_seconds(self, batch_size: int) -> float:
        return self._seconds


def make_drafter(target: ModelRunner) -> Drafter:
    algo = target.cfg.speculative_algorithm
    if algo == "NGRAM":
        return NgramDrafter()
    if algo == "STANDALONE":
        if target.cfg.speculative_draft_model_path is None:
            log.warning("STANDALONE without --speculative-draft-model-path: drafting with the bundled model")
        return DraftModelDrafter(target, target.cfg.speculative_draft_model_path)
    raise ValueError(f"unknown speculative algorithm {algo!r}")
