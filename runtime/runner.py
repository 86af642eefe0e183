"""The model runner: model + paged KV pool + page allocator + attention backend + sampler.

Prefill workers, decode workers and the offline engine all drive a model through this one class.
It owns no scheduling policy: callers decide which requests run, it builds the batch and runs it.
It builds the KV pool and its allocator; schedulers allocate pages through `pages` (RequestPages).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
from concurrent.futures import Future
from typing import Any

import torch

from pdserve.config import RuntimeConfig
from pdserve.kv_transfer.layout import kv_head_ranges
from pdserve.kv_transfer.shm import SharedSegment, ShmError, copy_heads, shared_pool
from pdserve.protocol.vocabulary import finish_length
from pdserve.runtime.attention import make_attention_backend
from pdserve.runtime.attention_cpu import CpuAttention
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.compiled_decode import CompiledDecode
from pdserve.runtime.fingerprint import fingerprint
from pdserve.runtime.forward_turns import forward_turns
from pdserve.runtime.grammar import GrammarMatcher, apply_grammar_masks
from pdserve.runtime.grammar.compiles import GrammarCompiles
from pdserve.runtime.host import startup_line
from pdserve.runtime.kv_pool import KVGeometry, KVPool, PageAllocator, RequestPages
from pdserve.runtime.kv_sizing import describe_pool, kv_cache_dtype, pool_tokens
from pdserve.runtime.loader import LoadedModel, load_model
from pdserve.runtime.quant import dense_plan
from pdserve.runtime.request import Request
from pdserve.runtime.sampler import SampleOutput, Sampler
from pdserve.runtime.sampling_batch import SamplingBatch
from pdserve.runtime.tp_follower import discard_tp_folder, rank_threads, spawn_followers
from pdserve.runtime.tp_group import ForwardCommand, TPGroup, TPGroupBroken
from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Forwards of at least this many tokens offer their turn at the cores between layers (forward_turns.py):
# ~150 ms and more on two cores, where a decode step waiting for all of it would stall every stream.
OFFER_TURN_MIN_TOKENS = 256


class ContextLengthError(ValueError):
    pass


class ModelRunner:
    def __init__(self, cfg: RuntimeConfig, loaded: LoadedModel | None = None):
        self.cfg = cfg
        self.device = torch.device(cfg.resolved_device())
        threads = rank_threads(cfg)
        if threads:
            torch.set_num_threads(threads)
        # Tensor parallelism: ranks 1.. load their parts while this process loads its own.
        self.tp: TPGroup | None = None
        # Shared-memory segments of the pools (`share_pools`), and on a TP worker every rank's pool as
        # rank 0 maps it (None: not shared; KV moves between the ranks over the group).
        self._segments: list[SharedSegment] = []
        self.rank_kv: list[torch.Tensor] | None = None
        self._tp_folder: str | None = None
        self._followers: list[subprocess.Popen[bytes]] = []
        if loaded is not None and (loaded.tp_layout.size if loaded.tp_layout else 1) != cfg.tp_size:
            raise ValueError(f"a model loaded for another TP size than --tp-size {cfg.tp_size}")
        if cfg.tp_size > 1:
            self._tp_folder, self._followers = spawn_followers(cfg)
        try:
            self.loaded = loaded or load_model(
                cfg.model_path,
                cfg.dtype,
                str(self.device),
                cfg.quantization,
                cfg.deterministic,
                cfg.attention_backend,
                cfg.tp_size,
            )
            self.model = self.loaded.model
            layout = self.loaded.tp_layout
            if layout is not None and self._tp_folder is not None:
                self.tp = TPGroup(self._tp_folder, 0, layout, self.device, lambda: self.tp_failure() is None)
                self.model.join_group(self.tp)
                log.info(
                    "tensor parallel: %s, ranks 1-%d in processes %s",
                    layout.describe(),
                    layout.size - 1,
                    [p.pid for p in self._followers],
                )
        except BaseException:
            self.close(wait_s=0)  # a model that does not split, a rank that never came: none left behind
            raise
        plan = dense_plan()
        dense = f"{'dense copy' if plan.keep else 'no dense copy, dequantized'} from {plan.min_rows} rows: {plan.why}"
        log.info("runtime: %s", startup_line(self.device, self.loaded.dtype, self.loaded.quantization, dense))
        log.info(
            "batch-invariant decoding: %s (%s)",
            "on" if self.loaded.batch_invariant else "off",
            self.loaded.batch_invariant_why,
        )
        self.spec = spec = self.loaded.spec
        self.context_length = cfg.context_length or spec.context_length
        kv_dtype, kv_why = kv_cache_dtype(cfg.kv_cache_dtype, self.loaded, self.device)
        kv_heads = spec.num_kv_heads if layout is None else layout.kv_heads_per_rank
        self.geometry = KVGeometry(spec.num_layers, kv_heads, spec.head_dim, cfg.page_size, kv_dtype)
        self.max_total_tokens, why = pool_tokens(
            cfg, self.device, self.context_length, self.geometry.bytes_per_token
        )
        num_pages = KVPool.pages_for(self.geometry, self.max_total_tokens)
        self.pool = KVPool(self.geometry, num_pages, self.device)
        self.allocator = PageAllocator(num_pages)
        # What KV transfer reads and writes: the pool, or on a TP worker a pool of every KV head of the
        # same pages, which `before_send` fills from the ranks and `after_receive` hands out to them.
        self.transfer_kv = self.pool.kv
        if self.tp is not None:
            self.tp.setup(num_pages, kv_dtype, cfg.page_size)
            full = KVGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, cfg.page_size, kv_dtype)
            self.transfer_kv = KVPool(full, num_pages, self.device).kv
        self.pages = RequestPages(self.allocator, cfg.page_size)
        self.backend = make_attention_backend(
            cfg.attention_backend, self.device, batch_invariant=self.loaded.batch_invariant
        )
        log.info("attention backend: %s", type(self.backend).__name__)
        if self.device.type == "cpu":
            # The C++ kernels (fused ops, greedy sampling; the attention's with `auto`): built or loaded
            # now, so that no request waits for a build. Where they cannot be, the torch paths run.
            from pdserve.kernels import cpu_library

            cpu_library.load()
        self.sampler = Sampler()
        # --enable-torch-compile: decode batches through one compiled step (compiled at the first one,
        # or by a worker's `compiled.warm_up()` before it serves); extend and verify forwards stay eager.
        self.compiled = (
            CompiledDecode(
                self.model,
                self.pool,
                cfg.max_running_requests,
                paged_kernel=isinstance(self.backend, CpuAttention),
            )
            if cfg.enable_torch_compile and not self.loaded.batch_invariant and self.tp is None
            else None
        )
        if cfg.enable_torch_compile and self.compiled is None:
            why = (
                "a TP rank's layers all-reduce"
                if self.tp
                else "batch-invariant decoding runs the eager kernels"
            )
            log.info("--enable-torch-compile ignored: %s", why)
        self.grammars = GrammarCompiles(
            cfg.grammar_backend, cfg.grammar_compile_timeout_s, self.loaded.folder, self.spec
        )
        self.turns = forward_turns(cfg.cpu_forward_lock if self.device.type == "cpu" else None)
        lazy = self.device.type == "cpu"
        log.info("KV pool: %s", describe_pool(self.geometry, num_pages, kv_why, lazy, why))

    @property
    def page_size(self) -> int:
        return self.cfg.page_size

    def share_pools(self, directory: str) -> list[SharedSegment]:
        """Move the KV pool into shared memory (kv_transfer/shm.py) that same-host peers map, and return
        the segments, rank 0's first (`close` removes them; the KV senders built on them only fence them).
        TP 1: the pool, which is also what transfers read and write. A TP worker: every rank's pool, each
        in its own segment that rank 0 makes and the rank maps and moves its pool into; rank 0 then reads
        and writes every rank's heads itself (`rank_kv`): a same-host peer's copy lands in each rank's
        pool straight, and `before_send` / `after_receive` become copies inside rank 0. Pages get memory
        as the allocator first hands them out (`commit`), or are refused. Called again, it returns the
        same segments."""
        if self._segments:
            return list(self._segments)
        used = self.allocator.high_water
        segment, shared = shared_pool(self.pool.kv, directory, used)
        segments = [segment]
        if self.tp is None:
            self.pool.kv = self.transfer_kv = shared
        else:
            pools = [shared]
            try:
                for _ in range(1, self.tp.size):
                    segments.append(SharedSegment.create(shared.numel() * shared.element_size(), directory))
                    pools.append(segments[-1].pool(tuple(shared.shape), shared.dtype))
                    if not segments[-1].commit(used * shared[0].nbytes):
                        raise ShmError(f"no room in {directory} for the {used} KV pages in use")
                self.tp.share_pools([(seg.path, seg.token) for seg in segments[1:]], used)
            except BaseException:
                for seg in segments:
                    seg.close()
                raise
            self.pool.kv = shared
            self.rank_kv = pools
        self._segments += segments
        page_bytes = shared[0].nbytes
        self.allocator.on_grow = lambda top: all(seg.commit(top * page_bytes) for seg in segments)
        return segments

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else self.tp.size

    @property
    def head_split(self) -> list[range]:
        """The KV heads each rank's pool holds (one range at TP 1)."""
        return kv_head_ranges(self.spec.num_kv_heads, self.tp_size)

    def before_send(self, pages: list[int]) -> None:
        """A TP worker gathers these pages' KV heads from its ranks into `transfer_kv`: copies inside
        rank 0 where the ranks' pools are shared (any thread), else over the group (the loop's thread)."""
        if self.rank_kv is not None:
            every = [range(self.spec.num_kv_heads)]
            copy_heads(self.rank_kv, self.head_split, pages, [self.transfer_kv], every, pages)
        elif self.tp is not None:
            self.tp.gather_kv(self.pool.kv, self.transfer_kv, pages)

    def after_receive(self, pages: list[int]) -> None:
        """A TP worker hands these received pages of `transfer_kv` out to its ranks' pools."""
        if self.rank_kv is not None:
            every = [range(self.spec.num_kv_heads)]
            copy_heads([self.transfer_kv], every, pages, self.rank_kv, self.head_split, pages)
        elif self.tp is not None:
            self.tp.scatter_kv(self.pool.kv, self.transfer_kv, pages)

    def tp_failure(self) -> str | None:
        """Why this TP worker cannot serve (a rank exited), or None."""
        for rank, p in enumerate(self._followers, start=1):
            if p.poll() is not None:
                return f"TP rank {rank} exited ({p.returncode})"
        return None

    def close(self, wait_s: float = 10.0) -> None:
        """Stop the TP ranks (they would die with this process anyway; killed after `wait_s`) and
        remove their folder and shared-memory segment."""
        if self.tp is not None and self.tp_failure() is None:
            with contextlib.suppress(TPGroupBroken):
                self.tp.stop()
        for p in self._followers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=wait_s)
            if p.poll() is None:
                p.kill()
                p.wait()
        self._followers = []
        self.tp = None
        for seg in self._segments:
            seg.close()
        self._segments, self.rank_kv = [], None
        if self._tp_folder is not None:
            discard_tp_folder(self._tp_folder)
            self._tp_folder = None

    def fingerprint(self) -> dict[str, str | int]:
        """This worker's compatibility record (runtime/fingerprint.py)."""
        return fingerprint(self.cfg, self.loaded, self.geometry, type(self.backend).__name__, self.tp_size)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len < 1:
            raise ValueError("the prompt is empty")
        total = prompt_len + max_new_tokens
        if total > self.context_length:
            raise ContextLengthError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                f"exceeds the context length {self.context_length}"
            )
        if total > self.allocator.num_pages * self.page_size:
            raise ContextLengthError(f"{total} tokens exceed the KV pool ({self.max_total_tokens} tokens)")

    def pages_for(self, num_tokens: int) -> int:
        return self.pages.pages_for(num_tokens)

    # For code that drives forwards by hand (tests, the draft model's own sequences); the
    # schedulers allocate through `self.pages` themselves.
    def reserve(self, req: Request, num_tokens: int) -> bool:
        return self.pages.reserve(req, num_tokens)

    def release(self, req: Request) -> None:
        self.pages.release(req)

    def forward(
        self,
        mode: ForwardMode,
        reqs: list[Request],
        new_tokens: list[list[int]],
        all_logits: bool | None = None,
    ) -> torch.Tensor:
        """Run new tokens on top of each request's computed prefix; returns logits (see ForwardBatch;
        `all_logits`: one row per new token instead of one per request)."""
        cmd = ForwardCommand(
            mode, new_tokens, [r.num_computed for r in reqs], [r.pages for r in reqs], all_logits
        )
        batch = cmd.batch(self.page_size, self.device)
        if self.tp is not None:  # the other ranks run the same forward on their heads
            self.tp.send_command(*cmd.encode())
        with self.turns.turn() if self.turns is not None else contextlib.nullcontext() as turn:
            if self.compiled is not None and mode is ForwardMode.DECODE:
                logits = self.compiled(batch)
            else:
                # A long forward lets a waiting co-located worker's forward run between its layers.
                offer = turn.offer if turn is not None and batch.num_tokens >= OFFER_TURN_MIN_TOKENS else None
                logits = self.model(batch, self.pool, self.backend, offer)
        for r, toks in zip(reqs, new_tokens):
            r.num_computed += len(toks)
        return logits

    def recompute(self, reqs: list[Request]) -> None:
        """Rebuild from scratch the KV of requests whose pages were freed and reserved again
        (retracted ones): every token but the newest, which the next decode step feeds."""
        for r in reqs:
            r.num_computed = 0
            self.forward(ForwardMode.EXTEND, [r], [(r.prompt_ids + r.output_ids)[:-1]])

    def grammar_matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """A fresh matcher for the request's constraint, waiting for its compile: the offline engine's
        way; workers use `grammar_future`, which does not wait (runtime/grammar/compiles.py)."""
        return self.grammars.matcher(params)

    def grammar_future(self, params: SamplingParams) -> Future[Any] | None:
        """The request's compiled grammar, compiling beside the forwards (None without a constraint)."""
        return self.grammars.future(params)

    def sample(self, reqs: list[Request], logits: torch.Tensor) -> SampleOutput:
        """One token per request from logits [len(reqs), V] (masked in place for constrained ones;
        logprobs stay those of the model's own distribution, as without a grammar)."""
        sbatch = SamplingBatch.build(
            [r.params for r in reqs], self.device, [r.eos_token_ids for r in reqs], logits.shape[-1]
        )
        raw = None
        if any(r.grammar is not None for r in reqs):
            raw = logits.clone() if sbatch.need_logprobs else None
            apply_grammar_masks(logits, [r.grammar for r in reqs])
        penalties = sbatch.any_penalty
        return self.sampler(
            logits,
            sbatch,
            [r.prompt_ids for r in reqs] if penalties else None,
            [r.output_ids for r in reqs] if penalties else None,
            [len(r.output_ids) for r in reqs],
            logprob_logits=raw,
        )


