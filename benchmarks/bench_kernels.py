"""Kernel benchmark: correctness and speed of every Triton kernel against torch, on one GPU.

    python -P -m pdserve.bench.bench_kernels

Memory-bound kernels are reported as achieved bandwidth (bytes that must move / time) next to
the device's copy bandwidth measured in the same run (a plain device-to-device `copy_`).
Targets: decode attention >= 70% of copy bandwidth at batch 64 x 4k context; page gather and
scatter >= 80%. Without a GPU it runs a tiny interpreted smoke check and exits 0.

The KV hand-off's page gather and scatter are the rows `kv gather (send)` and `kv scatter (recv)`:
what `PairGroup.send_pages` / `recv_pages` do on the device for each request (kv_transfer/pair_group.py),
the page list made a device tensor, then one `gather_pages` / `scatter_pages` (kv_transfer/layout.py:
torch `index_select` / `index_copy_` over whole pages) per chunk of `TransferConfig.chunk_bytes`, into or
out of two alternating staging buffers; the sends and receives themselves are left out. Their torch
column is the same pages moved by one `gather_pages` / `scatter_pages` call (the page list already on the
device): the copy's own speed without the chunking.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

BF16 = torch.bfloat16


@dataclass(frozen=True)
class Row:
    name: str
    problem: str
    triton_us: float
    torch_us: float
    gbytes: float  # bytes that must move, in GB (0 when compute-bound: see tflops)
    tflop: float  # floating-point work, in TFLOP (0 when not reported)
    max_err: float
    ok: bool
    target: float | None = None  # minimum fraction of copy bandwidth


def _bench_us(fn: Callable[[], object]) -> float:
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100)  # ms -> us, L2 flushed per run


def _run_once(fn: Callable[[], object]) -> float:
    """The smoke check's stand-in for _bench_us: run once, time nothing."""
    fn()
    return 0.0


def _copy_bandwidth() -> float:
    """Device copy bandwidth in GB/s: read + write of a 2 GiB buffer."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = _bench_us(lambda: dst.copy_(src))
    return 2 * src.numel() / (us * 1e-6) / 1e9


def _err(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float = 2e-2) -> tuple[float, bool]:
    """Max abs error, and whether |a - b| <= atol + rtol * |b| everywhere (bf16: rtol ~ 2 ulps)."""
    d = (a.float() - b.float()).abs()
    ok = bool((d <= atol + rtol * b.float().abs()).all() and not torch.isnan(a).any())
    return d.max().item(), ok


def _paged(batch: int, ctx: int, kv_heads: int, dim: int, page: int) -> tuple[torch.Tensor, ...]:
    """Random pool with each request's pages scattered over it; returns k, v, page_table, seq_lens."""
    pages_per = -(-ctx // page)
    num_pages = batch * pages_per + 8
    k = torch.randn((num_pages, page, kv_heads, dim), device="cuda", dtype=BF16)
    v = torch.randn_like(k)
    table = torch.randperm(num_pages, device="cuda")[: batch * pages_per].view(batch, pages_per).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return k, v, table, lens


def bench_decode(batch: int, ctx: int, hq: int = 32, hkv: int = 8, dim: int = 128, page: int = 16) -> Row:
    from pdserve.kernels.decode_attention import decode_attention, decode_attention_ref

    k, v, table, lens = _paged(batch, ctx, hkv, dim, page)
    q = torch.randn((batch, hq, dim), device="cuda", dtype=BF16)
    scale = dim**-0.5
    out = decode_attention(q, k, v, table, lens, scale, ctx)
    err, ok = _err(out, decode_attention_ref(q, k, v, table, lens, scale), 2e-2)
    # torch baseline: SDPA on K/V already laid out densely (no paging cost at all)
    slots = (table[:, :, None].long() * page + torch.arange(page, device="cuda")).view(batch, -1)[:, :ctx]
    kd = k.view(-1, hkv, dim)[slots].transpose(1, 2).contiguous()  # [B, Hkv, ctx, D]
    vd = v.view(-1, hkv, dim)[slots].transpose(1, 2).contiguous()
    qd = q[:, :, None]  # [B, Hq, 1, D]
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True)
    kv_bytes = 2 * batch * ctx * hkv * dim * 2
    return Row(
        "decode_attention",
        f"B={batch} ctx={ctx} Hq={hq} Hkv={hkv} D={dim} page={page}",
        _bench_us(lambda: decode_attention(q, k, v, table, lens, scale, ctx, out=out)),
        _bench_us(sdpa),
        kv_bytes / 1e9,
        0.0,
        err,
        ok,
        target=0.7 if (batch, ctx) == (64, 4096) else None,
    )


