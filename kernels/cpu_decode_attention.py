"""Paged decode attention on CPU, in C++ (cpu_decode_attention.cpp): the decode step's attention that
reads the KV pool in place.

The torch path gathers every request's cached K and V rows into a padded copy (`index_select`) and
runs SDPA on it: at batch 64 and ~200 tokens of context that copy is ~280 MB written and read again
per step, on top of the reads SDPA needs. This kernel reads each row once from the pool, where it
lies, and shares it among the query heads of its KV head (docs/benchmarks.md has the numbers).

`paged_decode_attention(q, rows, key_rows, lens, k_offset, v_offset, scale, k_new, v_new)`:
  q [B, Hq, D]; rows [N, Hkv, D], the pool (`KVPool.rows()`); key_rows [B, H] int64, the pool row of
  each request's position j (layer 0's K, as `KVPool.key_rows`); lens [B] int64, how many of them
  request b sees; k_offset / v_offset, the layer's rows (`KVPool.row_offset`); k_new / v_new
  [B, Hkv, D] or None, one more key and value per request, after the cached ones (the compiled step's
  new token, not yet in the pool). Returns [B, Hq, D] in q's dtype. fp32, bf16 and fp16; under fp32
  queries the pool may be fp16 or bf16 (`--kv-cache-dtype`): its rows, and k_new / v_new rounded to the
  pool's dtype as they will be stored, are read back into float32.

It is an operator (`torch.ops.pdserve_cpu.paged_decode_attention`) with a fake implementation, so
`torch.compile` traces through it. It lives in the `pdserve_cpu` library (kernels/cpu_library.py), built
on first use; where it cannot be built, `load()` says why once and returns False: `--attention-backend
auto` then keeps the torch path.
`paged_decode_attention_ref` is the torch reference with the same signature.

`paged_decode_attention_store(q, rows, key_rows, lens, k_offset, v_offset, scale, new_rows, k, v)`: the
eager decode step's form. It first stores k and v [B, Hkv, D] in the pool at rows `new_rows[b]` (layer
0's K numbering, as `KVPool.slot_rows`) plus the offsets, then attends over lens[b] rows that include
them: one call per layer where the step made three. `paged_decode_attention_store_ref` is its torch form.

`paged_extend_attention(q, rows, key_rows, prefix, qo_indptr, k_offset, v_offset, scale)`: every query of
an extend batch (prompts, chunks, verifies) computed exactly as the decode kernel computes that query as a
decode step (batch-invariant decoding, runtime/determinism.py). q [T, Hq, D], request b's queries at rows
qo_indptr[b]:qo_indptr[b + 1] (int64 [B + 1]); key_rows [B, H] as above; prefix [B] int64, the request's
positions before its first query; query i of request b sees rows 0 .. prefix[b] + i. The new keys and
values must be in the pool. A block of 16 consecutive queries shares each row it reads.
"""

from __future__ import annotations

import torch

from pdserve.kernels.cpu_library import build_dir, load

__all__ = [
    "build_dir",
    "load",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_decode_attention_store",
    "paged_decode_attention_store_ref",
    "paged_extend_attention",
]


def paged_decode_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    key_rows: torch.Tensor,
    lens: torch.Tensor,
    k_offset: int,
    v_offset: int,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """The C++ operator; `load()` must have returned True."""
    out: torch.Tensor = torch.ops.pdserve_cpu.paged_decode_attention(
        q, rows, key_rows, lens, k_offset, v_offset, scale, k_new, v_new
    )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    rows: torch.Tensor,
    key_rows: torch.Tensor,
    lens: torch.Tensor,
    k_offset: int,
    v_offset: int,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: gather, mask past `lens`, softmax in float32."""
    B, Hq, D = q.shape
    Hkv = rows.shape[1]
    G = Hq // Hkv
    H = key_rows.shape[1]
    keys = rows[key_rows + k_offset].float()  # [B, H, Hkv, D]
    vals = rows[key_rows + v_offset].float()
    visible = torch.arange(H)[None] < lens[:, None]  # [B, H]
    if k_new is not None and v_new is not None:
        keys = torch.cat([keys, k_new.to(rows.dtype).float()[:, None]], 1)
        vals = torch.cat([vals, v_new.to(rows.dtype).float()[:, None]], 1)
        visible = torch.cat([visible, torch.ones(B, 1, dtype=torch.bool)], 1)
    qg = q.float().view(B, Hkv, G, D)
    s = torch.einsum("bhgd,bthd->bhgt", qg, keys) * scale
    s = s.masked_fill(~visible[:, None, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a request that sees nothing gets zeros
    out = torch.einsum("bhgt,bthd->bhgd", p, vals)
    return out.reshape(B, Hq, D).to(q.dtype)


def paged_decode_attention_store(
    q: torch.Tensor,
    rows: torch.Tensor,
    key_rows: torch.Tensor,
    lens: torch.Tensor,
    k_offset: int,
    v_offset: int,
    scale: float,
    new_rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """The C++ operator (stores k and v in `rows`, then attends); `load()` must have returned True."""
    out: torch.Tensor = torch.ops.pdserve_cpu.paged_decode_attention_store(
        q, rows, key_rows, lens, k_offset, v_offset, scale, new_rows, k, v
    )
    return out


def paged_decode_attention_store_ref(
    q: torch.Tensor,
    rows: torch.Tensor,
    key_rows: torch.Tensor,
    lens: torch.Tensor,
    k_offset: int,
    v_offset: int,
    scale: float,
    new_rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """Torch reference of `paged_decode_attention_store`."""
    rows.index_copy_(0, new_rows + k_offset, k.to(rows.dtype))
    rows.index_copy_(0, new_rows + v_offset, v.to(rows.dtype))
    return paged_decode_attention_ref(q, rows, key_rows, lens, k_offset, v_offset, scale)


def paged_extend_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    key_rows: torch.Tensor,
    prefix: torch.Tensor,
    qo_indptr: torch.Tensor,
    k_offset: int,
    v_offset: int,
    scale: float,
) -> torch.Tensor:
    """The C++ operator; `load()` must have returned True."""
    out: torch.Tensor = torch.ops.pdserve_cpu.paged_extend_attention(
        q, rows, key_rows, prefix, qo_indptr, k_offset, v_offset, scale
    )
    return out
