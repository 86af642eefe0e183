"""`pdserve plan --replay FILE`: the simulator over the very requests a `pdserve bench goodput` run sent.

The benchmark's JSON (`--output-json`, or `--plot`'s goodput.json) records every request: when it was sent,
its prompt's tokens as the server counted them (the chat template's included) and those its prefix cache
held, the output tokens asked for, and its measured TTFT and time to the last token. Replaying those arrivals through the simulator
compares prediction and measurement on the same requests, so that what differs is the model, not two
draws of a Poisson process or a prompt that tokenized longer than its nominal length.

Each pdserve server of the run is replayed at its static split (`--num-prefill` and `--num-decode` of
`--pdserve-args` and its `--launch-pdserve-variant` flags); a variant with `--elastic` changes its split
while it runs and is left out, as is any other server (llama-server, transformers).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
from dataclasses import dataclass
from typing import Any

from pdserve.plan.goodput import Capacity, capacity, goodput
from pdserve.plan.profile import Profile
from pdserve.plan.simulate import MIN_EFFICIENCY, Arrival, Outcome, simulate
from pdserve.plan.simulate import fit_efficiency as bisect_efficiency


class ReplayError(ValueError):
    pass


@dataclass(frozen=True)
class Run:
    """One server's requests at one rate, as measured."""

    server: str
    prefill: int
    decode: int
    rate: float
    arrivals: list[Arrival]
    measured: dict[str, Any]  # the benchmark's row (goodput, attainment, ...)
    ttft: list[float]  # the requests' measured TTFT (inf where one failed), in arrival order
    e2e: list[float]  # ... and time to the last token

    @property
    def split(self) -> str:
        return f"{self.prefill}P{self.decode}D"


def split_of(flags: str) -> tuple[int, int] | None:
    """(prefill, decode) workers of a `pdserve up` with these flags; None for an elastic cluster."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--elastic", action="store_true")
    known, _ = p.parse_known_args(shlex.split(flags))
    return None if known.elastic else (known.num_prefill, known.num_decode)


def parse_split(text: str) -> tuple[str, tuple[int, int]]:
    """`NAME=PxD` as `--replay-split` takes it (`server=1P1D`): the name and (prefill, decode)."""
    name, _, split = text.partition("=")
    m = re.fullmatch(r"(\d+)P(\d+)D", split.strip(), re.IGNORECASE)
    if not name or m is None or min(int(m[1]), int(m[2])) < 1:
        raise ReplayError(f"{text!r} is not NAME=PxD (e.g. server=1P1D)")
    return name, (int(m[1]), int(m[2]))


def load_runs(
    path: str, splits: dict[str, tuple[int, int]] | None = None
) -> tuple[dict[str, Any], list[Run], list[str]]:
    """The run's config, its replayable runs, and the servers left out (with why). `splits` names the
    split of a server the run did not launch (`--base-url`: "server")."""
    try:
        with open(path) as f:
            doc = json.load(f)
        config, results = doc["config"], doc["results"]
        float(config["ttft_slo"]), float(config["tpot_slo"])  # the targets its goodput was judged by
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ReplayError(f"{path}: not a bench goodput JSON ({e})") from None
    base = config.get("pdserve_args") or ""
    flags = {"pdserve": ""} if config.get("launch_pdserve") else {}
    for v in config.get("launch_pdserve_variant") or []:
        name, _, f = v.partition("=")
        flags[name] = f
    runs, skipped = [], []
    for server, rows in results.items():
        if splits and server in splits:
            split: tuple[int, int] | None = splits[server]
        elif server in flags:
            split = split_of(f"{base} {flags[server]}")
        else:
            skipped.append(f"{server}: not a pdserve cluster this run launched (--replay-split names one)")
            continue
        if split is None:
            skipped.append(f"{server}: --elastic changes its split while it runs")
            continue
        for row in rows:
            reqs = row.get("per_request")
            if not reqs:
                raise ReplayError(
                    f"{path}: {server}'s rows carry no requests (a run before --replay existed)"
                )
            runs.append(_run(server, split, row, reqs))
    return config, runs, skipped


def load_many(
    paths: list[str], splits: dict[str, tuple[int, int]] | None = None
) -> tuple[dict[str, Any], list[Run], list[str]]:
    """`load_runs` over several runs of one workload (a rate sweep run in parts): their targets must
    agree; a server's row at a rate that an earlier file also has replaces it (a rerun counts)."""
    config: dict[str, Any] = {}
    runs: dict[tuple[str, float], Run] = {}
    skipped: list[str] = []
    for path in paths:
        c, rs, sk = load_runs(path, splits)
        targets = (float(c["ttft_slo"]), float(c["tpot_slo"]))
        if config and targets != (float(config["ttft_slo"]), float(config["tpot_slo"])):
            raise ReplayError(
                f"{path}: targets TTFT {targets[0]:g} s, TPOT {targets[1]:g} s differ from the first file's "
                f"({config['ttft_slo']:g} s, {config['tpot_slo']:g} s): one goodput needs one pair"
            )
        config = config or c
        for r in rs:
            runs.pop((r.server, r.rate), None)  # the rerun goes last, where its file put it
            runs[(r.server, r.rate)] = r
        skipped += [why for why in sk if why not in skipped]
    return config, list(runs.values()), skipped


