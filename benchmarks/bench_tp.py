"""What tensor parallelism costs or gains on this host: the same model as one process (TP 1) and split
over --tp processes (runtime/tp_layout.py), in turn, on the engine's own forwards (no HTTP):
- prefill: one fresh prompt of each --lengths tokens (max_new_tokens 1), best of --rounds;
- decode: --batches requests at once, --decode-tokens tokens each, as decode tokens per second;
- where a TP forward's time goes: rank 0's seconds in all-reduces, the logits' all-gather and the
  broadcast of each forward's description, as shares of the decode run's time;
- the KV hand-off's extra step: gathering --handoff-tokens tokens' pages from the ranks into the pool
  KV leaves from (a prefill worker) and handing received pages out to them (a decode worker), with
  the bytes each rank moves and the throughput.
Both share the host's cores (TP N: cores / N threads per rank), so on a CPU the split can only add
the collectives' cost; on GPUs each rank has a device of its own. On CPU, TP N runs twice: its ranks
all-reducing through shared memory (the default, runtime/tp_shm.py) and over gloo.

    pdserve bench tp [--tp 3] [--dtype float32] [--lengths 128 512] [--batches 1 8] [--handoff-tokens 1024 4096]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from pdserve.config import RuntimeConfig
from pdserve.plan.measure import best_of
from pdserve.runtime.engine import Engine
from pdserve.runtime.request import Request
from pdserve.sampling_params import SamplingParams


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--tp", type=int, default=3, help="the TP size to compare with 1 (the bundled model: 3)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--handoff-tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--rounds", type=int, default=3)
    return p.parse_args(argv)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def measure(engine: Engine, args: argparse.Namespace, rng: random.Random) -> dict[str, float]:
    out: dict[str, float] = {}
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    engine.generate([_prompt(rng, 32)], one)  # warm-up
    for n in args.lengths:
        run = lambda n=n: engine.generate([_prompt(rng, n)], one)  # noqa: E731
        out[f"prefill {n} tokens (ms)"] = 1e3 * best_of(run, args.rounds)
    tp = engine.runner.tp.group
    for b in args.batches:
        d = SamplingParams(max_new_tokens=1 + args.decode_tokens, temperature=0.0, ignore_eos=True)
        before = dict(tp.seconds) if tp is not None else {}
        t0 = time.perf_counter()
        base = best_of(lambda b=b: engine.generate([_prompt(rng, 16) for _ in range(b)], one), 1)
        full = best_of(lambda b=b, d=d: engine.generate([_prompt(rng, 16) for _ in range(b)], d), 1)
        wall = time.perf_counter() - t0
        out[f"decode batch {b} (tok/s)"] = b * args.decode_tokens / max(full - base, 1e-9)
        if tp is not None:
            for kind in ("all_reduce", "all_gather", "command"):
                out[f"  batch {b}: {kind} share of rank 0's time"] = (tp.seconds[kind] - before[kind]) / wall
    if tp is not None:
        runner = engine.runner
        for n in args.handoff_tokens:
            req = Request("handoff", [0] * n, one)
            if not runner.reserve(req, n):
                continue
            pages = req.pages
            rank_bytes = len(pages) * runner.pool.kv[0].nbytes
            full_bytes = len(pages) * runner.transfer_kv[0].nbytes
            g = best_of(lambda pages=pages: runner.before_send(pages), args.rounds)
            s = best_of(lambda pages=pages: runner.after_receive(pages), args.rounds)
            runner.release(req)
            out[f"hand-off {n} tokens: bytes per rank (MB)"] = rank_bytes / 1e6
            out[f"hand-off {n} tokens: gather (ms)"] = 1e3 * g
            out[f"  gather GB/s ({n} tokens)"] = full_bytes / g / 1e9
            out[f"hand-off {n} tokens: scatter (ms)"] = 1e3 * s
            out[f"  scatter GB/s ({n} tokens)"] = full_bytes / s / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    # On CPU the TP ranks all-reduce through shared memory (runtime/tp_shm.py); gloo's path runs beside it.
    runs = [("TP 1", 1, "shm"), (f"TP {args.tp}", args.tp, "shm")]
    if args.device == "cpu":
        runs.insert(1, (f"TP {args.tp} gloo", args.tp, "gloo"))
    for label, size, allreduce in runs:
        os.environ["PDSERVE_TP_ALLREDUCE"] = allreduce
        longest = max(args.lengths + args.handoff_tokens)
        cfg = RuntimeConfig(
            model_path=args.model_path,
            device=args.device,
            dtype=args.dtype,
            quantization=args.quantization,
            max_total_tokens=max(args.batches) * (32 + args.decode_tokens) + 2 * longest + 1024,
            tp_size=size,
        )
        engine = Engine(cfg)
        try:
            layout = engine.runner.loaded.tp_layout
            print(f"{label}: {layout.describe() if layout else 'one process'}", flush=True)
            results[label] = measure(engine, args, random.Random(size))
        finally:
            engine.runner.close()
    labels = list(results)
    print(f"\n{'':46}" + "".join(f"{lb:>12}" for lb in labels) + "  ratios to TP 1")
    for key in results[labels[-1]]:
        row = [results[lb].get(key) for lb in labels]
        cells = "".join(f"{'':>12}" if v is None else f"{v:12.3f}" for v in row)
        base = row[0]
        ratios = (
            "" if base is None else "  " + " ".join(f"{v / base:5.2f}x" for v in row[1:] if v is not None)
        )
        print(f"{key:46}{cells}{ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
