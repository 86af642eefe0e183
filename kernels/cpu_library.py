"""The `pdserve_cpu` operator library: C++ CPU kernels built on first use.

Sources: cpu_decode_attention.cpp (paged decode attention), cpu_fused_ops.cpp (RMSNorm, SiLU-and-mul
and rotary in one pass each), cpu_sampling.cpp (greedy sampling), cpu_quant_linear.cpp (int8 / int4
weight-only linears), cpu_decode_layer.cpp (a decoder layer as one operator), cpu_gguf_repack.cpp and
cpu_gguf_dequant.cpp (a GGUF file's tensors into int4_linear's layout, or to float), with the shared
row helpers of cpu_rows.h, the vector registers of cpu_simd.h, fp16 of cpu_half.h and GGUF's blocks
of cpu_gguf_blocks.h. `load()` compiles them (11.5 s cold, measured) with the host's compiler for the
instruction set kernels/cpu_isa.py picks at run time (the host's own, `-march=native`, or the level
`PDSERVE_CPU_ISA` caps it to) into `TORCH_EXTENSIONS_DIR` (default ~/.cache/torch_extensions), under a
name that hashes the sources, the torch version, the CPU's flags, the target flags and both folders,
and later processes reuse the build. Each kernel has an AVX-512 and an AVX2 (+ FMA, F16C) form where
it has a vector form at all; `instruction_set()` says which this build runs. Where it cannot be built
(no compiler, a build error), `load()` says why once and returns False, and every
caller keeps its torch path. Each operator has a fake implementation, so `torch.compile` traces
through them.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from pdserve.kernels import cpu_isa

log = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name(n)
    for n in (
        "cpu_decode_attention.cpp",
        "cpu_fused_ops.cpp",
        "cpu_sampling.cpp",
        "cpu_quant_linear.cpp",
        "cpu_decode_layer.cpp",
        "cpu_gguf_repack.cpp",
        "cpu_gguf_dequant.cpp",
    )
]
_HEADERS = [
    Path(__file__).with_name(n) for n in ("cpu_rows.h", "cpu_simd.h", "cpu_half.h", "cpu_gguf_blocks.h")
]


def _cflags() -> list[str]:
    # -fopenmp: at::parallel_for is OpenMP code inlined from the headers; the library then uses the
    # libgomp torch has loaded (same soname), not a second thread pool.
    return ["-O3", *cpu_isa.compile_flags(), "-ffast-math", "-fopenmp"]


def build_dir() -> Path:
    """Where these sources are built for this torch and CPU: its name hashes all three, and where the
    sources and torch lie (torch's build file names both paths: two checkouts or environments sharing
    one folder would rebuild it each time the other had loaded it)."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS))
    key.update(torch.__version__.encode() + " ".join(sorted(cpu_isa.host_flags())).encode())
    key.update(" ".join(_cflags()).encode())
    key.update(f"{Path(__file__).resolve().parent}|{Path(torch.__file__).resolve().parent}".encode())
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(base) / f"pdserve_cpu_{key.hexdigest()[:12]}"


@functools.cache
def load() -> bool:
    """Build (or reuse) and load the library; False, logged once, where it cannot be built."""
    try:
        from torch.utils import cpp_extension

        build = build_dir()
        build.mkdir(parents=True, exist_ok=True)
        # Workers that start together build once: an flock, which the kernel drops with its holder,
        # so a worker killed mid-build cannot leave the others waiting on torch's own lock file
        # (removed here, under the flock, if such a worker left one).
        with open(build / "pdserve.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (build / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                name=build.name,
                sources=[str(p) for p in _SOURCES],
                extra_cflags=_cflags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, a build error: the torch paths still work
        log.warning("the pdserve_cpu kernels were not built, the torch paths run instead: %s", e)
        return False
    torch.library.register_fake("pdserve_cpu::paged_decode_attention")(_attention_fake)
    torch.library.register_fake("pdserve_cpu::paged_decode_attention_store")(_attention_store_fake)
    torch.library.register_fake("pdserve_cpu::rms_norm")(_rms_norm_fake)
    torch.library.register_fake("pdserve_cpu::add_rms_norm")(_add_rms_norm_fake)
    torch.library.register_fake("pdserve_cpu::silu_and_mul")(_silu_and_mul_fake)
    torch.library.register_fake("pdserve_cpu::rotary_")(_rotary_fake)
    torch.library.register_fake("pdserve_cpu::greedy")(_greedy_fake)
    torch.library.register_fake("pdserve_cpu::int4_linear")(_int4_linear_fake)
    torch.library.register_fake("pdserve_cpu::int8_linear")(_int8_linear_fake)
    torch.library.register_fake("pdserve_cpu::int4_linear_a8")(_int4_linear_fake)
    return True


def instruction_set() -> str:
    """The vector registers the loaded build's kernels use: 'avx512', 'avx2', or 'none' (plain loops,
    or no build at all)."""
    if not load():
        return "none"
    return {512: "avx512", 256: "avx2"}.get(int(torch.ops.pdserve_cpu.simd_width()), "none")


def _attention_fake(q, rows, key_rows, lens, k_offset, v_offset, scale, k_new=None, v_new=None):  # type: ignore[no-untyped-def]
    return q.new_empty(q.shape)


def _attention_store_fake(q, rows, key_rows, lens, k_offset, v_offset, scale, new_rows, k, v):  # type: ignore[no-untyped-def]
    return q.new_empty(q.shape)


def _rms_norm_fake(x, weight, eps):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape)


def _add_rms_norm_fake(x, residual, weight, eps):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _silu_and_mul_fake(x):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape[0], x.shape[1] // 2)


def _rotary_fake(x, positions, cos, sin_signed):  # type: ignore[no-untyped-def]
    return None


def _greedy_fake(logits):  # type: ignore[no-untyped-def]
    return logits.new_empty(logits.shape[0], dtype=torch.long)


def _int4_linear_fake(x, packed, n, bias=None):  # type: ignore[no-untyped-def]
    return x.new_empty(*x.shape[:-1], n)


def _int8_linear_fake(x, packed, scale, bias=None):  # type: ignore[no-untyped-def]
    return x.new_empty(*x.shape[:-1], scale.shape[0])