def _run(server: str, split: tuple[int, int], row: dict[str, Any], reqs: list[dict[str, Any]]) -> Run:
    known = [r["prompt_tokens"] for r in reqs if r["prompt_tokens"] > 0]
    fallback = round(statistics.mean(known)) if known else 1
    arrivals, ttft, e2e = [], [], []
    for r in reqs:
        out = r["output_tokens"] if r["ok"] and r["output_tokens"] > 0 else r["max_tokens"]
        cached = r.get("cached_tokens", 0)
        arrivals.append(Arrival(r["sent_at"], r["prompt_tokens"] or fallback, max(1, out), cached))
        ttft.append(r["ttft"] if r["ok"] else float("inf"))
        e2e.append(r["e2e"] if r["ok"] else float("inf"))
    t0 = min(a.at for a in arrivals)
    arrivals = [Arrival(a.at - t0, a.prompt, a.output, a.cached) for a in arrivals]
    return Run(server, split[0], split[1], row["rate"], arrivals, row, ttft, e2e)


def predict(profile: Profile, run: Run) -> list[Outcome]:
    return simulate(profile, run.prefill, run.decode, run.arrivals)


def fit_efficiency(profile: Profile, runs: Run | list[Run]) -> float:
    """The shared_efficiency at which the simulated cluster's mean time to the last token over the
    requests that succeeded in `runs` (pooled: one efficiency for all of them) is the measured one
    (bisection; the simulated time falls as e rises). Several runs, at several rates, give a steadier
    efficiency than one: on a busy host one run's fit varies by a third from rate to rate."""
    runs = [runs] if isinstance(runs, Run) else runs
    oks = [[i for i, x in enumerate(run.e2e) if x != float("inf")] for run in runs]
    for run, ok in zip(runs, oks):
        if not ok:
            raise ReplayError(f"{run.server} at {run.rate:g}/s: no request succeeded, nothing to fit to")
    measured = statistics.mean(run.e2e[i] for run, ok in zip(runs, oks) for i in ok)

    def mean_e2e(e: float) -> float:
        profile.shared_efficiency = e
        times = []
        for run, ok in zip(runs, oks):
            outs = predict(profile, run)
            times += [outs[i].done - outs[i].arrival for i in ok]
        return statistics.mean(times)

    if mean_e2e(MIN_EFFICIENCY) < measured:  # too few overlapping forwards for any efficiency to explain it
        names = ", ".join(f"{run.server} at {run.rate:g}/s" for run in runs)
        raise ReplayError(
            f"{names}: its requests took {measured:.3g} s on average to their last "
            f"token, the profile gives at most {mean_e2e(MIN_EFFICIENCY):.3g} s at any shared efficiency "
            "(too few forwards overlap there, or the profile is faster than the cluster): fit to a busier run"
        )
    return bisect_efficiency(mean_e2e, measured)


