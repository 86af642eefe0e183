"""PDSERVE_CPU_ISA: the cap hides the CPU's flags past it from every choice pdserve makes, picks the C++
kernels' build target, caps torch's own kernels, and is refused by name when unknown. On a host with
AVX-512, the kernel tests run again under `avx2`, so that the AVX2 forms of the kernels are tested on
every machine (on an AVX2-only host the plain run is that run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kernels import cpu_isa
from pdserve.launch.supervisor import pdserve_command

REPO = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    "tests/kernels/test_cpu_quant_linear.py",
    "tests/kernels/test_cpu_decode_attention.py",
    "tests/kernels/test_cpu_sampling.py",
    "tests/kernels/test_cpu_decode_layer.py",
    "tests/kernels/test_cpu_fused_ops.py",
    "tests/kernels/test_gguf_repack.py",
    "tests/kernels/test_gguf_dequant.py",
    # torch's own int8 GEMM (`_int_mm`) saturates without int8 dot products: w8a8 must not use it there
    "tests/runtime/test_quant.py::test_quantized_linear_matches_fp32",
]


def test_the_cap_hides_flags_and_picks_the_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    host = frozenset(
        {"sse2", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "avx_vnni"}
    )
    monkeypatch.setattr(cpu_isa, "host_flags", lambda: host)
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    assert cpu_isa.flags() == {"sse2", "avx2", "fma", "f16c"}
    assert cpu_isa.torch_env()["ATEN_CPU_CAPABILITY"] == "avx2"
    if cpu_isa._x86():
        assert "-march=x86-64-v3" in cpu_isa.compile_flags()
    monkeypatch.setenv(cpu_isa.ISA_ENV, "AVX512")  # any case
    assert cpu_isa.flags() == host - {"amx_bf16"}
    monkeypatch.setenv(cpu_isa.ISA_ENV, "native")
    assert cpu_isa.flags() == host and cpu_isa.torch_env() == {}
    monkeypatch.setenv(cpu_isa.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="PDSERVE_CPU_ISA='sse9' is not one of native, avx512, avx2"):
        cpu_isa.cap()


def test_the_cli_refuses_an_unknown_cap_by_name() -> None:
    env = {**os.environ, cpu_isa.ISA_ENV: "avx9000"}
    out = subprocess.run(pdserve_command("generate", "hi"), env=env, capture_output=True, text=True)
    assert out.returncode == 2
    assert "PDSERVE_CPU_ISA='avx9000' is not one of" in out.stderr


def test_the_runtime_follows_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `avx2` no host has bf16 or AMX: dtype auto is float32 and the crossovers are AVX2's."""
    from pdserve.runtime import host

    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    assert not host.cpu_has_bf16() and not host.cpu_has_amx() and not host.cpu_has_int8_dot()


@pytest.mark.skipif(
    "avx512f" not in cpu_isa.host_flags(), reason="no AVX-512 here: the plain run is the AVX2 run"
)
def test_the_avx2_kernels_pass_on_this_avx512_host() -> None:
    env = {**os.environ, cpu_isa.ISA_ENV: "avx2"}
    for key in cpu_isa.torch_env():
        env.pop(key, None)  # set afresh by the child's conftest from the cap
    probe = subprocess.run(
        [
            sys.executable,
            "-P",
            "-c",
            "from pdserve.kernels import cpu_library; print(cpu_library.instruction_set())",
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert probe.stdout.strip().splitlines()[-1] == "avx2", probe.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stdout[-4000:]
