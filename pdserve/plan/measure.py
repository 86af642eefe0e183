"""Measure a host's profile (profile.py) with the real runner, in this process: the model, dtype and
quantization a worker would run, with every core (as each worker of `pdserve up` has them on CPU).
measure_cluster.py measures the same profile through a running cluster instead."""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import random
import time
from collections.abc import Callable

import torch

from pdserve.config import RuntimeConfig
from pdserve.kv_transfer.shm import copy_pages
from pdserve.plan.profile import Profile
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.request import Request
from pdserve.runtime.runner import OFFER_TURN_MIN_TOKENS, ModelRunner
from pdserve.sampling_params import SamplingParams

PREFILL_TOKENS = [16, 128, 512, 1024, 2048]
PREFIX_TOKENS = [512, 2048]  # cached prefixes a prefill is measured after
DECODE_BATCH = [1, 4, 16, 48]
DECODE_CONTEXT = [64, 512, 2048]


def cpu_name() -> str:
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


class RunnerProbe:
    """Forwards of one runner, timed: prompts alone and after a cached prefix, and decode steps. The pages
    a point needs are reserved, not computed: a forward's time depends on how much KV it reads, not on
    its values."""

    def __init__(self, runner: ModelRunner, steps: int) -> None:
        self.runner, self.steps = runner, steps
        self.rng = random.Random(0)
        self.vocab = runner.spec.vocab_size
        self.sp = SamplingParams(max_new_tokens=steps + 1)

    def prefill(self, n: int) -> None:
        r = Request("p", [self.rng.randrange(self.vocab) for _ in range(n)], self.sp)
        assert self.runner.reserve(r, n)
        self.runner.forward(ForwardMode.EXTEND, [r], [r.prompt_ids]).argmax(-1)
        self.runner.release(r)

    def prefill_after(self, c: int, n: int) -> None:
        """`n` new tokens after a cached prefix of `c` (its pages reserved, not computed: the forward
        reads them as it would a cached prefix's)."""
        r = Request("q", [self.rng.randrange(self.vocab) for _ in range(c + n)], self.sp)
        assert self.runner.reserve(r, c + n)
        r.num_computed = c
        self.runner.forward(ForwardMode.EXTEND, [r], [r.prompt_ids[c:]]).argmax(-1)
        self.runner.release(r)

    def decode(self, b: int, c: int) -> float:
        """Seconds per step of `b` requests of context `c`."""
        reqs = [Request(f"d{i}", [1] * c, self.sp) for i in range(b)]
        for r in reqs:
            assert self.runner.reserve(r, c + self.steps + 1)
            r.num_computed = c
        t0 = time.perf_counter()
        for _ in range(self.steps):
            ids = [[self.rng.randrange(self.vocab)] for _ in reqs]
            self.runner.forward(ForwardMode.DECODE, reqs, ids).argmax(-1)
        seconds = (time.perf_counter() - t0) / self.steps
        for r in reqs:
            self.runner.release(r)
        return seconds

    def transfer_s_per_token(self, rounds: int) -> float:
        """A page copy between two pools, per token: the hand-off's cost."""
        kv = self.runner.pool.kv
        pages = min(kv.shape[0] // 2, 256)
        dst = torch.empty_like(kv[:pages])
        seconds = best_of(lambda: copy_pages(kv, list(range(pages)), dst, list(range(pages))), rounds)
        return seconds / (pages * self.runner.page_size)


def _runner_for(cfg: RuntimeConfig, steps: int) -> ModelRunner:
    """A runner with room for the longest point: the longest prefix and prompt, or the biggest decode
    batch of the longest context, each request in whole pages."""
    per_request = -(-(max(DECODE_CONTEXT) + steps + 1) // cfg.page_size) * cfg.page_size
    longest = max(max(PREFIX_TOKENS) + max(PREFILL_TOKENS), max(DECODE_BATCH) * per_request)
    return ModelRunner(
        dataclasses.replace(
            cfg,
            max_total_tokens=max(cfg.max_total_tokens or 0, longest + 64),
            max_running_requests=max(cfg.max_running_requests, max(DECODE_BATCH)),
        )
    )


def measure(cfg: RuntimeConfig, rounds: int = 2, steps: int = 4) -> Profile:
    """Prefill forwards of each PREFILL_TOKENS prompt, decode steps at each DECODE_BATCH x DECODE_CONTEXT
    (the context's pages reserved, not computed: a step's time depends on how much KV it reads, not on
    its values), and a page copy between two pools for the hand-off."""
    runner = _runner_for(cfg, steps)
    # the points the model's context allows (past them, the profile extrapolates)
    limit = runner.context_length
    prefill_tokens = [n for n in PREFILL_TOKENS if n <= limit] or [limit]
    contexts = [c for c in DECODE_CONTEXT if c + steps + 1 <= limit] or [limit - steps - 1]
    prefixes = [c for c in PREFIX_TOKENS if c + max(prefill_tokens) <= limit]
    probe = RunnerProbe(runner, steps)
    try:
        probe.prefill(min(32, limit))  # warm-up: kernels built, first touches
        probe.decode(1, contexts[0])
        prefill_s = [best_of(functools.partial(probe.prefill, n), rounds) for n in prefill_tokens]
        prefix_s = [
            [best_of(functools.partial(probe.prefill_after, c, n), rounds) for n in prefill_tokens]
            for c in prefixes
        ]
        decode_s = [[min(probe.decode(b, c) for _ in range(rounds)) for c in contexts] for b in DECODE_BATCH]
        return Profile(
            host=f"{cpu_name()}, {os.cpu_count()} cores",
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
            transfer_s_per_token=probe.transfer_s_per_token(rounds),
            chunked_prefill_size=cfg.chunked_prefill_size,
            max_running_requests=cfg.max_running_requests,
            sharing="turns",
            layers=runner.spec.num_layers,
            offer_min_tokens=OFFER_TURN_MIN_TOKENS,
            notes=["measured by pdserve plan --profile-out: one process, every core, no HTTP"],
        )
    finally:
        runner.close()
