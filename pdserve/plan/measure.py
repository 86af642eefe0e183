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

import torch

from pdserve.config import RuntimeConfig
from pdserve.kv_transfer.shm import copy_pages
from pdserve.plan.profile import Profile
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.request import Request
from pdserve.runtime.runner import ModelRunner
from pdserve.sampling_params import SamplingParams

PREFILL_TOKENS = [16, 128, 512, 1024, 2048]
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


def _best(fn: Callable[[], object], rounds: int) -> float:
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
    longest = max(max(PREFILL_TOKENS), max(DECODE_BATCH) * per_request)
    runner = ModelRunner(
        dataclasses.replace(
            cfg,
            max_total_tokens=max(cfg.max_total_tokens or 0, longest + 64),
            max_running_requests=max(cfg.max_running_requests, max(DECODE_BATCH)),
            context_length=max(cfg.context_length or 0, max(PREFILL_TOKENS + DECODE_CONTEXT) + steps + 2),
        )
    )
    rng = random.Random(0)
    vocab = runner.spec.vocab_size
    sp = SamplingParams(max_new_tokens=steps + 1)

    def prefill(n: int) -> None:
        r = Request("p", [rng.randrange(vocab) for _ in range(n)], sp)
        assert runner.reserve(r, n)
        runner.forward(ForwardMode.EXTEND, [r], [r.prompt_ids]).argmax(-1)
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
        prefill(32)  # warm-up: kernels built, first touches
        decode(1, 64)
        prefill_s = [_best(functools.partial(prefill, n), rounds) for n in PREFILL_TOKENS]
        decode_s = [[min(decode(b, c) for _ in range(rounds)) for c in DECODE_CONTEXT] for b in DECODE_BATCH]
        kv = runner.pool.kv
        pages = min(kv.shape[0] // 2, 256)
        dst = torch.empty_like(kv[:pages])
        seconds = _best(lambda: copy_pages(kv, list(range(pages)), dst, list(range(pages))), rounds)
        transfer = seconds / (pages * runner.page_size)
        return Profile(
            host=f"{_cpu_name()}, {os.cpu_count()} cores",
            model=cfg.model_path or "bundled SmolLM2-135M-Instruct",
            dtype=str(runner.geometry.dtype).removeprefix("torch."),
            quantization=runner.loaded.quantization,
            threads=torch.get_num_threads(),
            prefill_tokens=PREFILL_TOKENS,
            prefill_s=prefill_s,
            decode_batch=DECODE_BATCH,
            decode_context=DECODE_CONTEXT,
            decode_s=decode_s,
            transfer_s_per_token=transfer,
            chunked_prefill_size=cfg.chunked_prefill_size,
            max_running_requests=cfg.max_running_requests,
            notes=["measured by pdserve plan --profile-out: one process, every core, no HTTP"],
        )
    finally:
        runner.close()
