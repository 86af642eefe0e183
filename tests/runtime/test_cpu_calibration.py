"""`--dtype auto` on CPU: bf16 or fp32 by this host's measured matmul speed (runtime/cpu_calibration.py)."""

from __future__ import annotations


def test_dtype_auto_is_measured_once_per_host_and_cached(tmp_path, monkeypatch) -> None:
    """The first call times both dtypes and saves them; later calls (other workers) read the file, so
    every worker of a host picks the same dtype; an unreadable file is measured again."""
    from pdserve.runtime import cpu_calibration as cal

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    first = cal.matmul_speeds()
    assert first.fp32_us > 0 and first.bf16_us > 0
    (saved,) = (tmp_path / "host").glob("matmul-*.json")
    saved.write_text('{"fp32_us": 500.0, "bf16_us": 100.0}')  # as if another worker measured this
    again = cal.matmul_speeds()
    assert again == cal.MatmulSpeeds(500.0, 100.0) and again.bf16_wins
    assert "bfloat16" in again.why() and "5.00x" in again.why()
    assert not cal.MatmulSpeeds(120.0, 100.0).bf16_wins  # under the margin: fp32, the reference
    saved.write_text("not json")
    assert cal.matmul_speeds().fp32_us != 500.0  # measured afresh
