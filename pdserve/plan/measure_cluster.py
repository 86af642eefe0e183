"""Measure a host's profile (profile.py) through a running cluster's `/generate`, as `pdserve plan
--profile-out --url` does: every point carries what a request costs besides the forward (HTTP, tokens
through the gateway, the workers' loops), and the host's shared efficiency is fitted to open-loop
traces run through the same cluster (measure.py measures the forwards alone, in this process)."""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np

from pdserve.plan.measure import PREFILL_TOKENS, PREFIX_TOKENS, cpu_name
from pdserve.plan.profile import Profile
from pdserve.plan.simulate import Arrival, poisson_workload, simulate
from pdserve.plan.simulate import fit_efficiency as bisect_efficiency
from pdserve.runtime.runner import OFFER_TURN_MIN_TOKENS

# The trace `--url` fits the efficiency to: FIT_N Poisson arrivals of prompts and answers uniform in
# [len / 2, len], at FIT_LOAD of the rate at which lone requests, back to back, would keep the cluster busy.
FIT_N, FIT_LOAD = 24, 0.7


@dataclass(frozen=True)
class ClusterPoints:
    """What `measure_cluster` measures: prompt lengths (alone and after each cached prefix), decode
    batches x contexts, and the fit traces' shapes."""

    prefill_tokens: tuple[int, ...] = tuple(PREFILL_TOKENS)
    prefix_tokens: tuple[int, ...] = tuple(PREFIX_TOKENS)
    batches: tuple[int, ...] = (1, 4, 16, 32)  # answer-heavy traffic runs 20-30 streams a decode worker
    contexts: tuple[int, ...] = (64, 512)
    # The fit traces' longest (prompt, answer): one prompt-heavy, one answer-heavy, fitted pooled.
    fit_shapes: tuple[tuple[int, int], ...] = ((1024, 32), (64, 256))


class ClusterProbe:
    """Requests to one cluster's `/generate`, timed as the client sees them."""

    def __init__(self, url: str, vocab: int, steps: int) -> None:
        self.url, self.vocab, self.steps = url, vocab, steps
        self.rng = random.Random()  # fresh prompts: none may come from the prefix cache of an earlier run

    def stream(
        self,
        n: int,
        out_tokens: int,
        times: list[float],
        prefix: tuple[int, ...] = (),
        counts: list[int] | None = None,
    ) -> None:
        """Stream one request; the time of each chunk since the send into `times` (and the tokens
        produced so far into `counts`: a speculative step may bring several)."""
        ids = [*prefix, *(self.rng.randrange(100, self.vocab) for _ in range(n))]
        sp = {"max_new_tokens": out_tokens, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        with httpx.stream(
            "POST",
            self.url + "/generate",
            json={"input_ids": ids, "sampling_params": sp, "stream": True},
            timeout=300,
        ) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{self.url}/generate answered {r.status_code}: {r.read()[:200]!r}")
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.perf_counter() - t0)
                    if counts is not None:
                        chunk = json.loads(line[6:])
                        counts.append(len(chunk.get("output_ids") or []))

    def ttft(self, n: int, prefix: tuple[int, ...] = ()) -> float:
        times: list[float] = []
        self.stream(n, 1, times, prefix)
        return times[0]

    def ttft_after(self, c: int, n: int) -> float:
        """`n` new tokens after a `c`-token prefix the prefill worker has just cached."""
        prefix = tuple(self.rng.randrange(100, self.vocab) for _ in range(c))
        self.ttft(1, prefix)  # computes the prefix; the prefix cache keeps it
        return self.ttft(n, prefix)

    def step(self, b: int, c: int, prefill: float) -> float:
        """Seconds per token of `b` streams while all of them decode: from the last stream's first
        token to the first stream's last, each stream's tokens over that window, averaged. The
        answers are long enough to outlast the `b` prompts' prefills (`prefill` seconds each), so that
        the window exists and the batch in it is `b` (with answers of `steps` tokens the first streams
        end before the last one starts, and the batch measured is smaller)."""
        # The others' prefills (and 0.1 s of HTTP each) at no less than 20 ms a token of this one.
        prefill = prefill if b > 1 else 0.0
        out = min(self.steps + int(b * (prefill + 0.1) / 0.02), 2048 - c)
        runs: list[list[float]] = [[] for _ in range(b)]
        counts: list[list[int]] = [[] for _ in range(b)]
        threads = [
            threading.Thread(target=self.stream, args=(c, out, runs[i], (), counts[i])) for i in range(b)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        start, end = max(r[0] for r in runs), min(r[-1] for r in runs)
        per_token = []
        for times, n in zip(runs, counts):
            inside = [(t, k) for t, k in zip(times, n) if start <= t <= end]
            if len(inside) > 1 and inside[-1][1] > inside[0][1]:
                per_token.append((inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1]))
        if not per_token:
            raise RuntimeError(f"no window where all {b} streams decoded at once: try more steps")
        return statistics.fmean(per_token)

    def replay(self, arrivals: list[Arrival]) -> list[float]:
        """Each request's time to its last token, `arrivals` sent open-loop at their own times."""
        runs: list[list[float]] = [[] for _ in arrivals]
        threads = [
            threading.Thread(target=self.stream, args=(a.prompt, a.output, runs[i]))
            for i, a in enumerate(arrivals)
        ]
        t0 = time.perf_counter()
        for a, t in zip(arrivals, threads):
            time.sleep(max(0.0, a.at - (time.perf_counter() - t0)))
            t.start()
        for t in threads:
            t.join()
        return [r[-1] for r in runs]