def bench_extend(batch: int, prefix: int, ext: int, hq: int = 32, hkv: int = 8, dim: int = 128) -> Row:
    from pdserve.kernels.extend_attention import extend_attention, extend_attention_ref

    page = 16
    k, v, table, lens = _paged(batch, prefix + ext, hkv, dim, page)
    q = torch.randn((batch * ext, hq, dim), device="cuda", dtype=BF16)
    indptr = torch.arange(0, batch * ext + 1, ext, dtype=torch.int32, device="cuda")
    scale = dim**-0.5
    out = extend_attention(q, k, v, table, indptr, lens, scale, ext)
    err, ok = _err(out, extend_attention_ref(q, k, v, table, indptr, lens, scale), 3e-2)
    # torch baseline: SDPA with a dense prefix+causal mask over contiguous K/V
    slots = (table[:, :, None].long() * page + torch.arange(page, device="cuda")).view(batch, -1)[
        :, : prefix + ext
    ]
    kd = k.view(-1, hkv, dim)[slots].transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    vd = v.view(-1, hkv, dim)[slots].transpose(1, 2).contiguous()
    qd = q.view(batch, ext, hq, dim).transpose(1, 2)  # [B, Hq, ext, D]
    j = torch.arange(prefix + ext, device="cuda")
    mask = j[None, :] <= (prefix + torch.arange(ext, device="cuda"))[:, None]  # [ext, L]
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(
        qd,
        kd,
        vd,
        attn_mask=None if prefix == 0 else mask,
        is_causal=prefix == 0,
        scale=scale,
        enable_gqa=True,
    )
    pairs = batch * (ext * prefix + ext * (ext + 1) / 2)  # visible (query, key) pairs per head
    return Row(
        "extend_attention" if ext > 8 else "extend (verify shape)",
        f"B={batch} prefix={prefix} new={ext} Hq={hq} Hkv={hkv} D={dim}",
        _bench_us(lambda: extend_attention(q, k, v, table, indptr, lens, scale, ext, out=out)),
        _bench_us(sdpa),
        2 * batch * (prefix + ext) * hkv * dim * 2 / 1e9,
        4 * pairs * hq * dim / 1e12,
        err,
        ok,
    )


def bench_small_ops(tokens: int = 8192) -> list[Row]:
    from pdserve.kernels.kv_copy import store_kv, store_kv_ref
    from pdserve.kernels.rmsnorm import rms_norm, rms_norm_ref
    from pdserve.kernels.rotary import apply_rotary_, apply_rotary_ref

    rows = []
    hidden = 4096
    x = torch.randn((tokens, hidden), device="cuda", dtype=BF16)
    r = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=BF16) + 1
    out, res = rms_norm(x, w, 1e-5, residual=r)
    ro, rr = rms_norm_ref(x, w, 1e-5, residual=r)
    err, ok = _err(out, ro, 3e-2)
    err_res, ok_res = _err(res, rr, 1e-2)
    err, ok = max(err, err_res), ok and ok_res
    rows.append(Row("rms_norm+residual", f"T={tokens} N={hidden}",
                    _bench_us(lambda: rms_norm(x, w, 1e-5, residual=r)),
                    _bench_us(lambda: rms_norm_ref(x, w, 1e-5, residual=r)),
                    4 * x.numel() * 2 / 1e9, 0.0, err, ok))  # fmt: skip

    hq, hkv, dim = 32, 8, 128
    q = torch.randn((tokens, hq, dim), device="cuda", dtype=BF16)
    k = torch.randn((tokens, hkv, dim), device="cuda", dtype=BF16)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    freqs = torch.outer(torch.arange(8192, device="cuda").float(), inv)
    cos, sin = freqs.cos(), freqs.sin()
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    wq, wk = apply_rotary_ref(q, k, cos, sin, pos)
    q2, k2 = q.clone(), k.clone()
    apply_rotary_(q2, k2, cos, sin, pos)
    e1, ok1 = _err(q2, wq, 3e-2)
    e2, ok2 = _err(k2, wk, 3e-2)
    rows.append(Row("rotary (in place)", f"T={tokens} Hq={hq} Hkv={hkv} D={dim}",
                    _bench_us(lambda: apply_rotary_(q2, k2, cos, sin, pos)),
                    _bench_us(lambda: apply_rotary_ref(q, k, cos, sin, pos)),
                    2 * (q.numel() + k.numel()) * 2 / 1e9, 0.0, max(e1, e2), ok1 and ok2))  # fmt: skip

    page, pool_pages = 16, tokens // 16 + 64
    kc = torch.randn((pool_pages, page, hkv, dim), device="cuda", dtype=BF16)
    vc = torch.randn_like(kc)
    kn, vn = torch.randn_like(k), torch.randn_like(k)
    loc = torch.randperm(pool_pages * page, device="cuda")[:tokens]
    ek, ev = kc.clone(), vc.clone()
    store_kv(kc, vc, kn, vn, loc)
    store_kv_ref(ek, ev, kn, vn, loc)
    ok = torch.equal(kc, ek) and torch.equal(vc, ev)
    rows.append(Row("store_kv", f"T={tokens} Hkv={hkv} D={dim}",
                    _bench_us(lambda: store_kv(kc, vc, kn, vn, loc)),
                    _bench_us(lambda: store_kv_ref(ek, ev, kn, vn, loc)),
                    2 * 2 * kn.numel() * 2 / 1e9, 0.0, 0.0 if ok else float("inf"), ok))  # fmt: skip
    return rows


