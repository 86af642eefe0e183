"""`pdserve up` takes its whole process tree with it, even when it is SIGKILLed (no orphans)."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
from harness import process_alive, start_up


@pytest.mark.timeout(300)
def test_sigkilled_up_leaves_no_process_behind(tmp_path):
    c = start_up(tmp_path)
    try:
        c.wait_healthy()
        up = c.procs[0]
        log = (tmp_path / "up.log").read_text()
        children = {name: int(pid) for name, pid in re.findall(r"started (\S+) pid (\d+)", log)}
        assert set(children) == {"gateway", "prefill-0", "decode-0"}, log
        assert all(process_alive(pid) for pid in children.values())

        os.kill(up.pid, signal.SIGKILL)  # no handler runs: only the kernel can take the children down
        up.wait()
        deadline = time.monotonic() + 15
        while any(process_alive(pid) for pid in children.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [n for n, pid in children.items() if process_alive(pid)] == []
        with pytest.raises(httpx.TransportError):
            httpx.get(c.url + "/health", timeout=2)
    finally:
        c.stop()
