"""Offline throughput: pdserve's Engine against transformers' `generate` on the same prompts.

Every batch size runs ours, then transformers, in turn (`--repeats` times), so machine noise hits
both; the best run of each is reported. Prompts are random token ids from a fixed seed; generation
is greedy with EOS ignored, so both produce exactly `--new-tokens` tokens per prompt. Throughput
is output tokens over the whole `generate` call, prefill included; ours is also shown decode-only.

The `matmul floor` column is what no implementation of this model in this dtype on this machine can
beat: the time of the model's weight matmuls alone (every layer's qkv, o, gate_up and down projections
and the LM head, nothing else), run bare with the model's own weights on the same shapes, for one
prefill of the whole batch plus new_tokens - 1 decode steps.

    pdserve bench engine [--prompt-len 128] [--new-tokens 128] [--batch-sizes 1,8,32] [--skip-hf]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from pdserve.config import QUANT_CHOICES, RuntimeConfig
from pdserve.progress import Counter, stderr
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import LoadedModel, load_model
from pdserve.sampling_params import SamplingParams


@dataclass
class Run:
    seconds: float
    decode_seconds: float | None = None  # after the last first token (ours only)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench engine", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated")
    p.add_argument("--repeats", type=int, default=1, help="alternating runs per batch size; best is kept")
    p.add_argument("--skip-hf", action="store_true", help="only time pdserve's engine")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--quantization",
        default="auto",
        choices=QUANT_CHOICES,
        help="as the workers' flag (auto: a GGUF's own on CPU in bf16; float32 implies none)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu", "triton"],
        help="as the workers' flag (auto: the C++ paged decode kernel on CPU where it builds)",
    )
    p.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="pdserve's decode steps through torch.compile (compiled in the warm-up, before any timing)",
    )
    p.add_argument("--num-threads", type=int, default=None, help="torch threads; default: torch's")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    return args


def make_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ids from 3 up avoid the special tokens at the start of the vocabulary.
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def run_ours(engine: Engine, prompts: list[list[int]], new_tokens: int) -> Run:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    assert all(len(o.output_ids) == new_tokens for o in outs)
    return Run(seconds, seconds - max(o.prefill_seconds for o in outs))


def run_hf(hf, prompts: list[list[int]], new_tokens: int, pad_id: int, device: str) -> Run:
    ids = torch.tensor(prompts, device=device)  # equal lengths: the padded batch has no pad tokens
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            min_new_tokens=new_tokens,
            max_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )
    seconds = time.perf_counter() - t0
    assert out.shape == (len(prompts), ids.shape[1] + new_tokens)
    return Run(seconds)


def weight_projections(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's projection modules, plain or quantized Linear (each has `in_features`)."""
    found = [m for m in model.model.modules() if hasattr(m, "in_features")]
    if not found:
        raise RuntimeError("no projection modules found: the floor would time the LM head alone")
    return found


def _matmul_stack_seconds(
    model: torch.nn.Module, tokens: int, head_rows: int, dtype, device, reps: int
) -> float:
    """Best-of-reps time of the model's weight matmuls for `tokens` rows (the LM head on `head_rows`):
    each projection module run bare, so a quantized model's are timed with the kernel its forward picks
    for that many rows (every decoder module with `in_features`, plain or quantized Linear)."""
    head = model.lm_head_weight
    projections = weight_projections(model)
    xs = {m.in_features: torch.randn(tokens, m.in_features, dtype=dtype, device=device) for m in projections}
    xh = torch.randn(head_rows, head.shape[1], dtype=dtype, device=device)
    quant_head = model.lm_head_quant
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps + 1):  # the first run warms up
            t0 = time.perf_counter()
            for m in projections:
                m(xs[m.in_features])
            if quant_head is not None:
                quant_head(xh)
            else:
                torch.nn.functional.linear(xh, head)
            if device != "cpu":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
    return best


def matmul_floor(loaded: LoadedModel, batch: int, prompt_len: int, new_tokens: int, device: str) -> float:
    """Output tokens/s if generate() took no time beyond its weight matmuls (see the module doc)."""
    model, dtype = loaded.model, loaded.dtype
    prefill = _matmul_stack_seconds(model, batch * prompt_len, batch, dtype, device, reps=1)
    step = _matmul_stack_seconds(model, batch, batch, dtype, device, reps=5)
    return batch * new_tokens / (prefill + (new_tokens - 1) * step)


