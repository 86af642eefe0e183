"""Fixtures shared by the protocol tests: a KV sender and receiver on small pools, started and closed."""

from __future__ import annotations

import pytest
from protocol.test_protocol import FAST, FP, _pool

from pdserve.kv_transfer import KVReceiver, KVSender


@pytest.fixture
def sender():
    s = KVSender(_pool(1), FP, "127.0.0.1", 0, FAST)
    s.start()
    yield s
    s.close()


@pytest.fixture
def receiver():
    r = KVReceiver(_pool(2), FP, FAST)
    r.start()
    yield r
    r.close()
