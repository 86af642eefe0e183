"""The GPU check's dry run (`pdserve bench gpu --dry-run`): every stage that needs no CUDA runs here, so
the script cannot rot between GPU runs: the wheel list still covers what the GPU image lacks, pdserve
still builds as a complete wheel offline, the GPU kernel tests are still collected, the benchmarks
still start, parity holds on the tiny checkpoints, and the GPU command lines still parse."""

from __future__ import annotations

import json
import subprocess

import pytest

from pdserve.bench import gpu_install
from pdserve.kernels import cpu_isa
from pdserve.launch.supervisor import pdserve_command


@pytest.mark.timeout(600)
def test_dry_run(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        pdserve_command("bench", "gpu", "--dry-run", "--out", str(out)),
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    stages = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["stages"]}
    assert list(stages) == [
        "env", "model", "wheels", "packaging", "kernel_tests", "kernel_bench", "cpu_kernels",
        "cpu_kernels_avx2", "parity", "profiles", "engine_bench", "tp", "cluster",
    ]  # fmt: skip
    for name in (
        "env", "wheels", "packaging", "kernel_tests", "kernel_bench", "cpu_kernels", "parity", "profiles",
    ):  # fmt: skip
        assert stages[name]["status"] == "ok", stages[name]
    # The C++ kernels' stage: its tests collected in a process of their own.
    cpp = stages["cpu_kernels"]["numbers"]
    assert "collected" in cpp["tests"] and not cpp["crashed"]
    # The AVX2 rerun needs AVX-512 to differ from the native run.
    avx2 = "ok" if "avx512f" in cpu_isa.host_flags() else "skipped"
    assert stages["cpu_kernels_avx2"]["status"] == avx2, stages["cpu_kernels_avx2"]
    assert stages["model"]["status"] == "skipped"
    profiles = json.loads((out / "profiles.json").read_text())
    assert set(profiles["prefill_ms"]) == {"16", "64"} and set(profiles["decode_step_ms"]) == {"1x32", "4x32"}
    for name in ("engine_bench", "cluster"):
        assert stages[name]["status"] == "skipped" and "needs CUDA" in stages[name]["detail"]
    assert stages["tp"]["status"] == "skipped" and "needs 2 GPUs, 0 here" in stages["tp"]["detail"]
    parity = stages["parity"]["numbers"]["models"]
    assert len(parity) == 4 and all(m["greedy_equal"] == m["prompts"] == 10 for m in parity)
    assert max(m["logits_rel_diff"] for m in parity) < 1e-4
    assert (out / "summary.txt").read_text().count("\n") == 13


def test_wheel_check_names_what_the_list_lacks(tmp_path, monkeypatch):
    original = gpu_install.WHEELS_FILE.read_text()
    listed = tmp_path / "wheels.txt"
    monkeypatch.setattr(gpu_install, "WHEELS_FILE", listed)
    listed.write_text("\n".join(line for line in original.splitlines() if not line.startswith("fastapi")))
    assert gpu_install.missing_on_gpu() == (["fastapi"], [])
    listed.write_text(original.replace("fastapi==", "fastapi==0.0.1 # "))
    missing, stale = gpu_install.missing_on_gpu()
    assert missing == [] and len(stale) == 1 and stale[0].startswith("fastapi 0.0.1 (here ")


def test_random_weights_like_keeps_the_shape_and_tokenizer(tmp_path):
    from pdserve.bench.tiny_models import write_shaped_checkpoint, write_tiny_checkpoint
    from pdserve.runtime.loader import load_model

    like = write_tiny_checkpoint("qwen3-qknorm", str(tmp_path / "like"))
    (tmp_path / "like" / "tokenizer_config.json").write_text("{}")
    folder = write_shaped_checkpoint(like, str(tmp_path / "shaped"))
    assert (tmp_path / "shaped" / "tokenizer_config.json").read_text() == "{}"
    assert load_model(folder, dtype="float32", device="cpu").spec == load_model(like, "float32", "cpu").spec


def test_the_cpp_stage_names_a_crashed_test():
    """What cpu_kernels reports when a kernel kills an xdist worker (no crash happens on the dry run)."""
    from pdserve.bench import gpu_cpu_kernels

    xdist = (
        "[gw1] node down: Not properly terminated\nworker 'gw1' crashed while running 'tests/k.py::test_a[x]'"
    )
    assert gpu_cpu_kernels.crashed_tests(xdist + "\n" + xdist) == ["tests/k.py::test_a[x]"]
    assert gpu_cpu_kernels.signal_name(11) == "SIGSEGV"
