"""Speculative batched decoding: draft for every running request, verify all in one forward.

A step: choose how many drafts each request gets (the policy), propose them (the drafter), run one
VERIFY forward of the target over `[last token] + drafts` of every request, accept (rejection.py),
append the accepted run plus the bonus token (stopping at the first token that finishes the
request), and roll `num_computed` back to the KV that is still valid. Pages are reserved for
prompt + max_new_tokens at admission, and drafts are capped by the remaining budget, so verify
never needs new pages; the KV written for rejected candidates is simply overwritten later.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

from pdserve.decode.drafters import Drafter, Drafts, make_drafter
from pdserve.decode.rejection import verify
from pdserve.protocol.records import RequestStats
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.request import Request
from pdserve.runtime.runner import ModelRunner, append_samples


@dataclass
class SpecStats:
    """Per-request counters with SGLang's definitions."""

    verify_ct: int = 0  # steps (verify forwards) the request took part in, k = 0 steps included
    num_proposed_drafts: int = 0
    num_correct_drafts: int = 0  # accepted drafts, bonus tokens excluded
    histogram: list[int] | None = None  # histogram[k]: steps that accepted k drafts

    def as_meta(self) -> RequestStats:
        return RequestStats(
            spec_verify_ct=self.verify_ct,
            spec_num_proposed_drafts=self.num_proposed_drafts,
            spec_num_correct_drafts=self.num_correct_drafts,
            spec_correct_drafts_histogram=list(self.histogram or []),
        )


class CostModel:
    """Seconds of one step as c0 + c1 * T (T: tokens in the target forward), fit online.

    Exponentially weighted least squares; the slope is ridge-regularized toward a prior that
    doubles the fixed cost every `prior_tokens` tokens, so a batch that never varies T (no
    speculation yet) still has a sensible slope.
    """

    def __init__(self, prior_tokens: float, decay: float = 0.97, ridge: float = 2.0):
        self.prior_tokens, self.decay, self.ridge = prior_tokens, decay, ridge
        self._w = self._t = self._y = self._tt = self._ty = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._w = d * self._w + 1.0
        self._t = d * self._t + tokens
        self._y = d * self._y + seconds
        self._tt = d * self._tt + tokens * tokens
        self._ty = d * self._ty + tokens * seconds

    def coefficients(self) -> tuple[float, float]:
        if self._w == 0.0:
            return 1.0, 1.0 / self.prior_tokens
        mt, my = self._t / self._w, self._y / self._w
        var = self._tt / self._w - mt * mt
        cov = self._ty / self._w - mt * my
        prior_slope = my / (mt + self.prior_tokens)
        # Floor: measurement noise must not make extra tokens look free.
        slope = max((cov + self.ridge * prior_slope) / (max(var, 0.0) + self.ridge), 0.1 * prior_slope)
        return max(my - slope * mt, 1e-3 * my), slope


