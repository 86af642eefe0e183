"""What batch-invariant decoding costs: the same model loaded with `--deterministic off` and `on`, in one
process, timed in turn (interleaved, best of --rounds), on the engine's own forwards (no HTTP):
- prefill: one fresh prompt of each --lengths tokens (`max_new_tokens` 1; invariant, every query is a
  row of the paged attention kernel instead of torch's flash attention);
- decode: --batches requests at once, `--decode-tokens` tokens each, as decode steps per second
  (invariant, the quantized kernels at every row count instead of a dense copy or a scratch).
Both models start from the same checkpoint; where `auto` is the same as one of them, it says so.

    pdserve bench deterministic [--dtype auto] [--quantization auto] [--lengths 128 512 2048] [--batches 1 16]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from pdserve.config import RuntimeConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_model
from pdserve.sampling_params import SamplingParams


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench deterministic", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engines: dict[str, Engine] = {}
    for flag in ("off", "on", "auto"):
        loaded = load_model(None, args.dtype, "cpu", args.quantization, flag)
        print(
            f"--deterministic {flag}: {'on' if loaded.batch_invariant else 'off'} ({loaded.batch_invariant_why})"
        )
        if flag == "auto":
            break
        longest = max(max(args.lengths), 64)
        cfg = RuntimeConfig(
            device="cpu",
            max_total_tokens=max(args.batches) * (64 + args.decode_tokens) + 2 * longest + 1024,
            max_running_requests=max(max(args.batches), 2),
            chunked_prefill_size=max(2048, longest),
            disable_radix_cache=True,
            deterministic=flag,
            num_threads=args.threads,
        )
        engines[flag] = Engine(cfg, loaded)
    print(f"model: {loaded.quantization}, {str(loaded.dtype).removeprefix('torch.')}")
    rng = random.Random(0)
    vocab = loaded.spec.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    for e in engines.values():  # warm up: first calls build caches
        e.generate([prompt(64)], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    print(f"{'':<28} {'off':>10} {'on':>10} {'on / off':>9}")
    for n in args.lengths:
        best = {k: float("inf") for k in engines}
        for _ in range(args.rounds):
            for k, e in engines.items():
                p = prompt(n)
                t0 = time.perf_counter()
                e.generate([p], one)
                best[k] = min(best[k], time.perf_counter() - t0)
        print(f"{f'prefill {n} tokens (ms)':<28} {best['off'] * 1e3:>10.1f} {best['on'] * 1e3:>10.1f} "
              f"{best['on'] / best['off']:>8.2f}x")  # fmt: skip
    steps = SamplingParams(max_new_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    for b in args.batches:
        rate = {k: 0.0 for k in engines}
        for _ in range(args.rounds):
            for k, e in engines.items():
                ps = [prompt(32) for _ in range(b)]
                e.generate(ps, one)  # nothing timed: the prefill of other prompts warms the same path
                t0 = time.perf_counter()
                outs = e.generate(ps, steps)
                wall = time.perf_counter() - t0 - sum(o.prefill_seconds for o in outs[:1])
                rate[k] = max(rate[k], b * (args.decode_tokens - 1) / wall)
        print(f"{f'decode batch {b} (tok/s)':<28} {rate['off']:>10.1f} {rate['on']:>10.1f} "
              f"{rate['on'] / rate['off']:>8.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
