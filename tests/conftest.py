"""Shared fixtures: the bundled model (loaded once), its transformers twin, tiny random checkpoints.

The tiny checkpoints cover each supported family's distinguishing feature (llama3 RoPE scaling,
untied head, Qwen2 qkv bias, Qwen3 q/k norm with an explicit head_dim), all with GQA ratio > 1.
They are written with `save_pretrained` so our loader reads them exactly as it reads real ones.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable

import pytest
import torch

# Triton reads this when first imported: set it before any test module can import triton, so the
# kernel tests run in the interpreter on machines without a GPU whatever the collection order.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every process this run starts inherits this mark, whoever starts it (a fixture, `pdserve up`, a
# launcher script), so the reaper below finds them all, even ones orphaned by an interrupted test.
RUN_MARK = "PDSERVE_TEST_RUN"
os.environ[RUN_MARK] = uuid.uuid4().hex


def marked_processes(mark: str) -> list[int]:
    """PIDs of the processes (other than this one) whose environment carries RUN_MARK=`mark`."""
    needle = f"{RUN_MARK}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or not ours to read
            pass
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The reaper: whatever this run started and is still running now is killed, and named."""
    if not os.path.isdir("/proc"):
        return
    left = marked_processes(os.environ[RUN_MARK])
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        print(f"\nreaper: killed {len(left)} process(es) the tests left running: {left}")


# name -> (config class name, config kwargs)
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama3-rope-tied": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "llama-untied": (
        "LlamaConfig",
        dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "qwen2-bias": (
        "Qwen2Config",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "qwen3-qknorm": (
        "Qwen3Config",
        # head_dim 32 != hidden / heads (16): the explicit head_dim must be honoured.
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
}

TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random, so a tensor the loader drops or misplaces changes the logits.

    (HF initializes biases to zero and norms to one, which would hide such bugs.)
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(1.0 + noise if "norm" in name else noise * 2.0 if p.dim() == 1 else noise)


def write_tiny_checkpoint(name: str, folder: str, seed: int = 0) -> str:
    import transformers

    cls_name, kwargs = TINY_CONFIGS[name]
    config = getattr(transformers, cls_name)(**TINY_COMMON, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    """One intra-op thread unless PDSERVE_TEST_THREADS says otherwise.

    Test shapes are small, and on a loaded machine an OpenMP team waits for a descheduled
    thread at every op: two threads measured over 10x slower than one there.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("PDSERVE_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory) -> dict[str, str]:
    """name -> folder holding a tiny random checkpoint (config.json + model.safetensors)."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        name: write_tiny_checkpoint(name, os.path.join(root, name), seed=i)
        for i, name in enumerate(TINY_CONFIGS)
    }


@pytest.fixture(scope="session")
def bundled():
    """The bundled SmolLM2-135M-Instruct through our loader, fp32 on CPU, loaded once."""
    from pdserve.runtime.loader import load_model

    return load_model(None, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def hf_bundled(bundled):
    """transformers' model read from the same (cached) folder as `bundled`."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled.folder, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(bundled):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled.folder)


@pytest.fixture
def make_engine() -> Callable:
    """Build an Engine on an already loaded model with a small KV pool (keeps tests light)."""
    from pdserve.config import RuntimeConfig
    from pdserve.runtime.engine import Engine

    def make(loaded, **overrides):
        kw = dict(device="cpu", max_total_tokens=4096, attention_backend="torch")
        kw.update(overrides)
        return Engine(RuntimeConfig(**kw), loaded)

    return make
