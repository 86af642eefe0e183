"""Grammar backends for structured output, on the served model's tokenizer: compile and mask costs.

    pdserve bench grammar [--model-path P] [--backends xgrammar,llguidance,outlines-core]

For each backend that is installed: building its tokenizer index, compiling a JSON schema (first
time), then the time to fill one token mask at every step of walking a valid document through the
matcher (mean, median, p90). For pdserve's own backend (runtime/grammar/, xgrammar) also: the
cached compile (a dictionary hit; microseconds) and applying the bitmask to [B, V] logits for B = 1 and 16.
With `--engine-batch-sizes`, the offline engine (bundled model, fp32) decodes B constrained
requests and B free ones: the time per decode step of each, and the share of the constrained
step spent filling and applying masks (timed inside the engine, so machine noise cancels out).
This is how `--grammar-backend xgrammar` was chosen (docs/benchmarks.md). llguidance and
outlines-core are not dependencies: `pip install llguidance outlines-core` to include them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
DOC = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@math.com",
    "tags": ["math", "poetry", "engines"],
    "address": {"city": "London", "zip": "W1"},
    "active": True,
}


def _doc_ids(hf: Any, separators: tuple[str, str]) -> list[int]:
    """DOC as the backend's JSON grammar writes it (xgrammar: ", " and ": "; llguidance: compact)."""
    return list(hf.encode(json.dumps(DOC, separators=separators), add_special_tokens=False))


def _ms(t0: float) -> float:
    return 1e3 * (time.perf_counter() - t0)


def _fills(ids: list[int], fill: Callable[[], object], accept: Callable[[int], object]) -> dict[str, float]:
    times = []
    for t in ids:
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
        if accept(t) is False:  # a refused token would leave the rest measuring an error state
            raise RuntimeError(f"the matcher refused token {t} of the document")
    times.sort()
    return {
        "fill_mean_us": 1e6 * statistics.mean(times),
        "fill_median_us": 1e6 * statistics.median(times),
        "fill_p90_us": 1e6 * times[int(0.9 * len(times))],
    }


def bench_xgrammar(hf: Any, vocab: int, eos: list[int]) -> dict[str, float]:
    ids = _doc_ids(hf, (", ", ": "))
    from pdserve.runtime.grammar import GrammarBackend, apply_grammar_masks

    t0 = time.perf_counter()
    backend = GrammarBackend(hf, vocab, eos)
    out = {"setup_ms": _ms(t0)}
    text = json.dumps(SCHEMA)
    t0 = time.perf_counter()
    backend.compile("json_schema", text)
    out["compile_first_ms"] = _ms(t0)
    t0 = time.perf_counter()
    backend.compile("json_schema", text)
    out["compile_cached_us"] = 1e3 * _ms(t0)
    m = backend.matcher("json_schema", text)
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    out |= _fills(ids, lambda: m.fill_mask(bitmask, 0), m.accept)
    for b in (1, 16):
        matchers = [backend.matcher("json_schema", text) for _ in range(b)]
        logits = torch.randn(b, vocab)
        for _ in range(3):
            apply_grammar_masks(logits, matchers)  # warm-up
        t0 = time.perf_counter()
        for _ in range(20):
            apply_grammar_masks(logits, matchers)
        out[f"mask_batch{b}_us"] = 1e6 * (time.perf_counter() - t0) / 20  # fill B rows + apply
    return out


def bench_llguidance(hf: Any, vocab: int, eos: list[int]) -> dict[str, float]:
    ids = _doc_ids(hf, (",", ":"))
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    out = {"setup_ms": _ms(t0)}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    bitmask = lt.allocate_token_bitmask(1, vocab)
    # Compilation is lazy: the matcher and its first mask are the compile.
    t0 = time.perf_counter()
    lt.fill_next_token_bitmask(llguidance.LLMatcher(tok, grammar), bitmask, 0)
    out["compile_first_ms"] = _ms(t0)
    m = llguidance.LLMatcher(tok, grammar)
    out |= _fills(ids, lambda: lt.fill_next_token_bitmask(m, bitmask, 0), m.consume_token)
    return out


