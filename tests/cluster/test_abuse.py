"""The abuse table (`pdserve bench abuse`) as a test, against a real `pdserve up` with short limits:
each case is sent while a normal streaming request runs. Every abusive request gets its expected
answer within a second or its timeout, the normal request finishes in about its usual time, no
worker leaves rotation, and the gateway and the workers go back to idle."""

from __future__ import annotations

import pytest
from harness import start_up

from pdserve.bench import bench_abuse

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def limited_cluster(tmp_path_factory):
    c = start_up(tmp_path_factory.mktemp("abuse"), extra=bench_abuse.LIMITS)
    try:
        c.wait_healthy()
        yield c
    finally:
        c.stop()


def test_abuse_table(limited_cluster):
    c = limited_cluster
    pid = bench_abuse.gateway_pid(c.procs[0].pid)
    assert pid is not None, "no gateway process under pdserve up"
    baseline, rows = bench_abuse.run_all(c.url, pid)
    print()
    print(bench_abuse.format_table(baseline, rows))
    for r in rows:
        assert r.ok, f"{r.case}: {r.answer}"
        assert r.workers_kept, f"{r.case}: a worker left rotation"
        assert r.idle_after, f"{r.case}: the cluster did not go back to idle"
        # Refusals come at once; the timeouts at their limit (2 s here) plus scheduling slack.
        limit = {
            "body stalls after 10 bytes": bench_abuse.BODY_TIMEOUT_S + 3,
            "300 idle connections": bench_abuse.IDLE_TIMEOUT_S + 3,
            "50 connections trickling headers": bench_abuse.IDLE_TIMEOUT_S + 3,
        }.get(r.case)
        if limit is not None:
            assert r.seconds < limit, (r.case, r.seconds)
        # The normal request is not held up beyond sharing the CPU with the abuser's served work.
        assert r.normal_s < 3 * baseline + 5, (r.case, r.normal_s, baseline)
    # The gateway's memory after the whole table is within reach of where it started.
    assert rows[-1].rss_after_mib - rows[0].rss_before_mib < 200
