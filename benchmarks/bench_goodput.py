"""Goodput under latency targets (DistServe's measure): open-loop Poisson arrivals at each of --rates
requests per second, and for each rate the requests per second that met both SLOs, a request's TTFT
within --ttft-slo and its TPOT within --tpot-slo (seconds), with the share that did (SLO attainment).
The best rate's goodput is the server's. Every server runs the same requests in one run, interleaved,
the order alternating per rate; each rate draws prompts of its own (seed + 1000 x its index), so that
none is answered from the prefix cache an earlier rate filled (the workload, target and launch flags are `pdserve bench serving`'s):

    pdserve bench goodput --launch-pdserve --launch-llama-server PATH --rates 1,2,4,8 \\
        --ttft-slo 1.0 --tpot-slo 0.1 --dataset random --random-input-len 512 --random-output-len 64 \\
        --num-prompts 64 --ignore-eos

Arrivals do not wait for earlier answers (at most --max-concurrency in flight, default unbounded): a
server that falls behind builds a queue and misses the TTFT target, as in production. A request that
failed meets no target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from dataclasses import asdict, replace

from pdserve.bench.bench_serving import (
    _model_id,
    _prompts,
    _targets,
    build_parser,
    check_args,
)
from pdserve.bench.launch_servers import launch_all, wait_healthy
from pdserve.bench.serving_requests import RequestResult, RunConfig, Target, run_level, warm_up
from pdserve.bench.serving_workload import load_tokenizer

UNBOUNDED = 1 << 16


def tpot(r: RequestResult) -> float:
    """Seconds per output token after the first (0 for a single-token answer)."""
    return (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def goodput(results: list[RequestResult], duration: float, ttft_slo: float, tpot_slo: float) -> dict:
    """Requests/s within both targets over the run's wall time, and the shares within each."""
    n = len(results)
    ttft_ok = [r.ok and r.ttft <= ttft_slo for r in results]
    tpot_ok = [r.ok and tpot(r) <= tpot_slo for r in results]
    good = sum(a and b for a, b in zip(ttft_ok, tpot_ok))
    return {
        "requests": n,
        "failed": sum(not r.ok for r in results),
        "good": good,
        "duration_s": duration,
        "goodput": good / duration if duration > 0 else 0.0,
        "throughput": sum(r.ok for r in results) / duration if duration > 0 else 0.0,
        "attainment": good / n if n else 0.0,
        "ttft_attainment": sum(ttft_ok) / n if n else 0.0,
        "tpot_attainment": sum(tpot_ok) / n if n else 0.0,
    }


def best(rows: list[dict]) -> dict:
    """The rate with the highest goodput (the lower rate on a tie)."""
    return max(rows, key=lambda r: (r["goodput"], -r["rate"]))