def bench_kv_handoff(
    layers: int,
    kv_heads: int,
    dim: int,
    requests: int,
    tokens: int,
    page: int = 16,
    device: str = "cuda",
    chunk_bytes: int | None = None,
) -> list[Row]:
    """The KV hand-off's page gather (sender) and scatter (receiver), request by request, chunk by chunk,
    as kv_transfer/pair_group.py runs them, over a pool in which each request's pages are scattered.
    On CPU (the smoke check) each path runs once, untimed."""
    from pdserve.kv_transfer.config import TransferConfig
    from pdserve.kv_transfer.layout import (
        chunk_pages,
        chunk_ranges,
        chunk_view,
        gather_pages,
        geometry_of,
        scatter_pages,
    )

    per_req = -(-tokens // page)
    num_pages = 2 * requests * per_req + 64  # half the pool holds the requests, spread over all of it
    kv = torch.randn((num_pages, layers, 2, page, kv_heads, dim), device=device, dtype=BF16)
    geometry = geometry_of(kv)
    ids = torch.randperm(num_pages, device=device)[: requests * per_req].view(requests, per_req)
    page_lists = ids.tolist()  # what the transfer gets: a Python list of page ids per request
    chunk_bytes = chunk_bytes or TransferConfig().chunk_bytes
    per_chunk = chunk_pages(geometry, per_req, chunk_bytes)
    ranges = chunk_ranges(per_req, per_chunk)
    staging = [torch.empty(min(per_chunk, per_req) * geometry.page_bytes, dtype=torch.uint8, device=device)
               for _ in range(2)]  # fmt: skip
    for buf in staging:
        buf.random_(0, 256)

    def send_side() -> None:  # PairGroup.send_pages less the sends
        for pages in page_lists:
            dev_ids = torch.tensor(pages, dtype=torch.long, device=kv.device)
            for index, (start, end) in enumerate(ranges):
                gather_pages(kv, dev_ids[start:end], chunk_view(staging[index % 2], geometry, end - start))

    def recv_side() -> None:  # PairGroup.recv_pages less the receives
        for pages in page_lists:
            dev_ids = torch.tensor(pages, dtype=torch.long, device=kv.device)
            for index, (start, end) in enumerate(ranges):
                scatter_pages(kv, dev_ids[start:end], chunk_view(staging[index % 2], geometry, end - start))

    flat = ids.view(-1)
    whole = torch.empty((flat.numel(), *geometry.page_shape), device=device, dtype=BF16)
    one_gather = lambda: gather_pages(kv, flat, whole)
    one_scatter = lambda: scatter_pages(kv, flat, whole)

    gather_ok, scatter_ok = _handoff_exact(kv, ids[0], ranges, staging)
    gbytes = 2 * requests * per_req * geometry.page_bytes / 1e9  # each page read once and written once
    problem = f"L{layers} Hkv{kv_heads} D{dim} P{page}: {requests}x{tokens} tok"
    if requests == 1:
        problem += f", {per_req * geometry.page_bytes / 2**20:.0f} MiB"
    bench = _bench_us if kv.is_cuda else _run_once
    rows = [
        Row("kv gather (send)", problem, bench(send_side), bench(one_gather), gbytes, 0.0,
            0.0 if gather_ok else float("inf"), gather_ok, target=0.8),
        Row("kv scatter (recv)", problem, bench(recv_side), bench(one_scatter), gbytes, 0.0,
            0.0 if scatter_ok else float("inf"), scatter_ok, target=0.8),
    ]  # fmt: skip
    print(
        f"kv hand-off {problem}: page {geometry.page_bytes / 2**10:g} KiB, {per_chunk} pages per "
        f"{chunk_bytes / 2**20:.3g} MiB chunk, {len(ranges)} chunks per request"
    )
    return rows


def _handoff_exact(
    kv: torch.Tensor, pages: torch.Tensor, ranges: list[tuple[int, int]], staging: list[torch.Tensor]
) -> tuple[bool, bool]:
    """Whether one request's `pages`, chunk by chunk over `ranges`, gather into place and scatter back
    through the staging buffers exactly: (gather, scatter)."""
    from pdserve.kv_transfer.layout import chunk_view, gather_pages, geometry_of, scatter_pages

    geometry = geometry_of(kv)
    got = torch.empty((pages.numel(), *geometry.page_shape), device=kv.device, dtype=kv.dtype)
    for start, end in ranges:
        gather_pages(kv, pages[start:end], got[start:end])
    gather_ok = torch.equal(got, kv[pages])
    sent = torch.randn_like(got)
    for index, (start, end) in enumerate(ranges):
        view = chunk_view(staging[index % 2], geometry, end - start)
        view.copy_(sent[start:end])
        scatter_pages(kv, pages[start:end], view)
    return gather_ok, torch.equal(kv[pages], sent)


def _print_table(rows: list[Row], copy_gbs: float) -> bool:
    print(f"{'kernel':<19} {'problem':<42} {'pdserve us':>10} {'torch us':>10} {'GB/s':>7} {'%copy':>6} "
          f"{'TFLOP/s':>8} {'torch GB/s':>10} {'max err':>8}  verdict")  # fmt: skip
    all_ok = True
    for r in rows:
        gbs = r.gbytes / (r.triton_us * 1e-6)
        frac = gbs / copy_gbs
        tflops = f"{r.tflop / (r.triton_us * 1e-6):8.1f}" if r.tflop else f"{'':8}"
        verdict = "ok" if r.ok else "WRONG"
        if r.target is not None:
            verdict += f", target {r.target:.0%} " + ("met" if frac >= r.target else "MISSED")
        all_ok &= r.ok
        print(f"{r.name:<19} {r.problem:<42} {r.triton_us:10.1f} {r.torch_us:10.1f} {gbs:7.0f} {frac:6.0%} "
              f"{tflops} {r.gbytes / (r.torch_us * 1e-6):10.0f} {r.max_err:8.1e}  {verdict}")  # fmt: skip
    return all_ok


def _cpu_smoke() -> None:
    """No GPU: check that two kernels run and agree with torch under the interpreter."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from pdserve.kernels.decode_attention import decode_attention, decode_attention_ref
    from pdserve.kernels.kv_copy import store_kv, store_kv_ref

    k = torch.randn(6, 16, 2, 64)
    v = torch.randn_like(k)
    table = torch.tensor([[3, 1], [5, 0]], dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    q = torch.randn(2, 6, 64)
    err = decode_attention(q, k, v, table, lens, 0.125, 20) - decode_attention_ref(
        q, k, v, table, lens, 0.125
    )
    kc, vc = torch.zeros(6, 16, 2, 64), torch.zeros(6, 16, 2, 64)
    ek, ev = kc.clone(), vc.clone()
    new_k, new_v, loc = torch.randn(3, 2, 64), torch.randn(3, 2, 64), torch.tensor([5, 40, 17])
    store_kv(kc, vc, new_k, new_v, loc)
    store_kv_ref(ek, ev, new_k, new_v, loc)
    same = torch.equal(kc, ek) and torch.equal(vc, ev)
    handoff = bench_kv_handoff(2, 2, 8, 3, 40, page=4, device="cpu", chunk_bytes=1500)
    exact = " / ".join(str(r.ok) for r in handoff)
    print(f"interpreted smoke check: decode max err {err.abs().max().item():.1e}, KV store exact: {same}, "
          f"KV hand-off gather / scatter exact: {exact}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser("pdserve bench kernels", description=__doc__.split("\n\n")[0]).parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device here; the timings need a GPU. Nothing was measured.")
        if os.environ.get("TRITON_INTERPRET", "1") == "1":
            _cpu_smoke()
        return 0
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    copy_gbs = _copy_bandwidth()
    print(f"device: {name}; copy bandwidth (read + write, 2 GiB copy_): {copy_gbs:.0f} GB/s")
    rows = [
        bench_decode(64, 4096),
        bench_decode(8, 32768),
        bench_decode(256, 1024),
        bench_extend(4, 0, 2048),
        bench_extend(8, 1024, 512),
        bench_extend(64, 4096, 4),
        *bench_small_ops(),
        # The KV hand-off: the bundled model's geometry (SmolLM2-135M: 30 layers, 3 KV heads of 64) and
        # an 8B-class one, a 4k-token request each, and a batch of 64 requests handed off one by one.
        *bench_kv_handoff(30, 3, 64, 1, 4096),
        *bench_kv_handoff(30, 3, 64, 64, 1024),
        *bench_kv_handoff(32, 8, 128, 1, 4096),
        *bench_kv_handoff(32, 8, 128, 64, 1024),
    ]
    ok = _print_table(rows, copy_gbs)
    print("GB/s: bytes that must move (attention: the K/V read; kv rows: each page read and written) / the")
    print("first time; %copy: of the copy bandwidth. kv rows: the first time is the hand-off's own loop")
    print("(page list to the device, one gather/scatter per chunk), torch's the same pages in one call.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
