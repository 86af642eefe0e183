"""pdserve's engine against transformers on one device and dtype: prompt logits and greedy outputs.

Used by the GPU check (`pdserve bench gpu`): on CUDA in bf16, where the two implementations round
differently, exact equality is not expected. A greedy divergence counts as a near-tie when, at the
first differing position, transformers' own top-2 logits are closer than `tie_margin` (in its logits'
units): both answers are then right within rounding. Anything else is a mismatch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from pdserve.runtime.attention import AttentionBackend, TorchAttention
from pdserve.runtime.batch import ForwardBatch, ForwardMode
from pdserve.runtime.kv_pool import KVGeometry, KVPool, PageAllocator
from pdserve.runtime.loader import LoadedModel


@dataclass
class ParityResult:
    model: str
    device: str
    dtype: str
    prompts: int
    logits_rel_diff: float  # max |ours - theirs| / max |theirs| over every prompt position
    greedy_equal: int
    greedy_near_ties: int
    greedy_mismatches: int
    first_mismatch: str = ""

    @property
    def ok(self) -> bool:
        return self.greedy_mismatches == 0

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def extend_logits(
    loaded: LoadedModel, prompts: list[list[int]], page_size: int, attention: AttentionBackend | None = None
) -> list[torch.Tensor]:
    """Every position's logits for each prompt, all prompts in ONE extend forward. Pages are allocated
    interleaved, one per request at a time, so that no request's pages are contiguous."""
    spec = loaded.spec
    device = next(loaded.model.parameters()).device
    geo = KVGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, page_size, loaded.dtype)
    total = sum(len(p) for p in prompts)
    pool = KVPool(geo, KVPool.pages_for(geo, total) + len(prompts), device)
    alloc = PageAllocator(pool.num_pages)
    tables: list[list[int]] = [[] for _ in prompts]
    need = [-(-len(p) // page_size) for p in prompts]
    while any(len(t) < n for t, n in zip(tables, need)):
        for t, n in zip(tables, need):
            if len(t) < n:
                t.extend(alloc.alloc(1))
    batch = ForwardBatch.build(
        ForwardMode.EXTEND, prompts, [0] * len(prompts), tables, page_size, all_logits=True, device=device
    )
    with torch.no_grad():
        logits = loaded.model(batch, pool, attention or TorchAttention())  # [sum(len), V]
    return list(logits.split([len(p) for p in prompts]))


def _prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 7, 12, 20, 33, 48, 64, 90, 17, 5][:n]
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def check_parity(
    folder: str,
    device: str,
    dtype: str,
    num_prompts: int = 10,
    new_tokens: int = 16,
    tie_margin: float = 0.05,
    model_name: str | None = None,
) -> ParityResult:
    from transformers import AutoModelForCausalLM

    from pdserve.config import RuntimeConfig
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.loader import load_model
    from pdserve.sampling_params import SamplingParams

    torch_dtype = getattr(torch, dtype)
    loaded = load_model(folder, dtype=dtype, device=device)
    engine = Engine(
        RuntimeConfig(device=device, dtype=dtype, max_total_tokens=8192, disable_radix_cache=True), loaded
    )
    from pdserve.model_source import resolve_model_source
    from pdserve.runtime.loader import model_folder

    reference = model_folder(resolve_model_source(folder))  # a GGUF's float copy
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch_dtype).to(device).eval()
    vocab = min(loaded.spec.vocab_size, int(hf.config.vocab_size))
    prompts = _prompts(vocab, num_prompts)

    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True, logprobs=False)
    ours = [o.output_ids for o in engine.generate(prompts, params)]
    # Every prompt position's logits from one batched extend forward, with the engine's attention.
    mine_all = extend_logits(loaded, prompts, engine.runner.page_size, engine.runner.backend)
    rel, equal, ties, mismatches, first = 0.0, 0, 0, 0, ""
    with torch.no_grad():
        for p, out in zip(prompts, ours):
            full = torch.tensor([p + out], device=device)
            logits = hf(full).logits[0].float()  # transformers' logits along our own output
            theirs = logits[len(p) - 1 : -1].argmax(-1).tolist()
            ref = logits[: len(p)]
            rel = max(rel, ((mine_all.pop(0).float() - ref).abs().max() / ref.abs().max()).item())
            if theirs == out:
                equal += 1
                continue
            i = next(k for k, (a, b) in enumerate(zip(out, theirs)) if a != b)
            top2 = logits[len(p) - 1 + i].topk(2).values
            if (top2[0] - top2[1]).item() < tie_margin:
                ties += 1
            else:
                mismatches += 1
                first = (
                    first
                    or f"prompt of {len(p)} tokens, output position {i}: ours {out[i]}, theirs {theirs[i]}"
                )
    return ParityResult(
        model=model_name or folder,
        device=device,
        dtype=dtype,
        prompts=len(prompts),
        logits_rel_diff=rel,
        greedy_equal=equal,
        greedy_near_ties=ties,
        greedy_mismatches=mismatches,
        first_mismatch=first,
    )
