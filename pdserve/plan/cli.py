"""`pdserve plan`: the prefill/decode split with the best goodput for a workload, predicted by the
simulator (simulate.py) from this host's measured profile (profile.py, measure.py).

    pdserve plan --profile-out host.json                      # measure this host (a minute or two)
    pdserve plan --profile host.json --workers 2 3 --workload prompt-heavy --ttft-slo 2 --tpot-slo 0.2
    pdserve plan --gpu H100-SXM --workers 8 32 128 --rates-per-worker --rates 1 2 4 --max-splits 12

For every split of each --workers count (P prefill + D decode workers, at least one of each) and every
rate of --rates, it simulates --num-prompts Poisson arrivals and prints goodput (requests/s meeting both
targets), SLO attainment and TTFT/TPOT percentiles; then, per worker count, the split whose best rate has
the highest goodput. Without --profile it measures the host first; with --gpu it plans on paper, from a
GPU's datasheet figures (datasheet.py: one worker per GPU, the hand-off at --transfer-gbps).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from pdserve.plan.datasheet import GPUS, MODELS, paper_profile
from pdserve.plan.profile import Profile
from pdserve.plan.simulate import goodput, poisson_workload, simulate

WORKLOADS = {  # name: (prompt tokens, output tokens), lengths drawn in [ratio x len, len]
    "prompt-heavy": (1024, 16),
    "answer-heavy": (64, 256),
    "balanced": (512, 64),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--profile", help="a profile JSON (from --profile-out); default: measure this host now")
    p.add_argument("--profile-out", help="measure this host, save the profile here, and stop")
    p.add_argument(
        "--url",
        help="measure through this running cluster (1 prefill + 1 decode worker, idle) instead of in this "
        "process: its requests' whole cost, HTTP and the workers' loops included",
    )
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 3], help="worker counts to split")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="balanced")
    p.add_argument("--input-len", type=int, help="prompt tokens (overrides --workload's)")
    p.add_argument("--output-len", type=int, help="output tokens (overrides --workload's)")
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in [ratio x len, len]")
    p.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1, 2, 4])
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=0.2, help="seconds per output token after the first")
    p.add_argument("--dedicated", action="store_true", help="each worker on a device of its own (GPUs)")
    p.add_argument(
        "--gpu", choices=sorted(GPUS), help="plan on paper for this GPU (datasheet.py; implies --dedicated)"
    )
    p.add_argument(
        "--gpu-model", choices=sorted(MODELS), default="llama-3.1-8b", help="the model --gpu serves"
    )
    p.add_argument("--transfer-gbps", type=float, default=25.0, help="--gpu: GB/s of one KV hand-off")
    p.add_argument("--rates-per-worker", action="store_true", help="--rates are per worker: x each count")
    p.add_argument(
        "--max-splits", type=int, help="simulate at most this many splits per count, evenly spaced"
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


def _splits(n: int, most: int | None) -> list[int]:
    """Prefill worker counts to try for `n` workers: all of 1..n-1, or at most `most` evenly spaced."""
    if most is None or n - 1 <= most:
        return list(range(1, n))
    return sorted({round(1 + i * (n - 2) / (most - 1)) for i in range(most)})


def plan(profile: Profile, args: argparse.Namespace) -> dict[int, tuple[tuple[int, int], dict[str, float]]]:
    """Prints the table; returns, per worker count, the best split and its best rate's row."""
    prompt, output = WORKLOADS[args.workload]
    prompt, output = args.input_len or prompt, args.output_len or output
    print(f"profile: {profile.host}; {profile.model}, {profile.dtype}, quantization {profile.quantization}")
    for note in profile.notes:
        print(f"  {note}")
    print(
        f"workload: prompts {int(prompt * args.range_ratio)}-{prompt} tokens, outputs "
        f"{int(output * args.range_ratio)}-{output}, {args.num_prompts} Poisson arrivals per rate; targets TTFT "
        f"{args.ttft_slo} s, TPOT {args.tpot_slo} s; {'a device per worker' if args.dedicated else 'one host, shared cores'}"
    )
    print(
        f"{'split':>6} {'rate':>6} {'goodput':>8} {'attain':>7} {'TTFT p50':>9} {'p90':>7} {'TPOT p50':>9} {'p90':>7}"
    )
    best: dict[int, tuple[tuple[int, int], dict[str, float]]] = {}
    ranked: dict[
        int, tuple[float, float]
    ] = {}  # worker count -> the best split's (goodput, summed over rates)
    for n in args.workers:
        for p in _splits(n, args.max_splits):
            split = (p, n - p)
            rows = []
            for rate in [r * n for r in args.rates] if args.rates_per_worker else args.rates:
                arrivals = poisson_workload(
                    rate, args.num_prompts, prompt, output, args.seed, args.range_ratio
                )
                outs = simulate(profile, p, n - p, arrivals, shared=not args.dedicated)
                g = goodput(outs, args.ttft_slo, args.tpot_slo) | {"rate": rate}
                ttft, tpot = [o.ttft for o in outs], [o.tpot for o in outs if o.output > 1] or [0.0]
                print(
                    f"{p}P{n - p}D".rjust(6)
                    + f" {rate:>6g} {g['goodput']:>8.3f} {g['attainment']:>7.0%} {_pct(ttft, 50):>9.3f}"
                    f" {_pct(ttft, 90):>7.3f} {_pct(tpot, 50):>9.4f} {_pct(tpot, 90):>7.4f}"
                )
                rows.append(g)
            # The best split has the highest goodput at its best rate; between equals, the one that keeps
            # more of it at the other rates (the more robust to a rate it was not planned for).
            top = max(rows, key=lambda g: (g["goodput"], -g["rate"]))
            key = (round(top["goodput"], 6), sum(g["goodput"] for g in rows))
            if n not in ranked or key > ranked[n]:
                ranked[n], best[n] = key, (split, top)
    for n, ((p, d), g) in best.items():
        print(f"best split of {n} workers: {p}P{d}D, goodput {g['goodput']:.3f} req/s at {g['rate']:g} req/s")
    return best


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.workers):
        parser.error("--workers: a split needs at least 2 workers (one prefill, one decode)")
    if args.num_prompts < 1 or min(args.rates) <= 0 or not 0 < args.range_ratio <= 1:
        parser.error("--num-prompts must be >= 1, --rates > 0 and --range-ratio in (0, 1]")
    if args.max_splits is not None and args.max_splits < 2:
        parser.error("--max-splits must be >= 2")
    if args.transfer_gbps <= 0:
        parser.error("--transfer-gbps must be > 0")
    if args.gpu:
        try:
            profile = paper_profile(args.gpu, args.gpu_model, args.transfer_gbps)
        except ValueError as e:
            parser.error(str(e))
        args.dedicated = True
    elif args.profile:
        try:
            profile = Profile.load(args.profile)
        except (OSError, ValueError, TypeError) as e:
            parser.error(f"--profile {args.profile}: {e}")
    else:
        from pdserve.config import RuntimeConfig
        from pdserve.plan.measure import measure, measure_cluster

        print("measuring this host's profile...", file=sys.stderr, flush=True)
        if args.url:
            from pdserve.model_source import resolve_model_source
            from pdserve.runtime.loader import load_hf_config, model_folder

            config = load_hf_config(model_folder(resolve_model_source(args.model_path)))
            profile = measure_cluster(args.url.rstrip("/"), config.num_hidden_layers)
        else:
            profile = measure(
                RuntimeConfig(model_path=args.model_path, dtype=args.dtype, quantization=args.quantization)
            )
        if args.profile_out:
            profile.save(args.profile_out)
            print(f"profile saved to {args.profile_out}")
            return 0
    plan(profile, args)
    return 0