class AdaptivePolicy:
    """Pick each request's number of drafts (0..cap) to maximize expected tokens per second.

    Expected tokens of request i with k drafts: E_i(k) = 1 + a_i + ... + a_i^k, the geometric model
    where each draft is accepted with probability a_i given its predecessors were, plus the bonus.
    A step costs c0 + c1 * T + K * d: T = sum_i (k_i + 1) tokens in the verify forward (the CostModel,
    fit on measured steps), K = max_i k_i draft-model forwards of d seconds each (0 for NGRAM).
    For each K, drafts are handed out greedily by marginal gain a_i^(k_i + 1) while the gain beats
    the current rate times the extra cost c1 (the rate N/C rises with N); the K with the best rate
    wins if it beats plain decoding (all k = 0) by `margin`, else nobody drafts. So speculation
    switches itself off for large batches (the gain must exceed ~B*c1 / (c0 + B*c1)) or low
    acceptance, and model error near break-even does not turn into a slowdown.

    a_i blends the request's exponentially decayed counts (accepted, trials = accepted + 1 if a
    draft was rejected) with the global estimate as a prior of weight `prior_weight` trials. A
    request left without drafts for its probe interval (`probe_every` steps, doubled after each
    probe that accepted nothing, up to `max_probe_every`) is offered drafts at the global rate, so
    a pattern that starts repeating later is noticed while hopeless requests cost next to nothing.
    """

    def __init__(
        self,
        prior_tokens: float,
        decay: float = 0.8,
        prior_weight: float = 2.0,
        probe_every: int = 8,
        max_probe_every: int = 64,
        margin: float = 0.05,
    ):
        self.cost = CostModel(prior_tokens)
        self.decay, self.prior_weight = decay, prior_weight
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.margin = margin
        self._req: dict[str, _RequestAcceptance] = {}
        self._global = (1.0, 2.0)  # accepted, trials: prior rate 0.5

    def _state(self, room: str) -> _RequestAcceptance:
        st = self._req.get(room)
        if st is None:
            st = self._req[room] = _RequestAcceptance(probe_every=self.probe_every)
        return st

    def rate(self, room: str) -> float:
        ga, gt = self._global
        st = self._state(room)
        return min((st.accepted + self.prior_weight * ga / gt) / (st.trials + self.prior_weight), 0.99)

    def choose(self, reqs: list[Request], caps: list[int], draft_seconds: float) -> list[int]:
        c0, c1 = self.cost.coefficients()
        ga, gt = self._global
        rates = []
        for r, cap in zip(reqs, caps):
            st = self._state(r.room)
            st.probing = cap > 0 and st.idle >= st.probe_every
            rates.append(max(self.rate(r.room), ga / gt) if st.probing else self.rate(r.room))
        plain_rate = len(reqs) / (c0 + c1 * len(reqs))
        best_ks, best_rate = [0] * len(reqs), plain_rate
        for K in range(1, max(caps, default=0) + 1):
            ks = [0] * len(reqs)
            tokens = float(len(reqs))
            cost = c0 + c1 * len(reqs) + K * draft_seconds
            # (-gain, request) of each request's next draft
            heap = [(-rates[i], i) for i, cap in enumerate(caps) if min(cap, K) > 0]
            heapq.heapify(heap)
            while heap:
                neg_gain, i = heap[0]
                if -neg_gain * cost <= tokens * c1:
                    break
                heapq.heappop(heap)
                ks[i] += 1
                tokens -= neg_gain
                cost += c1
                if ks[i] < min(caps[i], K):
                    heapq.heappush(heap, (neg_gain * rates[i], i))
            if tokens / cost > best_rate:
                best_ks, best_rate = ks, tokens / cost
        # Model error must not turn into a slowdown: speculate only for a clear predicted win.
        return best_ks if best_rate > plain_rate * (1.0 + self.margin) else [0] * len(reqs)

    def observe(self, forward_tokens: int, seconds: float, outcomes: list[tuple[str, int, int]]) -> None:
        """Record one step: its target-forward size and time, and (room, drafts, accepted) per request."""
        self.cost.observe(forward_tokens, seconds)
        ga, gt = self._global
        for room, k, acc in outcomes:
            st = self._state(room)
            if k == 0:
                st.idle += 1
                continue
            if st.probing:
                st.probe_every = self.probe_every if acc else min(2 * st.probe_every, self.max_probe_every)
            trials = acc + (1 if acc < k else 0)
            st.accepted = self.decay * st.accepted + acc
            st.trials = self.decay * st.trials + trials
            st.idle = 0
            ga, gt = 0.98 * ga + acc, 0.98 * gt + trials
        self._global = (ga, gt)

    def forget(self, room: str) -> None:
        self._req.pop(room, None)


@dataclass
class _RequestAcceptance:
    probe_every: int
    accepted: float = 0.0  # exponentially decayed accepted drafts
    trials: float = 0.0  # ... and trials (accepted + 1 per rejection)
    idle: int = 0  # steps since the request last had drafts
    probing: bool = False  # this step's drafts (if any) are a probe


class FixedPolicy:
    """Always the cap (k = min(num_draft_tokens, remaining budget)): for tests and benchmarks."""

    def choose(self, reqs: list[Request], caps: list[int], draft_seconds: float) -> list[int]:
        return list(caps)

    def observe(self, forward_tokens: int, seconds: float, outcomes: list[tuple[str, int, int]]) -> None:
        pass

    def forget(self, room: str) -> None:
        pass


