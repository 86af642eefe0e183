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

`--trace FILE` replays a recorded trace instead (benchmarks/goodput_trace.py: Mooncake's JSON lines or
the Azure CSV), its first --num-prompts requests, with their lengths and their arrivals' shape, the clock
scaled so that each of --rates is the mean rate. `--slo-percentile P` adds DistServe's other form: a
rate passes when the P-th percentile of TTFT and of TPOT are within their targets, and the highest
passing rate is reported. `--plot DIR` draws goodput and attainment against the rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, replace

from pdserve.bench.bench_serving import (
    _model_id,
    _prompts,
    _targets,
    build_parser,
    check_args,
)
from pdserve.bench.goodput_trace import TraceError, TraceRow, arrivals_at, load_trace
from pdserve.bench.launch_servers import launch_all, wait_healthy
from pdserve.bench.serving_requests import RequestResult, RunConfig, Target, run_level, warm_up
from pdserve.bench.serving_workload import flat_text, load_tokenizer, prompts_of_lengths

UNBOUNDED = 1 << 16


def tpot(r: RequestResult) -> float:
    """Seconds per output token after the first (0 for a single-token answer)."""
    return (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def percentile(xs: list[float], p: float) -> float:
    """The p-th percentile (0-100) by linear interpolation, as numpy's default; inf for no values."""
    if not xs:
        return float("inf")
    ys = sorted(xs)
    k = (len(ys) - 1) * p / 100.0
    lo = int(k)
    if k == lo:
        return ys[lo]
    return ys[lo] + (ys[lo + 1] - ys[lo]) * (k - lo) if ys[lo + 1] != float("inf") else float("inf")


def goodput(
    results: list[RequestResult],
    duration: float,
    ttft_slo: float,
    tpot_slo: float,
    slo_percentile: float | None = None,
) -> dict:
    """Requests/s within both targets over the run's wall time, and the shares within each; with
    `slo_percentile` P, the P-th percentile TTFT and TPOT (a failed request counts as infinitely late)
    and whether both are within their targets (`passes`)."""
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
        **(_percentiles(results, ttft_slo, tpot_slo, slo_percentile) if slo_percentile else {}),
    }


def _percentiles(results: list[RequestResult], ttft_slo: float, tpot_slo: float, p: float) -> dict:
    inf = float("inf")
    ttft = percentile([r.ttft if r.ok else inf for r in results], p)
    tp = percentile([tpot(r) if r.ok else inf for r in results], p)
    return {"ttft_p": ttft, "tpot_p": tp, "passes": ttft <= ttft_slo and tp <= tpot_slo}


def best_passing(rows: list[dict]) -> dict | None:
    """The highest rate whose percentiles met both targets (DistServe's goodput form), or None."""
    passing = [r for r in rows if r.get("passes")]
    return max(passing, key=lambda r: r["rate"]) if passing else None


def best(rows: list[dict]) -> dict:
    """The rate with the highest goodput (the lower rate on a tie)."""
    return max(rows, key=lambda r: (r["goodput"], -r["rate"]))


def records(
    results: list[RequestResult], prompts: list, count_tokens: Callable[[str], int] | None
) -> list[dict]:
    """Each request as `pdserve plan --replay` simulates it again: when it was sent, its prompt's tokens
    as the server counted them (the chat template's included; the client's count for a failed request,
    0 when there is none) and those its prefix cache held, the output tokens asked for, and what it
    measured."""
    out = []
    for r, p in zip(results, prompts, strict=True):
        prompt = r.prompt_tokens or (count_tokens(flat_text(p)) if count_tokens else 0)
        out.append(
            {
                "sent_at": round(r.sent_at, 4),
                "prompt_tokens": prompt,
                "cached_tokens": r.cached_tokens or 0,  # of those, what the server's prefix cache held
                "max_tokens": p.output_len,
                "output_tokens": r.output_tokens,
                "ok": r.ok,
                "ttft": round(r.ttft, 4),
                "e2e": round(r.e2e, 4),
            }
        )
    return out


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


