"""The C++ CPU kernels against torch on the bundled model's shapes, side by side in one process.

For each row count it times, best of `--repeats` (interleaved), the weight-only linears against torch's
fp32 GEMM on the same (dequantized) weights, which is what a host without a pdserve kernel, or one that keeps
a dense copy, would run:
- `int4`: the 120 projections' shapes of a decode step (qkv 960x576, o 576x576, gate_up 3072x576, down
  576x1536; 30 layers each), pdserve's `int4_linear` against `F.linear` on the dense fp32 weights, and
  the dequantize-into-a-scratch path (`int4_unpack_t_` + GEMM) that prefill-sized batches take where no
  dense copy is kept, and `int4_linear_a8` (`--quantization w4a8`: int8 activations);
- `int8 head`: the 49152x576 LM head, `int8_linear` against `F.linear`;
- `attention`: the paged decode attention of 30 layers (9 query / 3 KV heads of 64) at a context, the kernel
  against the torch backend's gather + SDPA.
It prints the instruction set the kernels were built for (and the PDSERVE_CPU_ISA cap), so that numbers
from an AVX-512 host capped to `avx2` say so.

    pdserve bench cpu [--rows 1,4,16,64,256] [--context 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_decode_attention, cpu_isa, cpu_library
from pdserve.kernels import cpu_quant_linear as ql
from pdserve.runtime.attention import AttentionBackend
from pdserve.runtime.batch import ForwardBatch
from pdserve.runtime.kv_pool import KVPool
from pdserve.runtime.quant_int4 import int4_grouped
from pdserve.runtime.quant_int8 import int8_per_channel

LAYERS = 30
PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of qkv, o, gate_up, down
HEAD = (49152, 576)


def _best_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each fn's best time of `repeats`, the fns interleaved in every round."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()  # warm
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
    return best


def _linears(rows: list[int], repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        for n, k in PROJECTIONS:
            q, scale, lo = int4_grouped(torch.randn(n, k, generator=g) * 0.05, ql.INT4_GROUP)
            layers.append((ql.pack_int4(q, scale, lo), ql.int4_dense_ref(q, scale, lo), n, k))
    scratch = {(n, k): torch.empty(k, n) for n, k in PROJECTIONS}
    hq, hs = int8_per_channel(torch.randn(*HEAD, generator=g) * 0.05)
    head_packed, head_dense = ql.pack_int8(hq), hq.float() * hs[:, None]
    print(
        "rows  int4 ms  fp32 GEMM ms  ratio  unpack+GEMM ms  int4 a8 ms | int8 head ms  fp32 head ms  ratio"
    )
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in PROJECTIONS} | {HEAD[1]}}
        t = _best_ms(_linear_fns(xs, layers, scratch, (head_packed, hs, head_dense)), repeats)
        print(
            f"{m:4d}  {t['int4']:7.2f}  {t['dense']:12.2f}  {t['dense'] / t['int4']:5.2f}x  {t['unpack']:14.2f}"
            f"  {t['a8']:10.2f} |"
            f" {t['head8']:12.2f}  {t['head32']:12.2f}  {t['head32'] / t['head8']:5.2f}x"
        )


def _linear_fns(
    xs: dict[int, torch.Tensor],
    layers: list[tuple[torch.Tensor, torch.Tensor, int, int]],
    scratch: dict[tuple[int, int], torch.Tensor],
    head: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> dict[str, Callable[[], object]]:
    """One step's linears at the rows of xs, each way."""
    head_packed, head_scale, head_dense = head

    def int4() -> None:
        for packed, _, n, k in layers:
            ql.int4_linear(xs[k], packed, n)

    def int4_a8() -> None:
        for packed, _, n, k in layers:
            ql.int4_linear_a8(xs[k], packed, n)

    def dense() -> None:
        for _, w, _, k in layers:
            F.linear(xs[k], w)

    def unpacked() -> None:
        for packed, _, n, k in layers:
            w_t = scratch[(n, k)]
            ql.int4_unpack_t_(packed, w_t)
            xs[k] @ w_t

    return {
        "int4": int4,
        "a8": int4_a8,
        "dense": dense,
        "unpack": unpacked,
        "head8": lambda: ql.int8_linear(xs[HEAD[1]], head_packed, head_scale),
        "head32": lambda: F.linear(xs[HEAD[1]], head_dense),
    }


def _attention(batches: list[int], context: int, repeats: int) -> None:
    from pdserve.runtime.attention import TorchAttention
    from pdserve.runtime.attention_cpu import CpuAttention
    from pdserve.runtime.batch import ForwardMode
    from pdserve.runtime.kv_pool import KVGeometry

    page = 16
    print(f"batch  attention ms (30 layers, context {context})  torch gather + SDPA ms  ratio")
    for b in batches:
        pages = -(-(context + 1) // page)
        geo = KVGeometry(LAYERS, 3, 64, page, torch.float32)
        pool = KVPool(geo, b * pages + 1)
        pool.kv.normal_()
        perm = torch.randperm(b * pages).tolist()  # the requests' pages scattered over the pool
        tables = [[perm[i * pages + j] for j in range(pages)] for i in range(b)]
        batch = ForwardBatch.build(ForwardMode.DECODE, [[1]] * b, [context] * b, tables, page)
        q, k, v = torch.randn(b, 9, 64), torch.randn(b, 3, 64), torch.randn(b, 3, 64)
        fns = {
            name: _attention_fn(be, batch, pool, (q, k, v))
            for name, be in (("cpu", CpuAttention()), ("torch", TorchAttention()))
        }
        t = _best_ms(fns, repeats)
        print(f"{b:5d}  {t['cpu']:40.2f}  {t['torch']:22.2f}  {t['torch'] / t['cpu']:5.2f}x")


def _attention_fn(
    backend: AttentionBackend,
    batch: ForwardBatch,
    pool: KVPool,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> Callable[[], object]:
    """The attention of one decode step's 30 layers through `backend`."""
    q, k, v = qkv

    def run() -> None:
        backend.prepare(batch, pool)
        for layer in range(LAYERS):
            backend.forward(q, k, v, layer, pool, 0.125)

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench cpu", description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,16,64,256", help="row counts of the linears, comma-separated")
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes of the attention")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if not cpu_library.load() or not all(ql.support()) or not ql.int4_a8_support():
        print("the pdserve_cpu kernels are not built on this host: nothing to compare")
        return 1
    int4 = "bf16" if ql.int4_in_bf16() else "fp32"
    print(
        f"pdserve_cpu kernels: {cpu_library.instruction_set()} registers, int4 products in {int4} "
        f"({cpu_isa.ISA_ENV}={cpu_isa.cap()}); torch {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads; times are best of {args.repeats}, interleaved"
    )
    assert cpu_decode_attention.load()
    _linears([int(r) for r in args.rows.split(",")], args.repeats)
    _attention([int(b) for b in args.batches.split(",")], args.context, args.repeats)
    return 0
