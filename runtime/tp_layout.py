"""How a model splits across the ranks of a tensor-parallel worker, and the weights of one rank.

Megatron's split, as SGLang and vLLM make it:
- attention: rank r holds query heads [r * nq/N, (r+1) * nq/N) and their KV heads. With fewer KV heads
  than ranks, each KV head is replicated on N / nkv consecutive ranks (the ones whose query heads read
  it); q/k/v are column-parallel (rows of the fused qkv weight), o_proj row-parallel (its columns).
- MLP: gate/up column-parallel, down row-parallel; one all-reduce after o_proj and one after down.
- embedding and LM head: vocabulary-parallel, ceil(V / N) rows per rank, the last rank's padded with
  zero rows; a token outside a rank's rows embeds to zeros there (the all-reduce adds the one rank that
  has it), and the ranks' logits are gathered and cut back to V.

A layout that does not split (query heads, KV heads or the MLP width not divisible) is refused with
a message naming the model's heads and the TP size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

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
        if self.num_kv_heads >= self.size:
            per = self.num_kv_heads // self.size
            return range(rank * per, (rank + 1) * per)
        head = rank * self.num_kv_heads // self.size
        return range(head, head + 1)

    def mlp_rows(self, rank: int) -> range:
        per = self.intermediate_size // self.size
        return range(rank * per, (rank + 1) * per)

    def vocab_rows(self, rank: int) -> range:
        """This rank's rows of the padded vocabulary (the last may reach past vocab_size)."""
        per = self.vocab_per_rank
        return range(rank * per, (rank + 1) * per)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return lin


def _vocab_shard(table: torch.Tensor, rows: range) -> torch.Tensor:
    """rows of a [V, hidden] table, zero rows where `rows` passes V."""
    out = torch.zeros(len(rows), table.shape[1], dtype=table.dtype)
    have = table[rows.start : min(rows.stop, table.shape[0])]
    out[: have.shape[0]] = have
    return out


def shard_weights(model: CausalLM, layout: TPLayout, rank: int, head_dim: int) -> None:
    """Cut a loaded float model (runtime/models/llama.py CausalLM, before quantization) down to rank
    `rank`'s weights, in place."""
    nq, nkv, hd = layout.num_heads, layout.num_kv_heads, head_dim
    q = layout.q_heads(rank)
    kv = layout.kv_heads(rank)
    qkv_rows = torch.cat(
        [
            torch.arange(q.start * hd, q.stop * hd),
            nq * hd + torch.arange(kv.start * hd, kv.stop * hd),
            (nq + nkv) * hd + torch.arange(kv.start * hd, kv.stop * hd),
        ]
    )
    mlp = layout.mlp_rows(rank)
    inter = layout.intermediate_size
    gate_up_rows = torch.cat([torch.arange(mlp.start, mlp.stop), inter + torch.arange(mlp.start, mlp.stop)])
    with torch.no_grad():
        for layer in cast("list[DecoderLayer]", model.model.layers):
            attn, ffn = layer.self_attn, layer.mlp
            qkv = attn.qkv_proj
            bias = None if qkv.bias is None else qkv.bias[qkv_rows]
            attn.qkv_proj = _linear(qkv.weight[qkv_rows], bias)
            attn.o_proj = _linear(attn.o_proj.weight[:, q.start * hd : q.stop * hd], None)
            attn.nq, attn.nkv = len(q), len(kv)
            ffn.gate_up_proj = _linear(ffn.gate_up_proj.weight[gate_up_rows], None)
            ffn.down_proj = _linear(ffn.down_proj.weight[:, mlp.start : mlp.stop], None)
        rows = layout.vocab_rows(rank)
        embed = model.model.embed_tokens
        assert isinstance(embed, nn.Embedding)  # before quantization
        table = _vocab_shard(embed.weight, rows)
        model.model.embed_tokens = nn.Embedding(table.shape[0], table.shape[1], _weight=table)
        model.model.embed_tokens.weight.requires_grad_(False)
        if model.lm_head is not None:
            model.lm_head = _linear(_vocab_shard(model.lm_head.weight, rows), None)
