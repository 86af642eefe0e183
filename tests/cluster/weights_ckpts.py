"""Checkpoints and references for the weight-update cluster tests (test_weight_update.py,
test_weight_restart.py): the bundled model, and a second checkpoint whose final norm is scaled unevenly
per channel (every layer's KV unchanged, the greedy tokens changed)."""

from __future__ import annotations

import os
import shutil

import httpx
import torch
from safetensors.torch import load_file, save_file

from pdserve.config import RuntimeConfig
from pdserve.runtime.engine import Engine
from pdserve.sampling_params import SamplingParams

NORM = "model.norm.weight"
PROMPTS = [
    "The history of the printing press",
    "Write a short story about a lighthouse keeper",
    "List the planets of the solar system and",
    "Explain how a bicycle stays upright",
]


def _scaled_norm(w: torch.Tensor) -> torch.Tensor:
    return w * (1.0 + 0.6 * torch.sin(torch.arange(w.numel(), dtype=w.dtype)))


def make_ckpts(root) -> tuple[str, str, str]:
    """(bundled folder, B: final norm rescaled, bad: that norm one element longer) as HF folders."""
    from pdserve.model_source import resolve_model_source
    from pdserve.runtime.loader import model_folder

    base = model_folder(resolve_model_source(None))
    state = load_file(os.path.join(base, "model.safetensors"))
    out = {}
    for name, norm in (("b", _scaled_norm(state[NORM])), ("bad", torch.ones(state[NORM].numel() + 1))):
        d = root / name
        shutil.copytree(base, d, ignore=shutil.ignore_patterns("*.safetensors", "*.lock"))
        save_file({**state, NORM: norm.contiguous()}, str(d / "model.safetensors"))
        out[name] = str(d)
    return base, out["b"], out["bad"]


class Reference:
    """Greedy outputs of the offline engine (no prefix cache) on the bundled weights or on checkpoint B."""

    def __init__(self) -> None:
        self.eng = Engine(RuntimeConfig(dtype="float32", max_total_tokens=8192, disable_radix_cache=True))
        self.norm = self.eng.runner.model.model.norm.weight
        self.orig = self.norm.detach().clone()

    def greedy_many(self, jobs: list[tuple[list[int], int]], b: bool) -> list[list[int]]:
        """[(prompt, tokens)] run together, on B's weights if `b`."""
        with torch.no_grad():
            self.norm.copy_(_scaled_norm(self.orig) if b else self.orig)
        try:
            params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for _, n in jobs]
            return [o.output_ids for o in self.eng.generate([p for p, _ in jobs], params)]
        finally:
            with torch.no_grad():
                self.norm.copy_(self.orig)

    def greedy(self, prompt: list[int], n: int, b: bool) -> list[int]:
        return self.greedy_many([(prompt, n)], b)[0]


def tokenize(texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    from pdserve.model_source import resolve_model_source
    from pdserve.runtime.loader import model_folder

    tok = AutoTokenizer.from_pretrained(model_folder(resolve_model_source(None)))
    return [tok(t).input_ids for t in texts]


def greedy_via_cluster(c, ids: list[int], n: int = 24) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(c.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()
