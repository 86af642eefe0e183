"""One explicit description of a forward pass; no global forward state.

Every mode is an "extend": each request appends `extend_len` new tokens to `prefix_len` cached
ones, and its new queries attend causally to the prefix plus themselves.
- EXTEND: prompts (or prompt chunks), any lengths, optionally on top of cached prefix pages.
- DECODE: exactly one new token per request.
- VERIFY: k+1 candidate tokens per request (speculative decoding); logits for every candidate.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"
    VERIFY = "verify"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, the new tokens of all requests, request-major
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    out_cache_loc: torch.Tensor  # [T] int64, KV slot (page * page_size + offset) of each new token
    page_table: torch.Tensor  # [B, max_pages] int32, page ids of each request (padding: 0)
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens per request
    extend_lens: torch.Tensor  # [B] int32, new tokens per request
    qo_indptr: torch.Tensor  # [B + 1] int32, request i's queries are rows qo_indptr[i]:qo_indptr[i+1]
    logits_indices: torch.Tensor  # [N] int64, rows of the hidden states that need logits
    # Host copies, so the torch backend plans without reading device tensors (no hidden syncs).
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prefix_lens_cpu(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu)]

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        new_tokens: list[list[int]],
        prefix_lens: list[int],
        page_tables: list[list[int]],
        page_size: int,
        device: torch.device | str = "cpu",
        all_logits: bool | None = None,
    ) -> ForwardBatch:
        """Describe a batch from host lists: the new tokens, cached length and pages of each request.

        `all_logits` (default: True for VERIFY) asks for logits at every new token instead of
        only each request's last one.
        """
        if not (len(new_tokens) == len(prefix_lens) == len(page_tables)) or not new_tokens:
            raise ValueError("new_tokens, prefix_lens and page_tables must be equally long and non-empty")
        if all_logits is None:
            all_logits = mode is ForwardMode.VERIFY
        extend_lens = [len(t) for t in new_tokens]
        if min(extend_lens) < 1:
            raise ValueError("every request in a forward needs at least one new token")
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        for s, pages in zip(seq_lens, page_tables):
            if len(pages) * page_size < s:
                raise ValueError(f"{len(pages)} pages of {page_size} cannot hold {s} tokens")

        ids: list[int] = []
        pos: list[int] = []
        loc: list[int] = []
        for toks, p, pages in zip(new_tokens, prefix_lens, page_tables):
            ids.extend(toks)
            for i in range(p, p + len(toks)):
                pos.append(i)
                loc.append(pages[i // page_size] * page_size + i % page_size)
        indptr = [0]
        for e in extend_lens:
            indptr.append(indptr[-1] + e)
        if all_logits:
            logits_idx = list(range(indptr[-1]))
        else:
            logits_idx = [x - 1 for x in indptr[1:]]
        max_pages = max(len(p) for p in page_tables)
        table = torch.zeros((len(page_tables), max_pages), dtype=torch.int32)
        for i, pages in enumerate(page_tables):
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)

        def t(x: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

        return cls(
            mode=mode,
            input_ids=t(ids, torch.int64),
            positions=t(pos, torch.int64),
            out_cache_loc=t(loc, torch.int64),
            page_table=table.to(device, non_blocking=True),
            seq_lens=t(seq_lens, torch.int32),
            extend_lens=t(extend_lens, torch.int32),
            qo_indptr=t(indptr, torch.int32),
            logits_indices=t(logits_idx, torch.int64),
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=extend_lens,
        )