def fit_runs(runs: list[Run], spec: str) -> list[Run]:
    """The runs `--replay-fit` names: SERVER@RATE, several comma-separated, or SERVER@* for every rate
    of that server. ReplayError naming the runs there are if one names none."""
    chosen: list[Run] = []
    for part in spec.split(","):
        server, _, rate = part.strip().rpartition("@")
        found = [r for r in runs if r.server == server and (rate == "*" or f"{r.rate:g}" == rate.strip())]
        if not found:
            have = ", ".join(f"{r.server}@{r.rate:g}" for r in runs)
            raise ReplayError(f"{part.strip()}: no such run (the runs are {have})")
        chosen += [r for r in found if r not in chosen]
    return chosen


def _pct(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q / 100 * len(ys)))]


def compare(profile: Profile, runs: list[Run], ttft_slo: float, tpot_slo: float) -> list[dict[str, Any]]:
    """Print, per run, measured against predicted goodput (attainment) and TTFT percentiles; the rows."""
    print(
        f"{'server':>10} {'split':>5} {'rate':>5} {'goodput meas':>13} {'pred':>13} {'error':>7}"
        f" {'TTFT p50 meas/pred':>19} {'p90 meas/pred':>15}"
    )
    rows = []
    for run in runs:
        outs = predict(profile, run)
        g = goodput(outs, ttft_slo, tpot_slo)
        m = run.measured
        err = (g["goodput"] - m["goodput"]) / m["goodput"] if m["goodput"] > 0 else float("inf")
        pred_ttft = [o.ttft for o in outs]
        print(
            f"{run.server:>10} {run.split:>5} {run.rate:>5g} {m['goodput']:>6.2f} ({m['attainment']:.0%})"
            f" {g['goodput']:>6.2f} ({g['attainment']:.0%}) {err:>+7.0%}"
            f" {_pct(run.ttft, 50):>9.2f}/{_pct(pred_ttft, 50):<9.2f} {_pct(run.ttft, 90):>7.2f}/{_pct(pred_ttft, 90):<7.2f}"
        )
        rows.append({"server": run.server, "split": run.split, "rate": run.rate, "measured": m["goodput"],
                     "predicted": g["goodput"], "error": err, "measured_attainment": m["attainment"],
                     "predicted_attainment": g["attainment"]})  # fmt: skip
    return rows


def compare_capacity(rows: list[dict[str, Any]], target: float) -> dict[str, tuple[Capacity, Capacity]]:
    """Print, per server run at two rates or more, DistServe's goodput (the highest rate at which `target`
    of the requests met both SLOs) measured and predicted from the same rates' rows; the pairs by server."""
    by_server: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_server.setdefault(f"{row['server']} {row['split']}", []).append(row)
    out: dict[str, tuple[Capacity, Capacity]] = {}
    for name, runs in by_server.items():
        if len(runs) < 2:
            continue
        meas = capacity([(r["rate"], r["measured_attainment"]) for r in runs], target)
        pred = capacity([(r["rate"], r["predicted_attainment"]) for r in runs], target)
        if not out:
            print(
                f"highest rate with {target:.0%} of requests within both targets (linear between the rates):"
            )
            print(f"{'server':>16} {'measured':>9} {'predicted':>10} {'error':>7}")
        err = f"{(pred.rate - meas.rate) / meas.rate:+7.0%}" if not (meas.bound or pred.bound) else "      -"
        print(f"{name:>16} {meas!s:>9} {pred!s:>10} {err}")
        out[name] = (meas, pred)
    return out