async def _run(args, targets: list[Target], trace: list[TraceRow] | None) -> dict[str, list[dict]]:
    cfg = RunConfig(args.backend, args.temperature, args.request_timeout, args.fresh_connections)
    need_tok = args.dataset == "random" or args.trace or args.no_usage or args.tokenizer is not None
    tok = load_tokenizer(args.tokenizer) if need_tok else None
    count_tokens = (lambda s: len(tok.encode(s, add_special_tokens=False))) if tok else None
    n = int(str(args.num_prompts).split(",")[0])
    lengths = [(r.input_len, r.output_len) for r in trace] if trace else []

    def workload(seed: int) -> list:
        return prompts_of_lengths(lengths, seed, tok) if trace else _workload(args, n, tok, seed)

    prompts = workload(args.seed)
    for i, t in enumerate(targets):
        t = t if t.model else replace(t, model=_model_id(t.url))
        targets[i] = await warm_up(cfg, t, prompts, args.warmup_requests, count_tokens)
    concurrency = int(str(args.max_concurrency).split(",")[0]) if args.max_concurrency else UNBOUNDED
    out: dict[str, list[dict]] = {t.name: [] for t in targets}
    rates = [float(x) for x in args.rates.split(",")]
    for k, rate in enumerate(rates):
        # Prompts of their own at each rate (the same for every server): a rate must not be served from
        # the prefix cache an earlier rate filled.
        level = prompts if k == 0 else workload(args.seed + 1000 * k)
        arrivals = arrivals_at(trace, rate) if trace else None
        for t in targets if k % 2 == 0 else targets[::-1]:
            res, dur = await run_level(
                cfg, t, level, concurrency, rate, args.seed + k, count_tokens, arrivals
            )
            row = {"rate": rate, **goodput(res, dur, args.ttft_slo, args.tpot_slo, args.slo_percentile)}
            row["per_request"] = records(res, level, count_tokens)
            out[t.name].append(row)
            pct = (
                f", p{args.slo_percentile:g} TTFT {row['ttft_p']:.2f} s TPOT {row['tpot_p'] * 1000:.0f} ms"
                f" ({'passes' if row['passes'] else 'misses'})"
                if args.slo_percentile
                else ""
            )
            print(
                f"{t.name:>12} rate {rate:6.2f}/s: goodput {row['goodput']:6.2f}/s of {row['throughput']:6.2f}/s "
                f"served, attainment {row['attainment']:6.1%} (TTFT {row['ttft_attainment']:.0%}, "
                f"TPOT {row['tpot_attainment']:.0%}), {row['failed']} failed{pct}",
                flush=True,
            )
    return out


def report(
    results: dict[str, list[dict]], ttft_slo: float, tpot_slo: float, slo_percentile: float | None = None
) -> str:
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
    if slo_percentile:
        passing = {n: best_passing(rows) for n, rows in results.items()}
        lines.append(
            f"highest rate with p{slo_percentile:g} TTFT and TPOT within target: "
            + ", ".join(f"{n} {b['rate']:g}/s" if b else f"{n} none" for n, b in passing.items())
        )
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
    p.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="replay a trace's arrivals and lengths (.jsonl: Mooncake's; .csv: the Azure trace's), its "
        "clock scaled to each of --rates",
    )
    p.add_argument(
        "--slo-percentile",
        type=float,
        default=None,
        metavar="P",
        help="also judge each rate by the P-th percentile of TTFT and TPOT (e.g. 90) and report the "
        "highest rate that passes",
    )
    p.set_defaults(max_concurrency="", dataset="random")
    args = check_args(p, p.parse_args(argv))
    if args.dataset == "multiturn":
        p.error("goodput runs single requests (not --dataset multiturn)")
    if args.ttft_slo <= 0 or args.tpot_slo <= 0:
        p.error("--ttft-slo and --tpot-slo must be > 0")
    if args.slo_percentile is not None and not 0 < args.slo_percentile <= 100:
        p.error(f"--slo-percentile {args.slo_percentile:g}: a percentile in (0, 100]")
    if args.shift_to and (args.dataset != "random" or args.trace):
        p.error("--shift-to changes the random dataset's lengths: use it with --dataset random, not --trace")
    trace = None
    if args.trace:
        try:
            trace = load_trace(args.trace, int(str(args.num_prompts).split(",")[0]))
        except (OSError, TraceError) as e:
            p.error(f"--trace: {e}")
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
        results = asyncio.run(_run(args, targets, trace))
    finally:
        for s in launched:
            s.stop()
    print(report(results, args.ttft_slo, args.tpot_slo, args.slo_percentile), flush=True)
    if args.plot:
        from pdserve.bench.plots import write_goodput_plots

        for path in write_goodput_plots(args.plot, results, vars(args)):
            print(f"wrote {path}")
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
