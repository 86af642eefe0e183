"""Quantization: accuracy and speed of each `--quantization` mode against the fp32 model, side by side.

For every configuration (dtype:quantization) it prints
- perplexity of the fixed passage in benchmarks/quant_text.py (one forward over the whole passage: the
  quantized modes' dense path, see runtime/quant.py),
- greedy agreement with fp32 over the fixed chat prompts (`--new-tokens` each, EOS ignored, one prompt at a
  time so that every decode step runs the few-row quantized kernels):
  `tokens` is the fraction of positions with the identical token, `prefix` the mean fraction of each
  fp32 output reproduced before the first differing token,
- decode-step time at each batch size (`--prompt-len` random-token prompts), and the prefill time of
  the largest batch; time columns are best-of-`--repeats`, configurations interleaved in every round.

    pdserve bench quant [--configs float32:none,bfloat16:none,bfloat16:w4a16] [--batch-sizes 1,16]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from pdserve.bench.bench_engine import make_prompts, run_ours
from pdserve.bench.quant_text import PASSAGE, PROMPTS
from pdserve.config import RuntimeConfig
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_model
from pdserve.runtime.request import Request
from pdserve.sampling_params import SamplingParams

DEFAULT_CONFIGS = "float32:none,bfloat16:none,bfloat16:w8a16_int8,bfloat16:w8a8_int8,bfloat16:w4a16"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench quant", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated dtype:quantization pairs")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt for agreement")
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    p.add_argument("--batch-sizes", default="1,16", help="decode-step timing, comma-separated")
    p.add_argument("--prompt-len", type=int, default=128, help="timing prompts' length")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads; default: torch's")
    p.add_argument("--skip-accuracy", action="store_true", help="only the step times")
    args = p.parse_args(argv)
    args.configs = [tuple(c.split(":")) for c in args.configs.split(",") if c]
    for c in args.configs:
        if len(c) != 2:
            p.error(f"--configs: {':'.join(c)!r} is not dtype:quantization")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    return args


def make_engine(model_path: str | None, dtype: str, quant: str, max_batch: int) -> Engine:
    loaded = load_model(model_path, dtype, "cpu", quant)
    cfg = RuntimeConfig(
        model_path=model_path,
        dtype=dtype,
        device="cpu",
        max_total_tokens=8192,
        max_running_requests=max(max_batch, len(PROMPTS)),
        disable_radix_cache=True,  # timing runs repeat prompts: every run computes them in full
    )
    return Engine(cfg, loaded)


def perplexity(engine: Engine, ids: list[int]) -> float:
    runner = engine.runner
    req = Request("ppl", ids, SamplingParams(max_new_tokens=1), runner.spec.eos_token_ids)
    if not runner.reserve(req, len(ids)):
        raise RuntimeError("the KV pool cannot hold the passage")
    try:
        logits = runner.forward(ForwardMode.EXTEND, [req], [ids], all_logits=True)
    finally:
        runner.release(req)
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -lp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    return math.exp(nll)


def greedy(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """One prompt at a time: decode steps of one row, the path the few-row kernels serve (batched steps
    from runtime/quant.py's dense_min_rows() rows run the dense copy, as the perplexity forward does)."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [engine.generate([p], params)[0].output_ids for p in prompts]


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(fraction of identical positions, mean fraction of each reference before the first difference)."""
    same = total = 0
    prefix = 0.0
    for a, b in zip(ref, got):
        eq = [x == y for x, y in zip(a, b)]
        same += sum(eq)
        total += len(a)
        first = eq.index(False) if False in eq else len(eq)
        prefix += first / max(len(a), 1)
    return same / max(total, 1), prefix / max(len(ref), 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    from transformers import AutoTokenizer

    engines: dict[str, Engine] = {}
    for dtype, quant in [("float32", "none")] + [c for c in args.configs if c != ("float32", "none")]:
        engines[f"{dtype}:{quant}"] = make_engine(args.model_path, dtype, quant, max(args.batch_sizes))
    ref = engines["float32:none"]
    tok = AutoTokenizer.from_pretrained(ref.runner.loaded.folder)
    passage = tok(PASSAGE).input_ids
    chats = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        ).input_ids
        for p in PROMPTS[: args.num_prompts]
    ]
    vocab = ref.runner.spec.vocab_size
    print(
        f"model {ref.runner.spec.architecture}, torch threads {torch.get_num_threads()}, "
        f"passage {len(passage)} tokens, {len(chats)} prompts x {args.new_tokens} greedy tokens",
        flush=True,
    )

    rows: dict[str, dict[str, float]] = {}
    ref_out = [] if args.skip_accuracy else greedy(ref, chats, args.new_tokens)
    for name, eng in engines.items():
        if args.skip_accuracy:
            rows[name] = {"ppl": math.nan, "tokens": math.nan, "prefix": math.nan}
            continue
        got = ref_out if eng is ref else greedy(eng, chats, args.new_tokens)
        same, prefix = agreement(ref_out, got)
        rows[name] = {"ppl": perplexity(eng, passage), "tokens": same, "prefix": prefix}
        print(f"  {name}: ppl {rows[name]['ppl']:.3f}, tokens {same:.3f}, prefix {prefix:.3f}", flush=True)

    for eng in engines.values():  # warm-up: allocator growth, lazy initialization
        run_ours(eng, make_prompts(vocab, 2, 16, 1), 4)
    for bs in args.batch_sizes:
        prompts = make_prompts(vocab, bs, args.prompt_len, 0)
        for _ in range(args.repeats):
            for name, eng in engines.items():
                run = run_ours(eng, prompts, args.steps + 1)
                assert run.decode_seconds is not None
                step = run.decode_seconds / args.steps * 1e3
                r = rows[name]
                r[f"step{bs}"] = min(r.get(f"step{bs}", math.inf), step)
                if bs == max(args.batch_sizes):
                    pre = (run.seconds - run.decode_seconds) * 1e3
                    r["prefill"] = min(r.get("prefill", math.inf), pre)
        steps = ", ".join(f"{n} {r[f'step{bs}']:.1f} ms" for n, r in rows.items())
        print(f"  batch {bs} decode step: {steps}", flush=True)

    big = max(args.batch_sizes)
    base = rows["float32:none"]
    head = f"{'config':<22} {'ppl':>7} {'tokens':>7} {'prefix':>7}"
    head += "".join(f" {f'step b={b} ms':>13} {'vs fp32':>7}" for b in args.batch_sizes)
    head += f" {f'prefill {big}x{args.prompt_len} ms':>19}"
    print(head)
    for name, r in rows.items():
        line = f"{name:<22} {r['ppl']:7.3f} {r['tokens']:7.3f} {r['prefix']:7.3f}"
        for b in args.batch_sizes:
            line += f" {r[f'step{b}']:13.2f} {base[f'step{b}'] / r[f'step{b}']:6.2f}x"
        line += f" {r['prefill']:19.1f}"
        print(line)
    print(
        "ppl: perplexity of the fixed passage; tokens/prefix: greedy agreement with float32:none; "
        f"step: one decode forward + sampling, best of {args.repeats}; vs fp32: speed-up over float32:none"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
