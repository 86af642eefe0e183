"""Speculative decoding benchmark: decode throughput and inter-token latency with and without it.

    pdserve bench spec [--concurrency 1 4 16] [--max-new-tokens 128] [--algorithm NGRAM]

Runs the offline engine (prefill and decode on one model, the decode step being the decode node's
stepper) on three workloads: "repeat" (repeat a list), "code" (fix a bug and print the whole
code), both of whose answers copy the prompt, and free-form "chat". For each workload and
concurrency, the same greedy requests run once without speculation and once with it, all
submitted together (`--repeats` alternating runs each, the best kept: noise on a shared machine
only ever slows a run); the outputs must be identical. Reported per run:
- decode tok/s: tokens after the first / (last finish - last first token): the decode phase only,
  since prefill is identical in both runs;
- median TPOT: per request (finish - first token) / (tokens - 1), the median over requests;
- accept length (tokens per verify forward) and accept rate (accepted / proposed drafts).
Targets: >= 1.6x decode tok/s at concurrency 1 on repetitive prompts, never below 0.95x.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.config import RuntimeConfig
from pdserve.sampling_params import SamplingParams

LISTS = [
    [
        "apple",
        "banana",
        "cherry",
        "date",
        "elderberry",
        "fig",
        "grape",
        "honeydew",
        "kiwi",
        "lemon",
        "mango",
        "plum",
    ],
    [
        "Paris",
        "Berlin",
        "Madrid",
        "Rome",
        "Vienna",
        "Prague",
        "Lisbon",
        "Warsaw",
        "Dublin",
        "Oslo",
        "Athens",
        "Bern",
    ],
    [
        "red",
        "orange",
        "yellow",
        "green",
        "blue",
        "indigo",
        "violet",
        "black",
        "white",
        "gray",
        "pink",
        "brown",
    ],
    ["cat", "dog", "horse", "cow", "sheep", "goat", "pig", "duck", "goose", "rabbit", "mouse", "fox"],
]

CODE = '''def {name}(items):
    """Return the {what} of a list of numbers."""
    total = 0
    for x in items:
        total += x
    return total / len(item)


def main():
    values = [1, 2, 3, 4, 5]
    print({name}(values))


if __name__ == "__main__":
    main()
'''

CHAT = [
    "Tell me a short story about a lighthouse keeper.",
    "What are the main causes of the seasons on Earth?",
    "Give me some tips for learning a new language.",
    "Why is the sky blue?",
    "Describe a good morning routine.",
    "What is the difference between weather and climate?",
    "How do bees make honey?",
    "Explain what a computer program is to a child.",
]


def workload_messages(name: str, n: int) -> list[str]:
    out = []
    for i in range(n):
        if name == "repeat":
            items = LISTS[i % len(LISTS)]
            items = items[i // len(LISTS) % len(items) :] + items[: i // len(LISTS) % len(items)]
            numbered = "\n".join(f"{j + 1}. {x}" for j, x in enumerate(items))
            out.append("Repeat this list exactly, one item per line:\n" + numbered)
        elif name == "code":
            names = ["mean", "average", "avg", "compute_mean"]
            code = CODE.format(name=names[i % len(names)], what=["mean", "average"][i % 2])
            out.append("Fix the bug in this code and output the whole corrected code:\n\n" + code)
        else:
            out.append(CHAT[i % len(CHAT)])
    return out


@dataclass
class RunResult:
    outputs: list[list[int]]
    decode_tok_s: float
    median_tpot_ms: float
    accept_length: float
    accept_rate: float


def run(engine, prompts: list[list[int]], sp: SamplingParams) -> RunResult:
    outs = engine.generate(prompts, sp)
    first = max(o.prefill_seconds for o in outs)
    last = max(o.total_seconds for o in outs)
    decode_tokens = sum(len(o.output_ids) - 1 for o in outs)
    tpots = [
        (o.total_seconds - o.prefill_seconds) / (len(o.output_ids) - 1) for o in outs if len(o.output_ids) > 1
    ]
    verify = sum(o.stats.get("spec_verify_ct", 0) for o in outs)
    proposed = sum(o.stats.get("spec_num_proposed_drafts", 0) for o in outs)
    correct = sum(o.stats.get("spec_num_correct_drafts", 0) for o in outs)
    return RunResult(
        [o.output_ids for o in outs],
        decode_tokens / max(last - first, 1e-9),
        1e3 * statistics.median(tpots) if tpots else 0.0,
        decode_tokens / verify if verify else 1.0,
        correct / proposed if proposed else 0.0,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdserve bench spec", description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--algorithm", default="NGRAM", choices=["NGRAM", "STANDALONE"])
    ap.add_argument("--draft-model-path", default=None)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--workloads", nargs="+", default=["repeat", "code", "chat"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per mode; the best counts")
    return ap.parse_args(argv)


@dataclass
class Engines:
    device: str
    plain: Any
    spec: Any
    encode: Callable[[str], list[int]]  # a user message, chat template applied, as token ids


def make_engines(args: argparse.Namespace) -> Engines:
    """One model loaded once, served by an engine without speculation and one with it."""
    from transformers import AutoTokenizer

    from pdserve.decode.stepper import make_stepper
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.loader import load_model

    base = RuntimeConfig(
        model_path=args.model_path,
        device=args.device,
        num_threads=args.num_threads,
        attention_backend=args.attention_backend,
        max_total_tokens=max(args.concurrency) * (1024 + args.max_new_tokens) + 1024,
    )
    spec_cfg = RuntimeConfig(
        **{
            **base.__dict__,
            "speculative_algorithm": args.algorithm,
            "speculative_num_draft_tokens": args.num_draft_tokens,
            "speculative_draft_model_path": args.draft_model_path,
        }
    )
    loaded = load_model(args.model_path, base.dtype, base.resolved_device())
    tok = AutoTokenizer.from_pretrained(loaded.folder)

    def encode(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        return list(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        )

    plain, spec = Engine(base, loaded), Engine(spec_cfg, loaded, make_stepper)
    return Engines(base.resolved_device(), plain, spec, encode)


def best_runs(
    e: Engines, prompts: list[list[int]], sp: SamplingParams, repeats: int
) -> tuple[RunResult, RunResult]:
    """(plain, speculative), `repeats` alternating runs each, the best kept: a shared machine's noise
    only ever slows a run."""
    runs_a, runs_b = [], []
    for _ in range(repeats):
        runs_a.append(run(e.plain, prompts, sp))
        runs_b.append(run(e.spec, prompts, sp))
    return max(runs_a, key=lambda x: x.decode_tok_s), max(runs_b, key=lambda x: x.decode_tok_s)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    e = make_engines(args)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    warm = [e.encode("Hello")]
    run(e.plain, warm, sp.model_copy(update={"max_new_tokens": 8}))
    run(e.spec, warm, sp.model_copy(update={"max_new_tokens": 8}))

    print(
        f"device={e.device} algorithm={args.algorithm} k={args.num_draft_tokens} "
        f"max_new_tokens={args.max_new_tokens}"
    )
    header = (
        f"{'workload':<8} {'conc':>4} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
        f"{'plain TPOT ms':>13} {'spec TPOT ms':>12} {'acc len':>7} {'acc rate':>8} {'same':>5}"
    )
    print(header)
    worst, repeat_c1 = float("inf"), None
    for wl in args.workloads:
        for c in args.concurrency:
            a, b = best_runs(e, [e.encode(m) for m in workload_messages(wl, c)], sp, args.repeats)
            ratio = b.decode_tok_s / a.decode_tok_s
            worst = min(worst, ratio)
            if wl == "repeat" and c == 1:
                repeat_c1 = ratio
            same = "yes" if a.outputs == b.outputs else "NO"
            print(
                f"{wl:<8} {c:>4} {a.decode_tok_s:>11.1f} {b.decode_tok_s:>10.1f} {ratio:>5.2f}x "
                f"{a.median_tpot_ms:>13.1f} {b.median_tpot_ms:>12.1f} {b.accept_length:>7.2f} "
                f"{b.accept_rate:>8.2f} {same:>5}",
                flush=True,
            )
    print(f"worst ratio {worst:.2f}x (target >= 0.95x)", end="")
    if repeat_c1 is not None:
        print(f"; repeat at concurrency 1: {repeat_c1:.2f}x (target >= 1.6x)")
    else:
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
