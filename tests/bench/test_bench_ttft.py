"""`pdserve bench ttft` against a real `pdserve up` cluster: one row per prompt length, with the served
time holding the prefill worker's forward, and the streamed first chunk's time."""

from __future__ import annotations

import pytest
from harness import start_up

from pdserve.bench.bench_ttft import main


@pytest.mark.timeout(300)
def test_ttft_table_against_cluster(tmp_path, capsys):
    c = start_up(tmp_path)
    try:
        c.wait_healthy()
        rc = main(["--url", c.url, "--lengths", "8", "40", "--rounds", "2", "--gap-ms", "0", "--num-threads", "1",
                   "--dtype", "float32", "--quantization", "none"])  # fmt: skip
    finally:
        c.stop()
    assert rc == 0
    out = capsys.readouterr().out
    assert "quantization none" in out and "dtype torch.float32" in out
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 7 and parts[0].isdigit():
            rows[int(parts[0])] = [float(x) for x in parts[1:]]
    assert sorted(rows) == [8, 40], out
    for offline, served, ratio, streamed, s_ratio, forward in rows.values():
        assert offline > 0 and forward > 0
        assert served >= forward, "the client's wall clock holds the prefill worker's forward"
        assert streamed > 0
        # the table's milliseconds are rounded to 0.1 and its ratio to 0.01
        assert ratio == pytest.approx(served / offline, rel=0.01, abs=0.006)
        assert s_ratio == pytest.approx(streamed / offline, rel=0.01, abs=0.006)


def test_bad_lengths_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--lengths", "0"])
    assert "--lengths must be >= 1" in capsys.readouterr().err
