"""`pdserve plan`: the prefill/decode split with the best goodput for a workload, predicted by the
simulator (simulate.py) from this host's measured profile (profile.py, measure.py).

    pdserve plan --profile-out host.json                      # measure this host (a minute or two)
    pdserve plan --profile host.json --workers 2 3 --workload prompt-heavy --ttft-slo 2 --tpot-slo 0.2
    pdserve plan --gpu H100-SXM --workers 8 32 128 --rates-per-worker --rates 1 2 4 --max-splits 12
    pdserve plan --gpu H100-SXM --gpu-model llama-3.1-70b --workers 8 --tp-sizes 2 4 8 ...
    pdserve plan --profile host.json --replay goodput.json [--replay-fit 'pdserve@*']

For every split of each --workers count (P prefill + D decode workers, at least one of each) and every
rate of --rates, it simulates --num-prompts Poisson arrivals and prints goodput (requests/s meeting both
targets), SLO attainment and TTFT/TPOT percentiles; then, per worker count, the split whose best rate has
the highest goodput, and the split with DistServe's goodput, the highest rate at which --attainment of the
requests (90%) meet both (linear between the rates). Without --profile it measures the host first; with --gpu it plans on paper, from a
GPU's datasheet figures (datasheet.py: the hand-off at --transfer-gbps), and --workers counts GPUs: with
--tp-sizes each tier's workers may span several (P x TP_p + D x TP_d GPUs, each tier's TP size its own),
labelled e.g. `3P2D tp2/4`. With --replay it simulates a measured `bench goodput` run's own requests
instead and prints predicted against measured (replay.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass

from pdserve.plan.datasheet import GPUS, MODELS, fits, paper_profile
from pdserve.plan.goodput import Capacity, capacity, goodput
from pdserve.plan.profile import Profile
from pdserve.plan.simulate import poisson_workload, simulate

WORKLOADS = {  # name: (prompt tokens, output tokens), lengths drawn in [ratio x len, len]
    "prompt-heavy": (1024, 16),
    "answer-heavy": (64, 256),
    "balanced": (512, 64),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _profile_args(p.add_argument_group("the profile: loaded, measured here, or on paper"))
    _workload_args(p.add_argument_group("the workload and its targets"))
    _search_args(p.add_argument_group("the search"))
    _replay_args(p.add_argument_group("replay of a measured run (instead of a search)"))
    return p


def _profile_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--profile", help="a profile JSON (from --profile-out); default: measure this host now")
    g.add_argument("--profile-out", help="measure this host, save the profile here, and stop")
    g.add_argument(
        "--url",
        help="measure through this running cluster (1 prefill + 1 decode worker, idle) instead of in this "
        "process: its requests' whole cost, HTTP and the workers' loops included",
    )
    g.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--quantization", default="auto")
    g.add_argument(
        "--gpu", choices=sorted(GPUS), help="plan on paper for this GPU (datasheet.py; implies --dedicated)"
    )
    g.add_argument(
        "--gpu-model", choices=sorted(MODELS), default="llama-3.1-8b", help="the model --gpu serves"
    )
    g.add_argument("--transfer-gbps", type=float, default=25.0, help="--gpu: GB/s of one KV hand-off")
    g.add_argument(
        "--tp-sizes",
        type=int,
        nargs="+",
        default=[1],
        help="--gpu: TP sizes a prefill or decode worker may have (each tier picks its own)",
    )


def _workload_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--workload", choices=sorted(WORKLOADS), default="balanced")
    g.add_argument("--input-len", type=int, help="prompt tokens (overrides --workload's)")
    g.add_argument("--output-len", type=int, help="output tokens (overrides --workload's)")
    g.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in [ratio x len, len]")
    g.add_argument(
        "--cached-prefix",
        type=int,
        default=0,
        help="tokens before each prompt that the prefix cache holds (a shared system prompt): read, not "
        "computed, at the profile's prefix_s cost",
    )
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    g.add_argument("--tpot-slo", type=float, default=0.2, help="seconds per output token after the first")
    g.add_argument(
        "--attainment",
        type=float,
        default=0.9,
        help="the share of requests within both targets that DistServe's goodput asks of a rate: the "
        "highest such rate is printed per split (linear between the rates tried)",
    )


def _search_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--workers", type=int, nargs="+", default=[2, 3], help="worker counts to split")
    g.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1, 2, 4])
    g.add_argument(
        "--rates-per-worker",
        action="store_true",
        help="--rates are per worker (per GPU with --gpu): x each count",
    )
    g.add_argument(
        "--max-splits", type=int, help="simulate at most this many splits per count, evenly spaced"
    )
    g.add_argument("--dedicated", action="store_true", help="each worker on a device of its own (GPUs)")


def _replay_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--replay",
        metavar="FILE",
        nargs="+",
        help="instead of a search: simulate again the requests of a `pdserve bench goodput` run (its "
        "--output-json, or --plot's goodput.json) and print predicted against measured (replay.py); "
        "several files: one rate sweep run in parts, a later file's server and rate replacing an earlier's",
    )
    g.add_argument(
        "--replay-split",
        metavar="NAME=PxD",
        action="append",
        default=[],
        help="--replay: the split of a server the run did not launch (--base-url's is named server), "
        "e.g. server=1P1D",
    )
    g.add_argument(
        "--replay-fit",
        metavar="SERVER@RATE",
        help="--replay: first fit the profile's shared efficiency to that run (e.g. pdserve@0.75), to "
        "several pooled (pdserve@0.5,pdserve@0.75), or to every rate of a server (pdserve@*: steadier "
        "than one run); with --profile-out, save the profile so refitted",
    )


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


def _spaced(xs: list[int], most: int | None) -> list[int]:
    """`xs`, or at most `most` of them evenly spaced (the first and last kept)."""
    if most is None or len(xs) <= most:
        return xs
    return sorted({xs[round(i * (len(xs) - 1) / (most - 1))] for i in range(most)})


@dataclass(frozen=True)
class Layout:
    """P prefill workers of TP size tp_p and D decode workers of TP size tp_d."""

    p: int
    d: int
    tp_p: int = 1
    tp_d: int = 1

    def label(self) -> str:
        base = f"{self.p}P{self.d}D"
        return base if self.tp_p == self.tp_d == 1 else f"{base} tp{self.tp_p}/{self.tp_d}"


def layouts(n: int, tp_sizes: list[int], most: int | None) -> list[Layout]:
    """Every layout of `n` devices (at most `most` prefill counts per pair of TP sizes, evenly spaced)."""
    out = []
    for tp_p in tp_sizes:
        for tp_d in tp_sizes:
            counts = [
                p for p in range(1, n // tp_p + 1) if n - p * tp_p >= tp_d and (n - p * tp_p) % tp_d == 0
            ]
            out += [Layout(p, (n - p * tp_p) // tp_d, tp_p, tp_d) for p in _spaced(counts, most)]
    return out


def plan(
    profiles: dict[int, Profile], args: argparse.Namespace
) -> dict[int, tuple[Layout, dict[str, float]]]:
    """Prints the table; returns, per device count, the best layout and its best rate's row. `profiles`:
    a worker's profile per TP size (a host's: TP 1 only)."""
    prompt, output = WORKLOADS[args.workload]
    prompt, output = args.input_len or prompt, args.output_len or output
    first = next(iter(profiles.values()))
    print(f"profile: {first.host}; {first.model}, {first.dtype}, quantization {first.quantization}")
    for note in first.notes:
        print(f"  {note}")
    for profile in list(profiles.values())[1:]:  # another TP size: its own notes
        for note in profile.notes:
            if note not in first.notes:
                print(f"  {note}")
    print(
        f"workload: prompts {int(prompt * args.range_ratio)}-{prompt} tokens"
        + (f" after a cached prefix of {args.cached_prefix}" if args.cached_prefix else "")
        + f", outputs {int(output * args.range_ratio)}-{output}, {args.num_prompts} Poisson arrivals per rate; targets TTFT "
        f"{args.ttft_slo} s, TPOT {args.tpot_slo} s; {'a device per worker' if args.dedicated else 'one host, shared cores'}"
    )
    print(
        f"{'split':>14} {'rate':>6} {'goodput':>8} {'attain':>7} {'TTFT p50':>9} {'p90':>7} {'TPOT p50':>9} {'p90':>7}"
    )
    best: dict[int, tuple[Layout, dict[str, float]]] = {}
    ranked: dict[
        int, tuple[float, float]
    ] = {}  # device count -> the best layout's (goodput, summed over rates)
    capacities: dict[int, tuple[Layout, tuple[float, bool], Capacity]] = {}  # count -> the highest's
    for n in args.workers:
        for lay in layouts(n, sorted(profiles), args.max_splits):
            rows = []
            for rate in [r * n for r in args.rates] if args.rates_per_worker else args.rates:
                arrivals = poisson_workload(
                    rate, args.num_prompts, prompt, output, args.seed, args.range_ratio, args.cached_prefix
                )
                outs = simulate(
                    profiles[lay.tp_p], lay.p, lay.d, arrivals, not args.dedicated, profiles[lay.tp_d]
                )
                g = goodput(outs, args.ttft_slo, args.tpot_slo) | {"rate": rate}
                ttft, tpot = [o.ttft for o in outs], [o.tpot for o in outs if o.output > 1] or [0.0]
                print(
                    lay.label().rjust(14)
                    + f" {rate:>6g} {g['goodput']:>8.3f} {g['attainment']:>7.0%} {_pct(ttft, 50):>9.3f}"
                    f" {_pct(ttft, 90):>7.3f} {_pct(tpot, 50):>9.4f} {_pct(tpot, 90):>7.4f}"
                )
                rows.append(g)
            cap = capacity([(g["rate"], g["attainment"]) for g in rows], args.attainment)
            print(f"{lay.label():>14} highest rate with {args.attainment:.0%} within targets: {cap} req/s")
            if n not in capacities or (cap.rate, cap.bound != "<") > capacities[n][1]:
                capacities[n] = (lay, (cap.rate, cap.bound != "<"), cap)
            # The best layout has the highest goodput at its best rate; between equals, the one that keeps
            # more of it at the other rates (the more robust to a rate it was not planned for).
            top = max(rows, key=lambda g: (g["goodput"], -g["rate"]))
            key = (round(top["goodput"], 6), sum(g["goodput"] for g in rows))
            if n not in ranked or key > ranked[n]:
                ranked[n], best[n] = key, (lay, top)
    unit = "GPUs" if args.gpu else "workers"
    for n, (lay, g) in best.items():
        print(
            f"best split of {n} {unit}: {lay.label()}, goodput {g['goodput']:.3f} req/s at {g['rate']:g} req/s"
            f" ({g['goodput'] / n:.3f} per {unit[:-1]})"
        )
        lay, _, cap = capacities[n]
        print(
            f"  highest rate with {args.attainment:.0%} within targets (DistServe's goodput): {lay.label()},"
            f" {cap} req/s ({cap.rate / n:.3f} per {unit[:-1]})"
        )
    return best


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.workers):
        parser.error("--workers: a split needs at least 2 workers (one prefill, one decode)")
    if args.num_prompts < 1 or min(args.rates) <= 0 or not 0 < args.range_ratio <= 1:
        parser.error("--num-prompts must be >= 1, --rates > 0 and --range-ratio in (0, 1]")
    if not 0 < args.attainment <= 1:
        parser.error("--attainment must be in (0, 1]")
    if args.cached_prefix < 0:
        parser.error("--cached-prefix must be >= 0")
    if args.max_splits is not None and args.max_splits < 2:
        parser.error("--max-splits must be >= 2")
    if args.transfer_gbps <= 0:
        parser.error("--transfer-gbps must be > 0")
    if min(args.tp_sizes) < 1 or (args.tp_sizes != [1] and not args.gpu):
        parser.error("--tp-sizes: sizes >= 1, and other than 1 only with --gpu (a host's profile is TP 1's)")
    if args.replay and args.gpu:
        parser.error("--replay compares a host's run: not with --gpu")
    if args.replay_fit and not args.replay:
        parser.error("--replay-fit needs --replay")
    if args.replay and args.profile_out and not (args.profile and args.replay_fit):
        parser.error("--replay with --profile-out saves a --profile refitted by --replay-fit: give both")
    if args.gpu:
        sizes = [t for t in sorted(set(args.tp_sizes)) if fits(args.gpu, args.gpu_model, t)]
        if not sizes:
            parser.error(f"{args.gpu_model} in bf16 does not fit {args.gpu} at TP {args.tp_sizes}")
        try:
            profiles = {t: paper_profile(args.gpu, args.gpu_model, args.transfer_gbps, t) for t in sizes}
        except ValueError as e:
            parser.error(str(e))
        args.dedicated = True
        plan(profiles, args)
        return 0
    elif args.profile:
        try:
            profile = Profile.load(args.profile)
        except (OSError, ValueError, TypeError) as e:
            parser.error(f"--profile {args.profile}: {e}")
    else:
        from pdserve.config import RuntimeConfig
        from pdserve.plan.measure import measure
        from pdserve.plan.measure_cluster import measure_cluster

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
    if args.replay:
        return _replay(parser, profile, args)
    plan({1: profile}, args)
    return 0


def _replay(parser: argparse.ArgumentParser, profile: Profile, args: argparse.Namespace) -> int:
    from pdserve.plan.replay import (
        ReplayError,
        compare,
        compare_capacity,
        fit_efficiency,
        fit_runs,
        load_many,
        parse_split,
    )

    try:
        splits = dict(parse_split(s) for s in args.replay_split)
        config, runs, skipped = load_many(args.replay, splits)
    except ReplayError as e:
        parser.error(f"--replay {e}")
    for why in skipped:
        print(f"left out: {why}")
    if not runs:
        parser.error(f"--replay {' '.join(args.replay)}: no pdserve cluster of a static split to replay")
    print(f"profile: {profile.host}; {profile.model}; shared efficiency {profile.shared_efficiency:g}")
    if args.replay_fit:
        try:
            chosen = fit_runs(runs, args.replay_fit)
            fitted = fit_efficiency(profile, chosen)
        except ReplayError as err:
            parser.error(f"--replay-fit {err}")
        profile.shared_efficiency = fitted
        names = ", ".join(f"{r.server}@{r.rate:g}" for r in chosen)
        print(f"shared efficiency fitted to {names} ({len(chosen)} runs pooled): {fitted:g}")
        if args.profile_out:  # the refitted profile, for the searches to come
            profile.notes = [n for n in profile.notes if not n.startswith("shared_efficiency fitted")]
            profile.notes.append(
                f"shared_efficiency fitted to {args.replay_fit} of "
                f"{' '.join(os.path.basename(f) for f in args.replay)} "
                "(pdserve plan --replay-fit: a bench goodput run's own requests)"
            )
            profile.save(args.profile_out)
            print(f"profile saved to {args.profile_out}")
    ttft_slo, tpot_slo = config["ttft_slo"], config["tpot_slo"]
    print(f"targets (the run's): TTFT {ttft_slo:g} s, TPOT {tpot_slo:g} s")
    rows = compare(profile, runs, ttft_slo, tpot_slo)
    compare_capacity(rows, args.attainment)
    return 0
