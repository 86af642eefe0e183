"""How a model splits across the ranks of a tensor-parallel worker, and the weights of one rank.

Megatron's split, as SGLang and vLLM make it:
- attention: rank r holds query heads [r * nq/N, (r+1) * nq/N) and their KV heads. With fewer KV heads
  than ranks, each KV head is replicated on N / nkv consecutive ranks (the ones whose query heads read
  it); q/k/v are column-parallel (rows of the fused qkv weight), o_proj row-parallel (its columns).
- MLP: gate/up column-parallel, down row-parallel; one all-reduce after o_proj and one after down.
- embedding and LM head: vocabulary-parallel, ceil(V / N) rows per rank, the last rank's padded with
  zero rows; a token outside a rank's rows embeds to zeros there (the all-reduce adds the one rank that
  has it), and the ranks' logits are gathered and cut back to V.

A rank builds its modules in its own shapes and reads only its rows and columns of each checkpoint tensor
(safetensors slices): no rank holds the whole model, even while loading. A layout that does not split
(query heads, KV heads or the MLP width not divisible) is refused with a message naming the model's heads
and the TP size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from pdserve.kv_transfer.layout import kv_head_ranges
from pdserve.runtime.model_config import ModelSpec

if TYPE_CHECKING:
    from pdserve.runtime.models.llama import CausalLM, DecoderLayer


class TPLayoutError(ValueError):
    pass


@dataclass(frozen=True)
class TPLayout:
    size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, spec: ModelSpec, size: int) -> TPLayout:
        layout = cls(size, spec.num_heads, spec.num_kv_heads, spec.intermediate_size, spec.vocab_size)
        layout.check()
        return layout

    def check(self) -> None:
        n, nq, nkv = self.size, self.num_heads, self.num_kv_heads
        if n < 1:
            raise TPLayoutError(f"--tp-size {n}: must be >= 1")
        problems = []
        if nq % n:
            problems.append(f"{nq} query heads")
        if nkv % n and n % nkv:
            problems.append(f"{nkv} KV heads (neither divides the other)")
        if self.intermediate_size % n:
            problems.append(f"an MLP width of {self.intermediate_size}")
        if problems:
            raise TPLayoutError(f"TP size {n} does not split {' and '.join(problems)} evenly")

    def describe(self) -> str:
        """e.g. 'TP 2: 4 of 8 query heads and 2 of 4 KV heads per rank'."""
        kv = self.kv_heads_per_rank
        share = f"{kv} of {self.num_kv_heads} KV heads"
        if self.num_kv_heads < self.size:
            share += f" (each on {self.size // self.num_kv_heads} ranks)"
        return f"TP {self.size}: {self.num_heads // self.size} of {self.num_heads} query heads and {share} per rank"

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.size)

    def q_heads(self, rank: int) -> range:
        per = self.num_heads // self.size
        return range(rank * per, (rank + 1) * per)

    def kv_heads(self, rank: int) -> range:
        """The KV heads rank `rank` holds (in the pool and in its share of qkv)."""
        return kv_head_ranges(self.num_kv_heads, self.size)[rank]

    def mlp_rows(self, rank: int) -> range:
        per = self.intermediate_size // self.size
        return range(rank * per, (rank + 1) * per)

    def vocab_rows(self, rank: int) -> range:
        """This rank's rows of the padded vocabulary (the last may reach past vocab_size)."""
        per = self.vocab_per_rank
        return range(rank * per, (rank + 1) * per)


def shard_of(name: str, layout: TPLayout, rank: int, head_dim: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the part of checkpoint tensor `name` (an HF name) rank `rank` holds; None:
    all of it (norms). A vocabulary's stop may pass the table's rows: the rest is zeros."""
    hd = head_dim
    q, kv, mlp = layout.q_heads(rank), layout.kv_heads(rank), layout.mlp_rows(rank)
    if ".q_proj." in name:
        return 0, q.start * hd, q.stop * hd
    if ".k_proj." in name or ".v_proj." in name:
        return 0, kv.start * hd, kv.stop * hd
    if ".o_proj." in name:
        return 1, q.start * hd, q.stop * hd
    if ".gate_proj." in name or ".up_proj." in name:
        return 0, mlp.start, mlp.stop
    if ".down_proj." in name:
        return 1, mlp.start, mlp.stop
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        rows = layout.vocab_rows(rank)
        return 0, rows.start, rows.stop
    return None


def read_shard(f: Any, name: str, part: tuple[int, int, int] | None) -> torch.Tensor:
    """Only rank's part of tensor `name` from an open safetensors file `f` (safe_open): the other
    ranks' rows and columns are never read."""
    if part is None:
        t: torch.Tensor = f.get_tensor(name)
        return t
    dim, start, stop = part
    sl = f.get_slice(name)
    have = min(stop, sl.get_shape()[dim])
    t = sl[start:have] if dim == 0 else sl[:, start:have]
    if have < stop:  # the last rank's vocabulary rows past V
        t = torch.cat([t, t.new_zeros((stop - have, *t.shape[1:]))])
    return t


def shard_modules(model: CausalLM, layout: TPLayout, rank: int) -> None:
    """Give a model built on the meta device (runtime/models/llama.py CausalLM, before its weights
    are read) rank `rank`'s shapes: its heads, its MLP width and its vocabulary rows."""
    spec = model.spec
    hd, hidden = spec.head_dim, spec.hidden_size
    nq, nkv = len(layout.q_heads(rank)), len(layout.kv_heads(rank))
    width = len(layout.mlp_rows(rank))
    meta = torch.device("meta")
    for layer in cast("list[DecoderLayer]", model.model.layers):
        attn, ffn = layer.self_attn, layer.mlp
        attn.qkv_proj = nn.Linear(hidden, (nq + 2 * nkv) * hd, bias=spec.qkv_bias, device=meta)
        attn.o_proj = nn.Linear(nq * hd, hidden, bias=False, device=meta)
        attn.nq, attn.nkv = nq, nkv
        ffn.gate_up_proj = nn.Linear(hidden, 2 * width, bias=False, device=meta)
        ffn.down_proj = nn.Linear(width, hidden, bias=False, device=meta)
    rows = layout.vocab_per_rank
    # around an empty table, as DecoderModel builds it (nn.Embedding's own init imports torch._dynamo)
    table = torch.empty(rows, hidden, device=meta)
    model.model.embed_tokens = nn.Embedding(rows, hidden, _weight=table)
    if model.lm_head is not None:
        model.lm_head = nn.Linear(hidden, rows, bias=False, device=meta)
