"""`pdserve up`'s start-up summary with API keys set: the KV bootstrap lines come from `/workers`, an
admin endpoint, so the launcher asks it with the admin key it has (it used to ask without one, got a
401 and dropped the lines silently); no key is ever printed."""

from __future__ import annotations

import glob
import os
import re
import time

import pytest
from harness import start_up

pytestmark = pytest.mark.timeout(300)

API_KEY = "summary-inference-key"
ADMIN_KEY = "summary-admin-key"


def test_start_up_summary_lists_the_kv_bootstrap_with_keys_set(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", API_KEY)
    monkeypatch.setenv("PDSERVE_ADMIN_API_KEY", ADMIN_KEY)
    c = start_up(tmp_path)
    monkeypatch.undo()
    try:
        up, log_path = c.procs[0], tmp_path / "up.log"
        deadline = time.monotonic() + 240
        while "pdserve is up at" not in log_path.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        time.sleep(0.5)  # the summary's lines follow in the same write
        log = log_path.read_text()
        assert re.search(r"KV bootstrap  127\.0\.0\.1:\d+ \(prefill-0; CurveZMQ\)", log), log
        assert "not listed" not in log, log
    finally:
        c.stop()
    for path in glob.glob(os.path.join(tmp_path, "*.log")):
        text = open(path).read()
        assert API_KEY not in text and ADMIN_KEY not in text, path
