"""The profiles a capacity planner reads, measured on one model and device: the time of one prefill
forward per prompt length, and of one decode step per batch size and context length.

Forwards are timed bare (the model with the device's attention backend over a paged KV pool; no
scheduler, no sampling): the median of `repeats` after one warm-up. The KV contents are whatever the
pool holds: the time of a forward does not depend on them.
"""

from __future__ import annotations

import statistics
import time

import torch

from pdserve.runtime.attention import AttentionBackend, make_attention_backend
from pdserve.runtime.batch import ForwardBatch, ForwardMode
from pdserve.runtime.kv_pool import KVGeometry, KVPool
from pdserve.runtime.loader import LoadedModel, load_model

PAGE_SIZE = 16


def _timed(
    loaded: LoadedModel, batch: ForwardBatch, pool: KVPool, attn: AttentionBackend, repeats: int
) -> float:
    device = batch.input_ids.device
    times = []
    with torch.no_grad():
        for i in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            loaded.model(batch, pool, attn)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first is the warm-up (kernel compilation on CUDA)
                times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def measure_profiles(
    folder: str,
    device: str,
    dtype: str,
    prefill_lens: tuple[int, ...] = (128, 512, 2048, 8192),
    decode_batches: tuple[int, ...] = (1, 16, 64),
    decode_contexts: tuple[int, ...] = (512, 4096),
    repeats: int = 5,
) -> dict:
    """{"prefill_ms": {prompt length: ms}, "decode_step_ms": {"<batch>x<context>": ms}, ...}."""
    loaded = load_model(folder, dtype=dtype, device=device)
    spec = loaded.spec
    geo = KVGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, PAGE_SIZE, loaded.dtype)
    need = max(max(prefill_lens), max(decode_batches) * max(decode_contexts))
    pool = KVPool(geo, KVPool.pages_for(geo, need) + max(decode_batches), device)
    attn = make_attention_backend("auto", torch.device(device))
    g = torch.Generator().manual_seed(0)
    vocab = spec.vocab_size

    def pages(start: int, tokens: int) -> list[int]:
        return list(range(start, start + -(-tokens // PAGE_SIZE)))

    prefill = {}
    for n in prefill_lens:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        batch = ForwardBatch.build(ForwardMode.EXTEND, [ids], [0], [pages(0, n)], PAGE_SIZE, device=device)
        prefill[n] = round(_timed(loaded, batch, pool, attn, repeats), 3)
    decode = {}
    for ctx in decode_contexts:
        for b in decode_batches:
            per = -(-ctx // PAGE_SIZE)
            tables = [pages(i * per, ctx) for i in range(b)]
            ids = torch.randint(3, vocab, (b, 1), generator=g).tolist()
            batch = ForwardBatch.build(
                ForwardMode.DECODE, ids, [ctx - 1] * b, tables, PAGE_SIZE, device=device
            )
            decode[f"{b}x{ctx}"] = round(_timed(loaded, batch, pool, attn, repeats), 3)
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": dtype,
        "attention": type(attn).__name__,
        "prefill_ms": prefill,
        "decode_step_ms": decode,
    }
