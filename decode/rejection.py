"""Acceptance of draft tokens against the target's verify logits.

Greedy rows: accept the longest prefix where draft == target argmax, then one bonus token (the
target's argmax at the first mismatch, or after the last draft). Exact: the output equals plain
greedy decoding token for token.

Sampled rows: standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).
Draft x at position j, drawn from q_j, is accepted with probability min(1, p_j(x) / q_j(x)); at the
first rejection the token is drawn from normalize(max(0, p_j - q_j)); after k accepted drafts the
bonus is drawn from p_k. Every emitted token is then distributed exactly as under p. A
deterministic proposal (NGRAM) has q one-hot at the draft: accept with probability p(x), else draw
from p with x removed.

p_j is the sampler's processed distribution (penalties, temperature, top-k/p, min-p) for row j,
computed with the request's output extended by drafts[:j], so penalties see exactly the tokens
plain decoding would have seen. Row j of a request draws at step len(output) + j, so a seeded
request's randomness depends only on its seed and position (not on the rest of the batch); its
tokens still depend on what was drafted, so seeded outputs differ from non-speculative ones.

Constrained requests (structured output): every verify row is first masked to what the request's
grammar allows after drafts[:j] (runtime/grammar/masks.py), so p_j is the constrained distribution,
a draft the grammar refuses is rejected (p_j(x) = 0), and the bonus token obeys the grammar too. The
matcher is rolled back to where it was; the emitted tokens are fed to it as they are appended.
Logprobs stay those of the unmasked logits, as on the plain path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.decode.drafters import Drafts
from pdserve.runtime.grammar import fill_verify_masks
from pdserve.runtime.request import Request
from pdserve.runtime.sampler import Sampler
from pdserve.runtime.sampling_batch import SamplingBatch

ACCEPT_SALT = 0xACCE_97ED
RESAMPLE_SALT = 0x4E5A_3B1E


@dataclass
class Verdict:
    tokens: list[list[int]]  # per request: accepted drafts, then the bonus token
    num_accepted: list[int]  # accepted drafts per request (bonus excluded)
    logprobs: list[list[float]] | None = None  # per emitted token (raw logits, temperature 1)
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None


def verify(sampler: Sampler, reqs: list[Request], drafts: Drafts, logits: torch.Tensor) -> Verdict:
    """Accept drafts for every request; `logits` [sum(k_i + 1), V] are the verify rows, request-major."""
    raw = logits
    if any(r.grammar is not None for r in reqs):
        if any(r.params.logprobs or r.params.top_logprobs_num > 0 for r in reqs):
            raw = logits.clone()  # logprobs report the model's own distribution
        fill_verify_masks(logits, [r.grammar for r in reqs], drafts.tokens)  # in place
    ks = [len(t) for t in drafts.tokens]
    starts = [0]
    for k in ks:
        starts.append(starts[-1] + k + 1)
    row_params = [r.params for r, k in zip(reqs, ks) for _ in range(k + 1)]
    eos = [r.eos_token_ids for r, k in zip(reqs, ks) for _ in range(k + 1)]
    sb = SamplingBatch.build(row_params, logits.device, eos)
    if sb.all_greedy and not sb.any_penalty:
        target = logits.argmax(dim=-1).tolist()  # deliberate sync: acceptance is decided on the host
        verdict = _accept_greedy(drafts.tokens, target, starts)
    else:
        verdict = _accept_sampled(sampler, reqs, drafts, logits, sb, starts)
    if sb.need_logprobs:
        _attach_logprobs(verdict, reqs, raw, starts)
    return verdict


def _accept_greedy(drafts: list[list[int]], target: list[int], starts: list[int]) -> Verdict:
    tokens, accepted = [], []
    for d, s in zip(drafts, starts):
        a = 0
        while a < len(d) and d[a] == target[s + a]:
            a += 1
        tokens.append(d[:a] + [target[s + a]])
        accepted.append(a)
    return Verdict(tokens, accepted)


def _accept_sampled(
    sampler: Sampler,
    reqs: list[Request],
    drafts: Drafts,
    logits: torch.Tensor,
    sb: SamplingBatch,
    starts: list[int],
) -> Verdict:
    dev = logits.device
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    steps: list[int] = []
    draft_rows: list[int] = []
    draft_ids: list[int] = []
    q_parts: list[tuple[int, torch.Tensor]] = []  # (first draft row, [k, V]) of drawn proposals
    for r, d, q, s in zip(reqs, drafts.tokens, drafts.probs, starts):
        for j in range(len(d) + 1):
            prompts.append(r.prompt_ids)
            outputs.append(r.output_ids + d[:j])
            steps.append(len(r.output_ids) + j)
        if q is not None:
            q_parts.append((len(draft_rows), q))
        draft_rows.extend(s + j for j in range(len(d)))
        draft_ids.extend(d)
    pen = sb.any_penalty
    p = sampler.probs(logits.float(), sb, prompts if pen else None, outputs if pen else None)  # [R, V]
    resid = p  # rows without a draft (bonus rows) fall back to p itself
    accept_host: list[bool] = []
    if draft_rows:
        rows = torch.tensor(draft_rows, device=dev)  # [D]
        x = torch.tensor(draft_ids, device=dev)[:, None]  # [D, 1]
        # [D, V] one-hot at the draft (deterministic proposals), overwritten where q was drawn from
        q = torch.zeros(len(draft_rows), p.shape[1], device=dev).scatter_(1, x, 1.0)
        for first, part in q_parts:
            q[first : first + part.shape[0]] = part
        p_x = p[rows].gather(1, x).squeeze(1)  # [D]
        q_x = q.gather(1, x).squeeze(1).clamp_min(1e-30)  # x was drawn from q, so q_x > 0
        u = sampler.uniform(sb, steps, ACCEPT_SALT)[rows, 0]  # [D]
        accept = u * q_x < p_x  # u < p/q without dividing; always true when p_x >= q_x
        resid = p.clone()
        resid[rows] = (p[rows] - q).clamp_min(0.0)
        accept_host = accept.tolist()  # deliberate sync (with the draws below)
    fallback = sampler.draw(resid, sb, steps, RESAMPLE_SALT).tolist()
    tokens, accepted = [], []
    di = 0
    for d, s in zip(drafts.tokens, starts):
        a = 0
        while a < len(d) and accept_host[di + a]:
            a += 1
        di += len(d)
        tokens.append(d[:a] + [fallback[s + a]])
        accepted.append(a)
    return Verdict(tokens, accepted)


def _attach_logprobs(v: Verdict, reqs: list[Request], logits: torch.Tensor, starts: list[int]) -> None:
    rows = [s + j for s, toks in zip(starts, v.tokens) for j in range(len(toks))]
    ids = [t for toks in v.tokens for t in toks]
    lsm = torch.log_softmax(logits[rows].float(), dim=-1)  # [E, V]
    chosen = lsm.gather(1, torch.tensor(ids, device=logits.device)[:, None]).squeeze(1).tolist()
    n_top = max(r.params.top_logprobs_num for r in reqs)
    top_vals: list[list[float]] = []  # [E, n_top] when any request wants top logprobs
    top_ids: list[list[int]] = []
    if n_top > 0:
        vals, idx = lsm.topk(min(n_top, lsm.shape[1]), dim=-1)
        top_vals, top_ids = vals.tolist(), idx.tolist()
    v.logprobs, v.top_logprobs = [], []
    e = 0
    for r, toks in zip(reqs, v.tokens):
        n = r.params.top_logprobs_num
        v.logprobs.append(chosen[e : e + len(toks)])
        tops = []
        for j in range(len(toks)):
            tops.append(list(zip(top_ids[e + j][:n], top_vals[e + j][:n])) if top_ids and n else [])
        v.top_logprobs.append(tops)
        e += len(toks)
