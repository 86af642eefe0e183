"""The model runner: it loads the model, runs forwards over the paged KV pool, and samples.

Prefill workers, decode workers and the offline engine all drive a model through this one class.
It owns no scheduling policy: callers decide which requests run, it builds the batch and runs it.
It builds the KV pool (sized by runtime/kv_sizing.py) and its allocator; schedulers allocate pages
through `pages` (RequestPages). Beside it, each in its own module: tensor parallelism
(runtime/tensor_parallel.py, a do-nothing `SingleProcess` at --tp-size 1), the pools' shared memory
(runtime/shared_pools.py), grammar compiles (runtime/grammar/compiles.py), the compatibility record
(runtime/fingerprint.py) and live weight updates (runtime/weight_update.py).
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future
from typing import Any

import torch

from pdserve.config import RuntimeConfig
from pdserve.kv_transfer.layout import kv_head_ranges
from pdserve.kv_transfer.shm import SharedSegment
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
from pdserve.runtime.shared_pools import SharedPools
from pdserve.runtime.tensor_parallel import TensorParallel, tensor_parallel
from pdserve.runtime.tp_group import ForwardCommand
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
        # Tensor parallelism: ranks 1.. load their parts while this process loads its own.
        self.tp: TensorParallel = tensor_parallel(cfg, loaded)
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
            self.tp.join(self.loaded, self.device)
        except BaseException:
            self.tp.close(wait_s=0)  # a model that does not split, a rank that never came: none left behind
            raise
        self.model = self.loaded.model
        self.spec = self.loaded.spec
        self.context_length = cfg.context_length or self.spec.context_length
        self._log_model()
        self._build_pool()
        self._build_compute()
        self.grammars = GrammarCompiles(
            cfg.grammar_backend, cfg.grammar_compile_timeout_s, self.loaded.folder, self.spec
        )
        self.turns = forward_turns(cfg.cpu_forward_lock if self.device.type == "cpu" else None)

    def _log_model(self) -> None:
        plan = dense_plan()
        kept = any(getattr(m, "dense", None) is not None for m in self.loaded.model.modules())
        why = plan.why if kept or not plan.keep else "this model's dense copies would pass quant_plan's cap"
        dense = f"{'dense copy' if kept else 'no dense copy, dequantized'} from {plan.min_rows} rows: {why}"
        log.info("runtime: %s", startup_line(self.device, self.loaded.dtype, self.loaded.quantization, dense))
        log.info(
            "batch-invariant decoding: %s (%s)",
            "on" if self.loaded.batch_invariant else "off",
            self.loaded.batch_invariant_why,
        )

    def _build_pool(self) -> None:
        """Rank 0's KV pool (its KV heads), its allocator, and the other ranks' pools of the same pages."""
        cfg, spec = self.cfg, self.spec
        kv_dtype, kv_why = kv_cache_dtype(cfg.kv_cache_dtype, self.loaded, self.device)
        kv_heads = len(self.head_split[0])
        self.geometry = KVGeometry(spec.num_layers, kv_heads, spec.head_dim, cfg.page_size, kv_dtype)
        tokens, why = pool_tokens(cfg, self.device, self.context_length, self.geometry.bytes_per_token)
        self.max_total_tokens = tokens
        num_pages = KVPool.pages_for(self.geometry, self.max_total_tokens)
        self.pool = KVPool(self.geometry, num_pages, self.device)
        self.allocator = PageAllocator(num_pages)
        self.pages = RequestPages(self.allocator, cfg.page_size)
        full = KVGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, cfg.page_size, kv_dtype)
        self.tp.setup_pools(self.pool, full)
        self.shared = SharedPools()
        lazy = self.device.type == "cpu"
        log.info("KV pool: %s", describe_pool(self.geometry, num_pages, kv_why, lazy, why))

    def _build_compute(self) -> None:
        """The attention backend, the sampler, the C++ kernels on CPU and the compiled decode step."""
        cfg = self.cfg
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
        self.compiled: CompiledDecode | None = None
        if not cfg.enable_torch_compile:
            return
        why_not = self.tp.why_not_compiled() or (
            "batch-invariant decoding runs the eager kernels" if self.loaded.batch_invariant else None
        )
        if why_not is not None:
            log.info("--enable-torch-compile ignored: %s", why_not)
            return
        paged = isinstance(self.backend, CpuAttention)
        self.compiled = CompiledDecode(self.model, self.pool, cfg.max_running_requests, paged_kernel=paged)

    @property
    def page_size(self) -> int:
        return self.cfg.page_size

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def head_split(self) -> list[range]:
        """The KV heads each rank's pool holds (one range at TP 1)."""
        return kv_head_ranges(self.spec.num_kv_heads, self.tp.size)

    @property
    def transfer_kv(self) -> torch.Tensor:
        """What KV transfer reads and writes: the pool, or on a TP worker a pool of every KV head of
        the same pages, which `before_send` fills from the ranks and `after_receive` hands out to them."""
        return self.tp.transfer_kv(self.pool.kv)

    @property
    def rank_kv(self) -> list[torch.Tensor] | None:
        """On a TP worker whose pools are shared, every rank's pool as rank 0 maps it (None: not
        shared; KV moves between the ranks over the group)."""
        return self.tp.rank_kv

    def share_pools(self, directory: str) -> list[SharedSegment]:
        """Move the KV pool into shared memory that same-host peers map, and return the segments, rank
        0's first (`close` removes them). A TP worker: every rank's pool, each in its own segment, and
        rank 0 then reads and writes every rank's heads itself (`rank_kv`): a same-host peer's copy
        lands in each rank's pool straight, and `before_send` / `after_receive` become copies inside
        rank 0. Pages get memory as the allocator first hands them out, or are refused. Called again,
        it returns the same segments."""
        return self.shared.share(self.pool, self.allocator, self.tp, directory)

    def before_send(self, pages: list[int]) -> None:
        """A TP worker gathers these pages' KV heads from its ranks into `transfer_kv`: copies inside
        rank 0 where the ranks' pools are shared (any thread), else over the group (the loop's thread)."""
        self.tp.gather_kv(self.pool.kv, pages)

    def hand_off(self, pages: list[int]) -> None:
        """These pages' KV is about to leave: a TP worker whose ranks' pools are not shared gathers their
        heads now, on the loop's thread (shared ones are gathered per room as the sender goes)."""
        self.tp.hand_off(self.pool.kv, pages)

    def after_receive(self, pages: list[int]) -> None:
        """A TP worker hands these received pages of `transfer_kv` out to its ranks' pools."""
        self.tp.scatter_kv(self.pool.kv, pages)

    def tp_failure(self) -> str | None:
        """Why this TP worker cannot serve (a rank exited), or None."""
        return self.tp.failure()

    def close(self, wait_s: float = 10.0) -> None:
        """Stop the TP ranks (they would die with this process anyway; killed after `wait_s`) and
        remove their folder and the pools' shared-memory segments."""
        self.tp.close(wait_s)
        self.shared.close()

    def fingerprint(self) -> dict[str, str | int]:
        """This worker's compatibility record (runtime/fingerprint.py)."""
        return fingerprint(self.cfg, self.loaded, self.geometry, type(self.backend).__name__, self.tp.size)

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
        self.tp.forward(cmd)  # the other ranks run the same forward on their heads
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