def _workload(args, n: int, tok, seed: int) -> list:
    """`n` prompts drawn with `seed`; with --shift-to IN,OUT the second half has IN-token prompts and
    OUT-token outputs instead (the trace changes shape halfway)."""
    first = _prompts(
        argparse.Namespace(**{**vars(args), "seed": seed}), n - n // 2 if args.shift_to else n, tok
    )
    if not args.shift_to:
        return first
    i, o = args.shift_to
    shifted = {**vars(args), "seed": seed + 500, "random_input_len": i, "random_output_len": o}
    return first + _prompts(argparse.Namespace(**shifted), n // 2, tok)


def _shape(text: str) -> tuple[int, int]:
    try:
        i, o = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not IN,OUT (two token counts)") from None
    if i < 1 or o < 1:
        raise argparse.ArgumentTypeError("IN and OUT must be >= 1")
    return i, o


async def _run(args, targets: list[Target]) -> dict[str, list[dict]]:
    cfg = RunConfig(args.backend, args.temperature, args.request_timeout, args.fresh_connections)
    need_tok = args.dataset == "random" or args.no_usage or args.tokenizer is not None
    tok = load_tokenizer(args.tokenizer) if need_tok else None
    count_tokens = (lambda s: len(tok.encode(s, add_special_tokens=False))) if tok else None
    n = int(str(args.num_prompts).split(",")[0])
    prompts = _workload(args, n, tok, args.seed)
    for i, t in enumerate(targets):
        t = t if t.model else replace(t, model=_model_id(t.url))
        targets[i] = await warm_up(cfg, t, prompts, args.warmup_requests, count_tokens)
    concurrency = int(str(args.max_concurrency).split(",")[0]) if args.max_concurrency else UNBOUNDED
    out: dict[str, list[dict]] = {t.name: [] for t in targets}
    rates = [float(x) for x in args.rates.split(",")]
    for k, rate in enumerate(rates):
        # Prompts of their own at each rate (the same for every server): a rate must not be served from
        # the prefix cache an earlier rate filled.
        level = prompts if k == 0 else _workload(args, n, tok, args.seed + 1000 * k)
        for t in targets if k % 2 == 0 else targets[::-1]:
            res, dur = await run_level(cfg, t, level, concurrency, rate, args.seed + k, count_tokens)
            row = {"rate": rate, **goodput(res, dur, args.ttft_slo, args.tpot_slo)}
            out[t.name].append(row)
            print(
                f"{t.name:>12} rate {rate:6.2f}/s: goodput {row['goodput']:6.2f}/s of {row['throughput']:6.2f}/s "
                f"served, attainment {row['attainment']:6.1%} (TTFT {row['ttft_attainment']:.0%}, "
                f"TPOT {row['tpot_attainment']:.0%}), {row['failed']} failed",
                flush=True,
            )
    return out


def report(results: dict[str, list[dict]], ttft_slo: float, tpot_slo: float) -> str:
    names = list(results)
    lines = [f"== goodput: TTFT <= {ttft_slo:g} s and TPOT <= {tpot_slo:g} s (requests/s; attainment) =="]
    lines.append(f"{'rate/s':>8}" + "".join(f"{n:>22}" for n in names))
    for k, row in enumerate(results[names[0]]):
        cells = "".join(
            f"{results[n][k]['goodput']:>14.2f} ({results[n][k]['attainment']:>4.0%})" for n in names
        )
        lines.append(f"{row['rate']:>8.2f}{cells}")
    tops = {n: best(rows) for n, rows in results.items()}
    lines.append(
        "max goodput: " + ", ".join(f"{n} {b['goodput']:.2f}/s at {b['rate']:g}/s" for n, b in tops.items())
    )
    first = names[0]
    for n in names[1:]:
        if tops[n]["goodput"] > 0:
            lines.append(f"{first} / {n}: {tops[first]['goodput'] / tops[n]['goodput']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = build_parser("pdserve bench goodput", __doc__ or "")
    p.add_argument("--rates", default="1,2,4", help="request rates to sweep (Poisson arrivals per second)")
    p.add_argument("--ttft-slo", type=float, required=True, help="seconds to the first token")
    p.add_argument("--tpot-slo", type=float, required=True, help="seconds per output token after the first")
    p.add_argument(
        "--shift-to",
        type=_shape,
        default=None,
        metavar="IN,OUT",
        help="--dataset random: the second half of each rate's requests has IN-token prompts and OUT-token "
        "outputs (a trace that changes shape halfway, for --elastic)",
    )
    p.set_defaults(max_concurrency="", dataset="random")
    args = check_args(p, p.parse_args(argv))
    if args.dataset == "multiturn" or args.plot:
        p.error("goodput runs single requests (not --dataset multiturn) and draws no plots (--plot)")
    if args.ttft_slo <= 0 or args.tpot_slo <= 0:
        p.error("--ttft-slo and --tpot-slo must be > 0")
    if args.shift_to and args.dataset != "random":
        p.error("--shift-to changes the random dataset's lengths: use it with --dataset random")
    try:
        if any(float(x) <= 0 for x in args.rates.split(",")):
            raise ValueError
    except ValueError:
        p.error(f"--rates {args.rates!r}: a comma list of request rates > 0")
    log_dir = args.launch_log_dir or tempfile.mkdtemp(prefix="pdserve-bench-")
    os.makedirs(log_dir, exist_ok=True)
    launched = launch_all(args, log_dir)
    try:
        for s in launched:
            wait_healthy(s, args.launch_timeout)
        targets = _targets(args, launched)
        results = asyncio.run(_run(args, targets))
    finally:
        for s in launched:
            s.stop()
    print(report(results, args.ttft_slo, args.tpot_slo), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {"config": vars(args), "targets": [asdict(t) for t in targets], "results": results},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