def make_engine(args: argparse.Namespace, loaded: LoadedModel) -> Engine:
    biggest = max(args.batch_sizes)
    page = RuntimeConfig().page_size
    per_request = -(-(args.prompt_len + args.new_tokens) // page) * page  # whole pages each
    cfg = RuntimeConfig(
        model_path=args.model_path,
        dtype=args.dtype,
        device=args.device,
        max_total_tokens=biggest * per_request + page,
        max_running_requests=max(biggest, 1),
        attention_backend=args.attention_backend,
        enable_torch_compile=args.enable_torch_compile,
    )
    return Engine(cfg, loaded)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    loaded = load_model(args.model_path, args.dtype, args.device, args.quantization)
    engine = make_engine(args, loaded)
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        from pdserve.model_source import resolve_model_source
        from pdserve.runtime.loader import model_folder

        folder = model_folder(resolve_model_source(args.model_path))  # a GGUF's float copy
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=loaded.dtype).to(args.device).eval()
    pad_id = (loaded.spec.eos_token_ids or (0,))[0]
    vocab = loaded.spec.vocab_size

    # Warm-up: first calls pay for allocator growth and lazy initialization.
    warm = make_prompts(vocab, 2, 16, args.seed + 1)
    run_ours(engine, warm, 4)
    if hf is not None:
        run_hf(hf, warm, 4, pad_id, args.device)

    print(
        f"model {loaded.spec.architecture} ({loaded.folder}), dtype {loaded.dtype}, "
        f"quantization {loaded.quantization}, device {args.device}, "
        f"attention {type(engine.runner.backend).__name__}, "
        f"torch.compile {'on' if args.enable_torch_compile else 'off'}, "
        f"torch threads {torch.get_num_threads()}, prompt {args.prompt_len}, new tokens {args.new_tokens}",
        flush=True,
    )
    rows = []
    bar = Counter(len(args.batch_sizes) * args.repeats, "bench engine", stderr, unit="runs")
    for bs in args.batch_sizes:
        prompts = make_prompts(vocab, bs, args.prompt_len, args.seed)
        ours: list[Run] = []
        theirs: list[Run] = []
        for _ in range(args.repeats):
            ours.append(run_ours(engine, prompts, args.new_tokens))
            if hf is not None:
                theirs.append(run_hf(hf, prompts, args.new_tokens, pad_id, args.device))
            bar.update()
        out_tokens = bs * args.new_tokens
        best = min(ours, key=lambda r: r.seconds)
        row = {
            "batch": bs,
            "ours": out_tokens / best.seconds,
            "ours_decode": bs * (args.new_tokens - 1) / max(best.decode_seconds or 0.0, 1e-9),
            "hf": out_tokens / min(r.seconds for r in theirs) if theirs else None,
            "floor": matmul_floor(loaded, bs, args.prompt_len, args.new_tokens, args.device),
        }
        rows.append(row)
        print(f"  batch {bs}: done ({best.seconds:.1f} s ours)", file=sys.stderr, flush=True)

    bar.close()
    print(
        f"{'batch':>5} {'pdserve tok/s':>14} {'(decode only)':>14} {'transformers tok/s':>19} {'ratio':>6} "
        f"{'matmul floor tok/s':>19} {'floor/transformers':>19}"
    )
    for r in rows:
        hf_s = f"{r['hf']:19.1f}" if r["hf"] else f"{'-':>19}"
        ratio = f"{r['ours'] / r['hf']:6.2f}" if r["hf"] else f"{'-':>6}"
        floor_ratio = f"{r['floor'] / r['hf']:19.2f}" if r["hf"] else f"{'-':>19}"
        print(
            f"{r['batch']:>5} {r['ours']:14.1f} {r['ours_decode']:14.1f} {hf_s} {ratio} {r['floor']:19.1f} {floor_ratio}"
        )
    print("output tokens/s over whole generate calls (prefill included); best of", args.repeats, "run(s)")
    print("matmul floor: weight matmuls alone, same shapes and weights; no generate() can be faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
