"""Prompt logprobs (SGLang's `logprob_start_len`): each prompt token's log-probability under the model,
computed by the node that runs the prompt's forward (the prefill node), chunk by chunk.

A forward that needs them returns logits for every new token (`ForwardBatch all_logits`); the row of
position p scores the token at position p + 1. The token at position 0 has nothing before it: its
entry is None, as in SGLang. Positions before the request's `logprob_start_len` are skipped (and the
prefix cache is matched only below it, so every needed row is computed).
"""

from __future__ import annotations

import torch

from pdserve.runtime.request import Request


def take_prompt_logprobs(
    reqs: list[Request], prefix_lens: list[int], chunks: list[list[int]], logits: torch.Tensor
) -> torch.Tensor:
    """Record the prompt logprobs the rows of this forward give (`logits`: one row per new token,
    request-major; `prefix_lens`: each request's computed tokens before it). Returns the last row
    of each request, what sampling takes."""
    last, row = [], 0
    for r, p, chunk in zip(reqs, prefix_lens, chunks):
        n = len(chunk)
        start = r.params.logprob_start_len
        if start >= 0:
            _record(r, p, logits[row : row + n], start)
        row += n
        last.append(row - 1)
    return logits[torch.tensor(last, device=logits.device)]


def _record(r: Request, p: int, rows: torch.Tensor, start: int) -> None:
    prompt = r.prompt_ids
    if p == 0 and start == 0:
        r.input_logprobs.append(None)
        r.input_top_logprobs.append(None)
    # Rows j score positions p + j + 1; keep those in [max(start, 1), len(prompt)).
    first = max(start, 1, p + 1)
    end = min(len(prompt), p + rows.shape[0] + 1)
    if first >= end:
        return
    lp = torch.log_softmax(rows[first - 1 - p : end - 1 - p].float(), dim=-1)
    ids = torch.tensor(prompt[first:end], device=lp.device)
    r.input_logprobs.extend(lp.gather(1, ids[:, None])[:, 0].tolist())
    k = r.params.top_logprobs_num
    if k > 0:
        vals, idx = lp.topk(k, dim=-1)
        for v, i in zip(vals.tolist(), idx.tolist()):
            r.input_top_logprobs.append(list(zip(i, v)))
    else:
        r.input_top_logprobs.extend([None] * (end - first))
