"""The offline engine: continuous batching in one process, prefill and decode on one model.

It is the unified reference the disaggregated cluster is measured against, and the core of
`pdserve generate` and `pdserve bench engine`. A step is: schedule, run, post-process, collect.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.config import RuntimeConfig
from pdserve.protocol.records import RequestStats
from pdserve.protocol.vocabulary import FinishReason
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.extend_scheduler import ExtendScheduler
from pdserve.runtime.loader import LoadedModel
from pdserve.runtime.radix_cache import RadixCache
from pdserve.runtime.request import Request, RequestState
from pdserve.runtime.runner import ModelRunner, sample_first_tokens
from pdserve.runtime.stepper import PlainStepper, Stepper
from pdserve.sampling_params import SamplingParams


@dataclass
class GenerateOutput:
    room: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: FinishReason
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    stats: RequestStats = field(default_factory=RequestStats)  # the decode stepper's per-request counters
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Engine:
    def __init__(
        self,
        cfg: RuntimeConfig,
        loaded: LoadedModel | None = None,
        make_stepper: Callable[[ModelRunner], Stepper] | None = None,
    ):
        """`make_stepper` (e.g. `pdserve.decode.stepper.make_stepper`) replaces the plain decode step
        with a decode-node stepper (speculative decoding); runtime does not import decode itself."""
        self.runner = ModelRunner(cfg, loaded)
        self.cfg = cfg
        self.stepper = (make_stepper or PlainStepper)(self.runner)
        # Admission reserves prompt + max_new_tokens, so a running request never runs out of
        # pages and this engine needs no retraction. A finished request's prompt pages stay in the
        # prefix cache for later prompts that start the same way.
        self.cache = None if cfg.disable_radix_cache else RadixCache(self.runner.allocator, cfg.page_size)
        self.extend = ExtendScheduler(
            self.runner.pages,
            cfg.chunked_prefill_size,
            cfg.max_running_requests,
            reserve_tokens=lambda r: r.max_total_tokens,
            cache=self.cache,
        )
        self.running: list[Request] = []
        self._ids = itertools.count()
        self._times: dict[str, list[float]] = {}

    def add_request(self, prompt_ids: list[int], params: SamplingParams, room: str | None = None) -> str:
        self.runner.check_fits(len(prompt_ids), params.max_new_tokens)
        vocab = self.runner.spec.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        grammar = self.runner.grammar_matcher(params)  # raises InvalidGrammar (a ValueError)
        room = room or f"req-{next(self._ids)}"
        r = Request(room, list(prompt_ids), params, self.runner.spec.eos_token_ids, grammar=grammar)
        self.extend.add(r)
        self._times[room] = [time.perf_counter()]
        return room

    @property
    def has_work(self) -> bool:
        return bool(len(self.extend) or self.running)

    def step(self) -> list[GenerateOutput]:
        """One forward: prompt chunks first (prefill priority), else one decode step for all running."""
        reqs, chunks = self.extend.schedule(occupied=len(self.running))
        if reqs:
            logits = self.runner.forward(ForwardMode.EXTEND, reqs, chunks)
            done, rows = self.extend.take_completed(reqs)
            if done:
                sample_first_tokens(self.runner, done, logits[rows])
                now = time.perf_counter()
                for r in done:
                    self._times[r.room].append(now)
                    if not r.finished:  # the first token may already end it: it never runs then
                        r.transition(RequestState.RUNNING)
                    self.running.append(r)
        elif self.running:
            self.stepper.step(self.running)
        return self._collect_finished()

    def _collect_finished(self) -> list[GenerateOutput]:
        outs = []
        now = time.perf_counter()
        for r in [r for r in self.running if r.finished]:
            self.running.remove(r)
            stats = self.stepper.stats(r)
            self.stepper.forget(r)
            self.extend.retire(r, RequestState.FINISHED)
            t = self._times.pop(r.room)
            assert r.finish_reason is not None  # what `finished` means
            outs.append(
                GenerateOutput(
                    r.room,
                    r.prompt_ids,
                    r.output_ids,
                    r.finish_reason,
                    r.output_logprobs,
                    r.output_top_logprobs,
                    t[1] - t[0],
                    now - t[0],
                    stats,
                    r.cached_tokens,
                )
            )
        return outs

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerateOutput]:
        """Run prompts (token ids) to completion with continuous batching; outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        rooms = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        results: dict[str, GenerateOutput] = {}
        while self.has_work:
            for out in self.step():
                results[out.room] = out
        return [results[r] for r in rooms]
