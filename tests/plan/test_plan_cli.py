"""`pdserve plan`: a profile measured on this host with the real runner, and the split search over it."""

from __future__ import annotations

import json
import subprocess

import pytest

from pdserve.launch.supervisor import pdserve_command
from pdserve.plan.profile import Profile

pytestmark = pytest.mark.timeout(600)


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        pdserve_command("plan", *args),
        capture_output=True,
        text=True,
        timeout=500,
    )


def test_a_profile_measured_here_loads_and_grows_with_the_work(tmp_path, tiny_folders) -> None:
    """The real runner's forwards (a tiny model of 128 positions, to keep it short): the points its context
    allows, each a positive time (their ordering is too noisy at this size to assert)."""
    model = tiny_folders["llama-untied"]
    out = _plan("--profile-out", str(tmp_path / "host.json"), "--dtype", "float32", "--model-path", model)
    assert out.returncode == 0, out.stderr
    p = Profile.load(str(tmp_path / "host.json"))
    assert p.dtype == "float32" and "cores" in p.host and p.model == model
    assert p.prefill_tokens == [16, 128] and p.decode_context == [64] and p.decode_batch == [1, 4, 16, 48]
    assert min(p.prefill_s) > 0 and min(min(row) for row in p.decode_s) > 0 and p.transfer(1000) > 0


def test_the_search_prints_every_split_and_picks_the_one_the_workload_needs(tmp_path) -> None:
    """Prefill 10x the cost of a decode step's whole run, a device per worker: of 3 workers, two
    should prefill."""
    profile = {
        "host": "test", "model": "m", "dtype": "float32", "quantization": "none", "threads": 1,
        "prefill_tokens": [1, 1024], "prefill_s": [0.01, 0.5],
        "decode_batch": [1, 64], "decode_context": [1, 4096], "decode_s": [[0.005, 0.006], [0.01, 0.012]],
        "transfer_s_per_token": 1e-6,
    }  # fmt: skip
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    out = _plan("--profile", str(path), "--workers", "3", "--input-len", "1024", "--output-len", "8",
                "--rates", "1", "3", "--dedicated", "--ttft-slo", "1", "--tpot-slo", "0.05")  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:4] in ("1P2D", "2P1D")]
    assert sorted({r[0] for r in rows}) == ["1P2D", "2P1D"] and len(rows) == 4
    assert "best split of 3 workers: 2P1D" in out.stdout
    bad = _plan("--profile", str(path), "--workers", "1")
    assert bad.returncode == 2 and "at least 2 workers" in bad.stderr
    path.write_text(json.dumps({**profile, "decode_s": [[0.1]]}))
    bad = _plan("--profile", str(path))
    assert bad.returncode == 2 and "decode_s must be" in bad.stderr


def test_a_paper_profile_is_labelled_and_its_roofline_holds() -> None:
    from pdserve.plan.datasheet import paper_profile

    p = paper_profile("H100-SXM", "llama-3.1-8b", transfer_gbps=25)
    assert "on paper" in p.host and "not measured" in p.host and any("datasheet" in n for n in p.notes)
    # A decode step reads the weights once, whatever the batch: 16 GB at 70% of 3.35 TB/s is ~6.8 ms.
    assert 0.006 < p.decode(1, 256) < 0.009 and p.decode(256, 256) < 2 * p.decode(1, 256)
    # A long prefill is compute-bound: 8k tokens are ~8x the FLOPs of 1k, and more for attention.
    assert p.prefill(8192) > 8 * (p.prefill(1024) - 0.0005)
    # 128 KiB of KV a token over 25 GB/s.
    assert abs(p.transfer(1000) - 1000 * 131072 / 25e9) < 1e-9
    with pytest.raises(ValueError, match="does not fit"):
        from pdserve.plan.datasheet import GPUS, MODELS, ModelShape

        MODELS["huge"] = ModelShape(70e9, 80, 64, 8, 128)
        try:
            paper_profile("H100-SXM", "huge", 25)
        finally:
            del MODELS["huge"]
    assert GPUS["H200"].bandwidth > GPUS["H100-SXM"].bandwidth


def test_a_plan_on_paper_scales_rates_per_worker_and_samples_the_splits() -> None:
    out = _plan(
        "--gpu", "H100-SXM", "--workers", "16", "--rates-per-worker", "--rates", "1", "--max-splits", "4",
        "--num-prompts", "60", "--input-len", "1024", "--output-len", "32", "--ttft-slo", "1", "--tpot-slo", "0.05",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "H100-SXM on paper" in out.stdout and "a device per worker" in out.stdout
    splits = sorted({line.split()[0] for line in out.stdout.splitlines() if line.strip().endswith(tuple("0123456789")) and "P" in line.split()[0] and "D" in line.split()[0]})  # fmt: skip
    assert splits == sorted(["1P15D", "6P10D", "10P6D", "15P1D"]), out.stdout
    rates = {line.split()[1] for line in out.stdout.splitlines() if line.split()[:1] == ["6P10D"]}
    assert rates == {"16"}, out.stdout  # 1 a worker x 16 workers
    assert "best split of 16 workers" in out.stdout
