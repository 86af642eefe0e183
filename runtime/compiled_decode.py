"""Decode steps through `torch.compile` (`--enable-torch-compile`, SGLang's flag): the CPU path.

An eager decode step of a small model is mostly op launches: about 35 small ops a layer (norms,
rotary, residuals, SwiGLU, views, casts) and their Python, around the weight matmuls. Inductor fuses
them into a few C++ loops, called from a C++ wrapper rather than Python (`cpp_wrapper`), but only
over a graph it can see whole, and the eager attention backend writes the KV pool in every layer: a
graph that mutates a pool of hundreds of MiB either copies it or breaks at each layer.

So the compiled step is a pure function of the pool. Each layer's attention reads the request's cached
keys and values from the pool and appends the new token's own as the last key: with the C++ paged
decode kernel (`--attention-backend cpu`, the CPU default) where they lie, else gathered (one
`index_select` per kind) for SDPA. The new K and V of every layer come back as outputs, and after the
graph one `index_copy_` per kind writes all layers' into the pool. The model's own modules run unchanged inside the graph; only
the attention backend differs (`_PooledAttention`).

Decode batches only (one new token per request); extend and verify forwards stay eager. Graphs are
compiled with dynamic shapes; the quantized linears' row thresholds split them by batch size, so
`warm_up` runs every batch size up to the largest once at start. Past warm-up a call that would compile
again is refused (the `fail_on_recompile` stance) and runs the same function eagerly, logged once and
counted, so a serving worker never stalls for a compilation.
Inductor caches its code on disk (`TORCHINDUCTOR_CACHE_DIR`): a restart compiles again but most of the
work is a cache hit. Its cache keys miss the CPU's instruction set: code and prepacked-weight layouts
compiled under one (say AVX-512) and reused under another (AVX2, or `PDSERVE_CPU_ISA=avx2` on the same
host) gave wrong tokens or aborted the process. So the cache folder gets one subfolder per CPU kind
(`_inductor_cache_per_cpu`), whether the folder is inductor's default or the user's.

The fused kernels round differently from eager ones: in bfloat16 the greedy tokens can change, like
any other change of kernels; docs/cpu.md reports the measured agreement.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_decode_attention, cpu_isa
from pdserve.runtime.batch import ForwardBatch
from pdserve.runtime.kv_pool import KVPool

log = logging.getLogger(__name__)

# History length of the warm-up batches: above 1, so the graphs are not specialized to one key.
_WARM_HISTORY = 23


class _PooledAttention:
    """The attention backend of one traced decode forward: reads the pool, never writes it.

    `key_rows` [B * H] holds the pool row (layer 0's K) of each request's cached position j < H.
    With `lens` [B] (the paged kernel), request b sees its first lens[b]; else padded positions point
    anywhere and are masked out by `mask` [B, 1, 1, H + 1] (None: all visible)."""

    def __init__(
        self,
        rows: torch.Tensor,
        key_rows: torch.Tensor,
        mask: torch.Tensor | None,
        lens: torch.Tensor | None,
    ):
        self.rows, self.key_rows, self.mask, self.lens = rows, key_rows, mask, lens
        self.new_k: list[torch.Tensor] = []
        self.new_v: list[torch.Tensor] = []

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:
        raise NotImplementedError("built per traced forward; nothing to prepare")

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, pool: KVPool, scale: float
    ) -> torch.Tensor:
        B, Hq, D = q.shape
        Hkv = k.shape[1]
        self.new_k.append(k)
        self.new_v.append(v)
        if self.lens is not None:
            k_off, v_off = pool.row_offset(layer, 0), pool.row_offset(layer, 1)
            kr = self.key_rows.view(B, -1)
            return cpu_decode_attention.paged_decode_attention(
                q, self.rows, kr, self.lens, k_off, v_off, scale, k, v
            )
        hist_k = self.rows.index_select(0, self.key_rows + pool.row_offset(layer, 0)).view(B, -1, Hkv, D)
        hist_v = self.rows.index_select(0, self.key_rows + pool.row_offset(layer, 1)).view(B, -1, Hkv, D)
        # a pool in another dtype (--kv-cache-dtype): everything attended to as stored
        k, v = k.to(self.rows.dtype), v.to(self.rows.dtype)
        keys = torch.cat([hist_k, k[:, None]], dim=1).transpose(1, 2).to(q.dtype)  # [B, Hkv, H + 1, D]
        vals = torch.cat([hist_v, v[:, None]], dim=1).transpose(1, 2).to(q.dtype)
        # The G query heads of a KV head as G queries of it (see TorchAttention): [B, Hkv, G, D].
        qg = q.reshape(B, Hkv, Hq // Hkv, D)
        out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=self.mask, scale=scale)
        return out.reshape(B, Hq, D)


def _decode_step(
    model: Any,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    key_rows: torch.Tensor,
    mask: torch.Tensor | None,
    lens: torch.Tensor | None,
    pool: KVPool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [B, vocab] and every layer's new K and V [num_layers, B, Hkv, D]: the traced function."""
    attn = _PooledAttention(rows, key_rows, mask, lens)
    logits = model.run(input_ids, positions, None, pool, attn)
    return logits, torch.stack(attn.new_k), torch.stack(attn.new_v)


def _inductor_cache_per_cpu() -> str:
    """Point TORCHINDUCTOR_CACHE_DIR at a subfolder for this CPU's kind (its flags under the
    PDSERVE_CPU_ISA cap, torch's capability level and version) and return it; idempotent."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    key = hashlib.sha256(" ".join(sorted(cpu_isa.flags())).encode())
    key.update(f"{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}".encode())
    leaf = f"cpu-{key.hexdigest()[:12]}"
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    if os.path.basename(os.path.normpath(base)) != leaf:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, leaf)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


class CompiledDecode:
    """Runs decode batches of one model and pool through one compiled function."""

    def __init__(self, model: torch.nn.Module, pool: KVPool, max_batch: int, paged_kernel: bool):
        if pool.kv.device.type != "cpu":
            raise ValueError(
                "--enable-torch-compile compiles the CPU decode step; on CUDA the Triton attention "
                "backend runs"
            )
        self.model, self.pool, self.max_batch = model, pool, max_batch
        # The C++ paged decode attention (lens per request) or a gather and SDPA (a mask).
        self.paged_kernel = paged_kernel
        # cpp_wrapper: the graph's calls to its kernels and to aten ops are made from generated C++, not
        # Python; at batch 1 that is ~15% of a step (docs/cpu.md).
        log.info("inductor's cache: %s", _inductor_cache_per_cpu())
        self._fn = torch.compile(_decode_step, dynamic=True, options={"cpp_wrapper": True})
        self.warm = False
        self.eager_steps = 0  # steps past warm-up that no compiled graph fitted
        g = pool.geometry
        offsets = torch.tensor([pool.row_offset(layer, 0) for layer in range(g.num_layers)])
        self._k_offsets = offsets[:, None]  # [L, 1]: K rows of layer l = slot rows + offset
        self._v_offsets = offsets[:, None] + pool.row_offset(0, 1)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] in float32 of a decode batch; writes its new K and V into the pool."""
        if max(batch.extend_lens_cpu) != 1:
            raise ValueError("a compiled decode step takes one new token per request")
        if not self.warm:
            self.warm_up()
        pool = self.pool
        # Every input is made inside inference mode, as in warm-up: the graphs' guards check it.
        with torch.inference_mode():
            hist = max(batch.seq_lens_cpu) - 1  # cached positions of the longest request
            key_rows = pool.key_rows(batch.page_table, hist)  # [B * hist]
            mask = lens = None
            if self.paged_kernel:
                lens = batch.seq_lens.long() - 1  # cached positions each request sees
            elif batch.batch_size > 1:  # one graph for every B > 1: always masked, uneven or not
                cached = batch.seq_lens.long()[:, None] - 1  # [B, 1]
                j = torch.arange(hist)
                visible = torch.cat([j[None] < cached, torch.ones_like(cached, dtype=torch.bool)], dim=1)
                mask = visible[:, None, None]  # [B, 1, 1, hist + 1]; the new key, last, always visible
            logits, new_k, new_v = self._call(
                batch.input_ids.clone(), batch.positions.clone(), key_rows, mask, lens
            )
            out = pool.slot_rows(batch.out_cache_loc)[None]  # [1, B]
            rows = pool.rows()
            rows.index_copy_(0, (out + self._k_offsets).view(-1), new_k.flatten(0, 1).to(rows.dtype))
            rows.index_copy_(0, (out + self._v_offsets).view(-1), new_v.flatten(0, 1).to(rows.dtype))
        return logits

    def _call(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        key_rows: torch.Tensor,
        mask: torch.Tensor | None,
        lens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step through the compiled graphs; past warm-up, a step no graph fits runs eagerly (the
        same function, uncompiled) rather than stall the worker for a compilation, and is counted."""
        # Imported here: torch._dynamo costs seconds at import, and only a compiled worker needs it.
        import torch.fx.experimental._config as fx_config
        from torch._dynamo.exc import RecompileError

        args = (self.model, ids, pos, self.pool.rows(), key_rows, mask, lens, self.pool)
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        # No duck sizing: a batch or history that happens to equal one of the pool's dimensions (its
        # page size, layer or head count) must not tie a graph to that size.
        with fx_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]  # set by torch at import
            if not self.warm:
                out = self._fn(*args)
                return out
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    out = self._fn(*args)
                return out
            except (RecompileError, RuntimeError) as e:  # torch 2.13 raises a RuntimeError here
                if not isinstance(e, RecompileError) and "Detected recompile" not in str(e):
                    raise
                if not self.eager_steps:
                    reason = " ".join(str(e).splitlines()[:3])
                    log.warning(
                        "compiled decode step: no graph fits a batch of %d, run eagerly: %s",
                        ids.shape[0],
                        reason,
                    )
                self.eager_steps += 1
                return _decode_step(*args)

    def warm_up(self) -> None:
        """Compile the graphs of every batch size up to `max_batch` (most share one), writing nothing."""
        start = time.perf_counter()
        with torch.inference_mode():
            for b in range(1, self.max_batch + 1):
                ids = torch.zeros(b, dtype=torch.long)
                pos = torch.full((b,), _WARM_HISTORY, dtype=torch.long)
                key_rows = torch.zeros(b * _WARM_HISTORY, dtype=torch.long)
                mask = lens = None
                if self.paged_kernel:
                    lens = torch.full((b,), _WARM_HISTORY, dtype=torch.long)
                elif b > 1:
                    mask = torch.ones((b, 1, 1, _WARM_HISTORY + 1), dtype=torch.bool)
                self._call(ids, pos, key_rows, mask, lens)
        self.warm = True
        log.info(
            "compiled decode step: batch sizes 1-%d warm in %.1f s",
            self.max_batch,
            time.perf_counter() - start,
        )