def measure_cluster(
    url: str,
    layers: int,
    vocab: int = 32000,
    rounds: int = 2,
    steps: int = 24,
    points: ClusterPoints = ClusterPoints(),
) -> Profile:
    """The same profile measured through a running cluster's `/generate` (one prefill and one decode
    worker idle but for these requests): a prompt's time to its first token, and the time between
    tokens of `b` streams decoding together. Unlike `measure`, it carries everything a request costs
    besides the forward (HTTP, tokens through the gateway, the workers' loops), as a cluster serves."""
    probe = ClusterProbe(url, vocab, steps)
    probe.ttft(16)  # warm-up
    prefill_tokens, prefixes = list(points.prefill_tokens), list(points.prefix_tokens)
    prefill_s = [min(probe.ttft(n) for _ in range(rounds)) for n in prefill_tokens]
    prefix_s = [
        [min(probe.ttft_after(c, n) for _ in range(rounds)) for n in prefill_tokens] for c in prefixes
    ]
    batches, contexts = list(points.batches), list(points.contexts)
    # each context's prefill time, for a batch's answers to outlast the others' prompts (ClusterProbe.step)
    prefill_at = [float(np.interp(c, prefill_tokens, prefill_s)) for c in contexts]
    decode_s = [
        [min(probe.step(b, c, p) for _ in range(rounds)) for c, p in zip(contexts, prefill_at)]
        for b in batches
    ]
    profile = Profile(
        host=f"{cpu_name()}, {os.cpu_count()} cores (through {url})",
        model="as served",
        dtype="as served",
        quantization="as served",
        threads=0,
        prefill_tokens=prefill_tokens,
        prefill_s=prefill_s,
        prefix_tokens=prefixes,
        prefix_s=prefix_s,
        decode_batch=batches,
        decode_context=contexts,
        decode_s=decode_s,
        transfer_s_per_token=0.0,  # inside the measured time to the first token's successors
        sharing="turns",
        layers=layers,
        offer_min_tokens=OFFER_TURN_MIN_TOKENS,
        notes=[f"measured by pdserve plan --profile-out --url {url}: requests through the cluster"],
    )
    fit_shared_efficiency(profile, probe, points.fit_shapes)
    return profile


def fit_shared_efficiency(profile: Profile, probe: ClusterProbe, shapes: tuple[tuple[int, int], ...]) -> None:
    """Open-loop arrivals, as a cluster is used: prefill and decode forwards overlap, and the serving
    path's own CPU (HTTP, tokens through the gateway, this client) takes its share of the cores. The
    efficiency at which the simulator reproduces the traces' mean time to the last token is the host's.
    The shapes pooled: prefill-heavy overlaps (long prompts offering their turn between layers) and
    decode-heavy ones (many streams, short prompts) slow a host differently; one efficiency for both."""
    traces = [fit_trace(profile, prompt=p, output=o) for p, o in shapes]
    e2e = [t for arrivals in traces for t in probe.replay(arrivals)]
    profile.shared_efficiency = fit_efficiency(profile, traces, statistics.mean(e2e))
    said = " and ".join(f"{p * 3 // 4}-token prompts with {o * 3 // 4}-token answers" for p, o in shapes)
    profile.notes.append(
        f"shared_efficiency fitted to {len(traces)} traces of {FIT_N} Poisson arrivals at {FIT_LOAD:.0%} of the "
        f"lone-request capacity, pooled ({said} on average)"
    )


def fit_trace(profile: Profile, seed: int = 0, prompt: int = 1024, output: int = 32) -> list[Arrival]:
    mean_prompt, mean_output = prompt * 3 / 4, output * 3 / 4
    busy = profile.prefill(int(mean_prompt)) + mean_output * profile.decode(1, mean_prompt)
    return poisson_workload(FIT_LOAD / busy, FIT_N, prompt, output, seed, 0.5)


def fit_efficiency(profile: Profile, traces: list[list[Arrival]], measured_e2e: float) -> float:
    """The shared_efficiency at which the simulated 1P1D cluster's mean time to the last token over every
    request of `traces` is `measured_e2e` (bisection; the simulated time falls as the efficiency rises)."""

    def mean_e2e(e: float) -> float:
        profile.shared_efficiency = e
        times = [o.done - o.arrival for arrivals in traces for o in simulate(profile, 1, 1, arrivals)]
        return sum(times) / len(times)

    return bisect_efficiency(mean_e2e, measured_e2e)