class SpeculativeStepper:
    """The decode stepper for --speculative-algorithm (see decode/stepper.py for the contract)."""

    def __init__(
        self,
        runner: ModelRunner,
        drafter: Drafter | None = None,
        policy: AdaptivePolicy | FixedPolicy | None = None,
        num_draft_tokens: int | None = None,
    ):
        self.runner = runner
        self.num_draft_tokens = (
            runner.cfg.speculative_num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        )
        self.drafter = drafter or make_drafter(runner)
        # Extra tokens in a forward are cheap on a GPU (memory bound) and not on a CPU.
        self.policy = policy or AdaptivePolicy(prior_tokens=256.0 if runner.device.type == "cuda" else 16.0)
        self._stats: dict[str, SpecStats] = {}

    def step(self, reqs: list[Request]) -> None:
        t_start = time.perf_counter()
        ps = self.runner.page_size
        # Drafts fit the token budget (a run never overshoots max_new_tokens) and the pages held:
        # the verify forward writes KV for positions num_tokens - 1 .. num_tokens - 1 + k.
        caps = [
            max(
                0,
                min(
                    self.num_draft_tokens,
                    r.params.max_new_tokens - len(r.output_ids) - 1,
                    len(r.pages) * ps - r.num_tokens,
                ),
            )
            for r in reqs
        ]
        draft_time = 0.0
        if self.drafter.free:
            offered = self.drafter.propose(reqs, caps)
            ks = self.policy.choose(reqs, [len(t) for t in offered.tokens], 0.0)
            drafts = Drafts([t[:k] for t, k in zip(offered.tokens, ks)], offered.probs)
        else:
            ks = self.policy.choose(reqs, caps, self.drafter.draft_seconds(len(reqs)))
            t0 = time.perf_counter()
            drafts = (
                self.drafter.propose(reqs, ks) if any(ks) else Drafts([[] for _ in reqs], [None] * len(reqs))
            )
            draft_time = time.perf_counter() - t0
        ks = [len(t) for t in drafts.tokens]
        base = [r.num_computed for r in reqs]
        if not any(ks):
            logits = self.runner.forward(ForwardMode.DECODE, reqs, [[r.output_ids[-1]] for r in reqs])
            append_samples(reqs, self.runner.sample(reqs, logits))
            accepted = [0] * len(reqs)
        else:
            feed = [[r.output_ids[-1]] + d for r, d in zip(reqs, drafts.tokens)]
            logits = self.runner.forward(ForwardMode.VERIFY, reqs, feed)  # [sum(k_i + 1), V]
            verdict = verify(self.runner.sampler, reqs, drafts, logits)
            accepted = verdict.num_accepted
            for i, r in enumerate(reqs):
                lps = verdict.logprobs[i] if verdict.logprobs is not None else None
                tops = verdict.top_logprobs[i] if verdict.top_logprobs is not None else None
                want_lp = r.params.logprobs or r.params.top_logprobs_num > 0
                for j, tok in enumerate(verdict.tokens[i]):
                    top = tops[j] if tops is not None and r.params.top_logprobs_num > 0 else None
                    if r.append_token(tok, lps[j] if want_lp and lps is not None else None, top):
                        break
                # Valid KV: everything before the fed token, the fed token, and the accepted drafts.
                r.num_computed = base[i] + 1 + accepted[i]
            self.drafter.rollback(reqs)
        for r, k, a in zip(reqs, ks, accepted):
            s = self._stats.get(r.room)
            if s is None:
                s = self._stats[r.room] = SpecStats(histogram=[0] * (self.num_draft_tokens + 1))
            s.verify_ct += 1
            s.num_proposed_drafts += k
            s.num_correct_drafts += a
            s.histogram[a] += 1  # type: ignore[index]
        seconds = time.perf_counter() - t_start - draft_time
        self.policy.observe(
            sum(ks) + len(reqs), seconds, [(r.room, k, a) for r, k, a in zip(reqs, ks, accepted)]
        )

    def stats(self, req: Request) -> RequestStats:
        s = self._stats.get(req.room) or SpecStats(histogram=[0] * (self.num_draft_tokens + 1))
        return s.as_meta()

    def forget(self, req: Request) -> None:
        self._stats.pop(req.room, None)
        self.drafter.forget(req)
        self.policy.forget(req.room)
