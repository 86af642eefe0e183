"""Measure a host's profile (profile.py) with the real runner, in this process: the model, dtype and
quantization a worker would run, with every core (as each worker of `pdserve up` has them on CPU)."""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.config import RuntimeConfig
from pdserve.kv_transfer.shm import copy_pages
from pdserve.plan.profile import Profile
from pdserve.plan.simulate import Arrival, poisson_workload, simulate
from pdserve.plan.simulate import fit_efficiency as bisect_efficiency
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.request import Request
from pdserve.runtime.runner import OFFER_TURN_MIN_TOKENS, ModelRunner
from pdserve.sampling_params import SamplingParams

PREFILL_TOKENS = [16, 128, 512, 1024, 2048]
PREFIX_TOKENS = [512, 2048]  # cached prefixes a prefill is measured after
DECODE_BATCH = [1, 4, 16, 48]
DECODE_CONTEXT = [64, 512, 2048]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def best_of(fn: Callable[[], object], rounds: int) -> float:
    """The least seconds `fn()` took over `rounds` calls."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(cfg: RuntimeConfig, rounds: int = 2, steps: int = 4) -> Profile:
    """Prefill forwards of each PREFILL_TOKENS prompt, decode steps at each DECODE_BATCH x DECODE_CONTEXT
    (the context's pages reserved, not computed: a step's time depends on how much KV it reads, not on
    its values), and a page copy between two pools for the hand-off."""
    per_request = -(-(max(DECODE_CONTEXT) + steps + 1) // cfg.page_size) * cfg.page_size  # whole pages
    longest = max(max(PREFIX_TOKENS) + max(PREFILL_TOKENS), max(DECODE_BATCH) * per_request)
    runner = ModelRunner(
        dataclasses.replace(
            cfg,
            max_total_tokens=max(cfg.max_total_tokens or 0, longest + 64),
            max_running_requests=max(cfg.max_running_requests, max(DECODE_BATCH)),
        )
    )
    # the points the model's context allows (past them, the profile extrapolates)
    limit = runner.context_length
    prefill_tokens = [n for n in PREFILL_TOKENS if n <= limit] or [limit]
    contexts = [c for c in DECODE_CONTEXT if c + steps + 1 <= limit] or [limit - steps - 1]
    prefixes = [c for c in PREFIX_TOKENS if c + max(prefill_tokens) <= limit]
    rng = random.Random(0)
    vocab = runner.spec.vocab_size
    sp = SamplingParams(max_new_tokens=steps + 1)

    def prefill(n: int) -> None:
        r = Request("p", [rng.randrange(vocab) for _ in range(n)], sp)
        assert runner.reserve(r, n)
        runner.forward(ForwardMode.EXTEND, [r], [r.prompt_ids]).argmax(-1)
        runner.release(r)

    def prefill_after(c: int, n: int) -> None:
        """`n` new tokens after a cached prefix of `c` (its pages reserved, not computed: the forward
        reads them as it would a cached prefix's)."""
        r = Request("q", [rng.randrange(vocab) for _ in range(c + n)], sp)
        assert runner.reserve(r, c + n)
        r.num_computed = c
        runner.forward(ForwardMode.EXTEND, [r], [r.prompt_ids[c:]]).argmax(-1)
        runner.release(r)

    def decode(b: int, c: int) -> float:
        reqs = [Request(f"d{i}", [1] * c, sp) for i in range(b)]
        for r in reqs:
            assert runner.reserve(r, c + steps + 1)
            r.num_computed = c
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.forward(ForwardMode.DECODE, reqs, [[rng.randrange(vocab)] for _ in reqs]).argmax(-1)
        seconds = (time.perf_counter() - t0) / steps
        for r in reqs:
            runner.release(r)
        return seconds

    try:
        prefill(min(32, limit))  # warm-up: kernels built, first touches
        decode(1, contexts[0])
        prefill_s = [best_of(functools.partial(prefill, n), rounds) for n in prefill_tokens]
        prefix_s = [
            [best_of(functools.partial(prefill_after, c, n), rounds) for n in prefill_tokens]
            for c in prefixes
        ]
        decode_s = [[min(decode(b, c) for _ in range(rounds)) for c in contexts] for b in DECODE_BATCH]
        kv = runner.pool.kv
        pages = min(kv.shape[0] // 2, 256)
        dst = torch.empty_like(kv[:pages])
        seconds = best_of(lambda: copy_pages(kv, list(range(pages)), dst, list(range(pages))), rounds)
        transfer = seconds / (pages * runner.page_size)
        return Profile(
            host=f"{_cpu_name()}, {os.cpu_count()} cores",
            model=cfg.model_path or "bundled SmolLM2-135M-Instruct",
            dtype=str(runner.geometry.dtype).removeprefix("torch."),
            quantization=runner.loaded.quantization,
            threads=torch.get_num_threads(),
            prefill_tokens=prefill_tokens,
            prefill_s=prefill_s,
            prefix_tokens=prefixes,
            prefix_s=prefix_s,
            decode_batch=DECODE_BATCH,
            decode_context=contexts,
            decode_s=decode_s,
            transfer_s_per_token=transfer,
            chunked_prefill_size=cfg.chunked_prefill_size,
            max_running_requests=cfg.max_running_requests,
            sharing="turns",
            layers=runner.spec.num_layers,
            offer_min_tokens=OFFER_TURN_MIN_TOKENS,
            notes=["measured by pdserve plan --profile-out: one process, every core, no HTTP"],
        )
    finally:
        runner.close()


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
    import json
    import statistics
    import threading

    import httpx
    import numpy as np

    rng = random.Random()  # fresh prompts: none may come from the prefix cache of an earlier run

    def stream(
        n: int,
        out_tokens: int,
        times: list[float],
        prefix: tuple[int, ...] = (),
        counts: list[int] | None = None,
    ) -> None:
        """Stream one request; the time of each chunk since the send into `times` (and the tokens
        produced so far into `counts`: a speculative step may bring several)."""
        ids = [*prefix, *(rng.randrange(100, vocab) for _ in range(n))]
        sp = {"max_new_tokens": out_tokens, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        with httpx.stream(
            "POST",
            url + "/generate",
            json={"input_ids": ids, "sampling_params": sp, "stream": True},
            timeout=300,
        ) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{url}/generate answered {r.status_code}: {r.read()[:200]!r}")
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.perf_counter() - t0)
                    if counts is not None:
                        chunk = json.loads(line[6:])
                        counts.append(len(chunk.get("output_ids") or []))

    def ttft(n: int, prefix: tuple[int, ...] = ()) -> float:
        times: list[float] = []
        stream(n, 1, times, prefix)
        return times[0]

    def ttft_after(c: int, n: int) -> float:
        """`n` new tokens after a `c`-token prefix the prefill worker has just cached."""
        prefix = tuple(rng.randrange(100, vocab) for _ in range(c))
        ttft(1, prefix)  # computes the prefix; the prefix cache keeps it
        return ttft(n, prefix)

    def step(b: int, c: int) -> float:
        """Seconds per token of `b` streams while all of them decode: from the last stream's first
        token to the first stream's last, each stream's tokens over that window, averaged. The
        answers are long enough to outlast the `b` prompts' prefills, so that the window exists and
        the batch in it is `b` (with answers of `steps` tokens the first streams end before the last
        one starts, and the batch measured is smaller)."""
        # The others' prefills (and 0.1 s of HTTP each) at no less than 20 ms a token of this one.
        prefill = float(np.interp(c, points.prefill_tokens, prefill_s)) if b > 1 else 0.0
        out = min(steps + int(b * (prefill + 0.1) / 0.02), 2048 - c)
        runs: list[list[float]] = [[] for _ in range(b)]
        counts: list[list[int]] = [[] for _ in range(b)]
        threads = [threading.Thread(target=stream, args=(c, out, runs[i], (), counts[i])) for i in range(b)]
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

    ttft(16)  # warm-up
    prefill_tokens, prefixes = list(points.prefill_tokens), list(points.prefix_tokens)
    prefill_s = [min(ttft(n) for _ in range(rounds)) for n in prefill_tokens]
    prefix_s = [[min(ttft_after(c, n) for _ in range(rounds)) for n in prefill_tokens] for c in prefixes]
    batches, contexts = list(points.batches), list(points.contexts)
    decode_s = [[min(step(b, c) for _ in range(rounds)) for c in contexts] for b in batches]
    profile = Profile(
        host=f"{_cpu_name()}, {os.cpu_count()} cores (through {url})",
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
    # Open-loop arrivals, as a cluster is used: prefill and decode forwards overlap, and the serving path's
    # own CPU (HTTP, tokens through the gateway, this client) takes its share of the cores. The efficiency
    # at which the simulator reproduces the trace's mean time to the last token is the host's.
    # The shapes pooled: prefill-heavy overlaps (long prompts offering their turn between layers) and
    # decode-heavy ones (many streams, short prompts) slow a host differently; one efficiency for both.
    traces = [fit_trace(profile, prompt=p, output=o) for p, o in points.fit_shapes]
    e2e: list[float] = []
    for arrivals in traces:
        runs: list[list[float]] = [[] for _ in arrivals]
        threads = [
            threading.Thread(target=stream, args=(a.prompt, a.output, runs[i]))
            for i, a in enumerate(arrivals)
        ]
        t0 = time.perf_counter()
        for a, t in zip(arrivals, threads):
            time.sleep(max(0.0, a.at - (time.perf_counter() - t0)))
            t.start()
        for t in threads:
            t.join()
        e2e += [r[-1] for r in runs]
    profile.shared_efficiency = fit_efficiency(profile, traces, statistics.mean(e2e))
    shapes = " and ".join(
        f"{p * 3 // 4}-token prompts with {o * 3 // 4}-token answers" for p, o in points.fit_shapes
    )
    profile.notes.append(
        f"shared_efficiency fitted to {len(traces)} traces of {FIT_N} Poisson arrivals at {FIT_LOAD:.0%} of the "
        f"lone-request capacity, pooled ({shapes} on average)"
    )
    return profile


# The trace `--url` fits the efficiency to: FIT_N Poisson arrivals of prompts and answers uniform in
# [len / 2, len], at FIT_LOAD of the rate at which lone requests, back to back, would keep the cluster busy.
FIT_N, FIT_LOAD = 24, 0.7


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
