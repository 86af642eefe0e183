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