def sample_first_tokens(runner: ModelRunner, done: list[Request], logits: torch.Tensor) -> None:
    """The first token of each request whose prompt a forward completed (`logits`: their rows). A
    prefill-only request (max_new_tokens 0: its prompt logprobs, or a cache warm-up, as SGLang's)
    samples none and finishes there with length 0."""
    rows = [i for i, r in enumerate(done) if r.params.max_new_tokens > 0]
    for r in done:
        if r.params.max_new_tokens == 0:
            r.finish_reason = finish_length(0)
    if len(rows) == len(done):
        append_samples(done, runner.sample(done, logits))
    elif rows:
        sampled = [done[i] for i in rows]
        append_samples(sampled, runner.sample(sampled, logits[rows]))


def append_samples(reqs: list[Request], out: SampleOutput) -> list[bool]:
    """Append each request's sampled token (with logprobs when asked); returns which finished."""
    ids = out.token_ids.tolist()  # deliberate sync: tokens go back to the host scheduler
    lps = out.logprobs.tolist() if out.logprobs is not None else None
    top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
    top_vals = out.top_logprob_vals.tolist() if out.top_logprob_vals is not None else None
    done = []
    for i, r in enumerate(reqs):
        want_lp = r.params.logprobs or r.params.top_logprobs_num > 0
        top = None
        if want_lp and top_ids is not None and top_vals is not None and r.params.top_logprobs_num > 0:
            n = r.params.top_logprobs_num
            top = list(zip(top_ids[i][:n], top_vals[i][:n]))
        done.append(r.append_token(ids[i], lps[i] if (want_lp and lps is not None) else None, top))
    return done
