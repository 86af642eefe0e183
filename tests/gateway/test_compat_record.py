"""The compatibility record (pdserve/protocol/compat.py) of a real worker runner: every field changed
alone is caught, by the pair handshake and by the gateway's registration; the fields that may differ
are allowed, with their reason; and two runners that really differ (their KV dtype) are refused."""

from __future__ import annotations

import logging

import pytest

from pdserve.gateway.cluster.workers import WorkerRegistry
from pdserve.kv_transfer.handshake import compare_identities
from pdserve.protocol import compat

from .test_control import _register

FIELDS = {
    "architecture", "num_layers", "kv_heads", "head_dim", "weights_hash", "weights_dtype", "quantization",
    "kv_dtype", "page_size", "kv_layout", "batch_invariant", "tokenizer", "chat_template", "protocol",
    "attention_backend", "speculative", "kv_heads_split",
}  # fmt: skip


@pytest.fixture(scope="module")
def record(bundled) -> dict[str, str | int]:
    from pdserve.config import RuntimeConfig
    from pdserve.runtime.engine import Engine

    engine = Engine(RuntimeConfig(device="cpu", max_total_tokens=512, attention_backend="torch"), bundled)
    return engine.runner.fingerprint()


def _changed(value: str | int) -> str | int:
    return value + 1 if isinstance(value, int) else f"{value}-other"


def test_the_record_names_the_model_weights_kv_tokenizer_and_protocol(record):
    assert set(record) == FIELDS
    assert record["kv_dtype"] == record["weights_dtype"] == "float32"
    assert record["tokenizer"] != "none" and record["chat_template"] != "none"  # SmolLM2 has both
    assert record["speculative"] == "none" and record["kv_heads_split"] == "TP 1 (KV heads 0-2)"


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_each_field_changed_alone_is_caught(record, key, caplog):
    other = {**record, key: _changed(record[key])}
    error = compare_identities(record, other, "decode")
    registry = WorkerRegistry()
    registry.add(_register("decode-a", **record), b"a", 0.0)
    reason = registry.check_fingerprint(_register("decode-b", **other))
    if key in compat.MAY_DIFFER:
        assert error is None and reason is None
        with caplog.at_level(logging.INFO, logger="pdserve.kv_transfer"):
            compare_identities(record, other, "decode")
        assert f"{key}: local=" in caplog.text and compat.MAY_DIFFER[key] in caplog.text
        return
    assert error is not None and error.count("local=") == 1 and f"{key}: local={record[key]!r}" in error, (
        error
    )
    assert reason == f"model fingerprint mismatch in: {key}"  # the gateway names the field, not the values


def test_a_runner_with_another_kv_dtype_is_refused(bundled, record):
    from pdserve.config import RuntimeConfig
    from pdserve.runtime.engine import Engine

    half = Engine(
        RuntimeConfig(
            device="cpu", max_total_tokens=512, attention_backend="torch", kv_cache_dtype="float16"
        ),
        bundled,
    ).runner.fingerprint()
    refused, allowed = compat.compare(record, half)
    assert (refused, allowed) == (["kv_dtype"], [])