def bench_outlines_core(hf: Any, vocab: int, eos: list[int]) -> dict[str, float]:
    ids = _doc_ids(hf, (",", ":"))
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    t0 = time.perf_counter()
    byte_of = {v: k for k, v in bytes_to_unicode().items()}  # byte-level BPE symbols -> bytes
    entries: dict[bytes, list[int]] = {}
    for s, i in hf.get_vocab().items():
        if i not in eos:
            b = bytes(byte_of[c] for c in s) if all(c in byte_of for c in s) else s.encode()
            entries.setdefault(b, []).append(i)
    vocabulary = Vocabulary(eos[0], entries)
    out = {"setup_ms": _ms(t0)}
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
    out["compile_first_ms"] = _ms(t0)
    guide = Guide(index)
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    out |= _fills(ids, lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), 4), guide.advance)
    return out


ARTICLE = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "summary": {"type": "string"},
        "keywords": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "summary", "keywords"],
}


def bench_engine_share(model_path: str | None, batch: int, new_tokens: int, threads: int) -> dict[str, float]:
    """Decode-step time with and without a JSON schema, and the masks' share of the former."""
    from pdserve.config import RuntimeConfig
    from pdserve.gateway.text.tokenizer import Tokenizer
    from pdserve.runtime import runner as runner_mod
    from pdserve.runtime.engine import Engine
    from pdserve.sampling_params import SamplingParams

    tok = Tokenizer.load(model_path)
    engine = Engine(
        RuntimeConfig(model_path=model_path, dtype="float32", max_total_tokens=16384, num_threads=threads)
    )
    prompts = [
        tok.encode_chat([{"role": "user", "content": f"Write article {i} as JSON."}]) for i in range(batch)
    ]
    masked = {"seconds": 0.0, "calls": 0}
    inner = runner_mod.apply_grammar_masks

    def timed(logits: torch.Tensor, matchers: list) -> None:
        t0 = time.perf_counter()
        inner(logits, matchers)
        masked["seconds"] += time.perf_counter() - t0
        masked["calls"] += 1

    runner_mod.apply_grammar_masks = timed  # type: ignore[assignment]
    out: dict[str, float] = {}
    try:
        for name, schema in (("warmup", ARTICLE), ("free", None), ("json", ARTICLE)):
            sp = SamplingParams(
                max_new_tokens=new_tokens,
                temperature=0.0,
                ignore_eos=True,
                json_schema=None if schema is None else json.dumps(schema),
            )
            masked.update(seconds=0.0, calls=0)
            t0 = time.perf_counter()
            res = engine.generate(prompts, sp)
            seconds = time.perf_counter() - t0
            steps = max(len(r.output_ids) for r in res)  # one decode step per token after the first
            if name != "warmup":
                out[f"{name}_step_ms"] = 1e3 * seconds / steps
                out[f"{name}_tokens"] = sum(len(r.output_ids) for r in res) / batch
        out["mask_ms_per_step"] = 1e3 * masked["seconds"] / max(masked["calls"], 1)
        out["mask_share_pct"] = 100 * out["mask_ms_per_step"] / out["json_step_ms"]
    finally:
        runner_mod.apply_grammar_masks = inner  # type: ignore[assignment]
    return out


BACKENDS = {"xgrammar": bench_xgrammar, "llguidance": bench_llguidance, "outlines-core": bench_outlines_core}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench grammar", description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="tokenizer source (default: the bundled model)")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--engine-batch-sizes", default="", help="e.g. 1,16: the masks' share of a decode step")
    ap.add_argument("--new-tokens", type=int, default=64, help="with --engine-batch-sizes")
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads (masks run on one)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.num_threads)

    from pdserve.gateway.text.tokenizer import Tokenizer

    tok = Tokenizer.load(args.model_path)
    hf, vocab = tok.hf, tok.vocab_size
    eos = [tok.eos_token_id if tok.eos_token_id is not None else 0]
    print(f"vocabulary {vocab} tokens; torch threads {torch.get_num_threads()}")
    results: dict[str, dict[str, float]] = {}
    for name in args.backends.split(","):
        try:
            results[name] = BACKENDS[name](hf, vocab, eos)
        except ImportError as e:
            print(f"{name}: not installed ({e.name})")
            continue
        print(f"{name:14s} " + "  ".join(f"{k} {v:.1f}" for k, v in results[name].items()), flush=True)
    for b in [int(x) for x in args.engine_batch_sizes.split(",") if x]:
        results[f"engine_batch{b}"] = r = bench_engine_share(
            args.model_path, b, args.new_tokens, args.num_threads
        )
        print(f"engine batch {b:3d}  " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
