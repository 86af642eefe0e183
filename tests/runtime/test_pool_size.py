"""The CPU KV pool's default size: what the worker can use, capped at a share of the host's memory."""

from __future__ import annotations

import os
import re

from pdserve.runtime.kv_sizing import (
    CPU_DEFAULT_MAX_TOTAL_TOKENS,
    CPU_POOL_MEMORY_SHARE,
    default_cpu_pool_tokens,
    mem_available_bytes,
)


def test_default_cpu_pool_size():
    """Context length x running requests, capped at a share of MemAvailable; whole pages."""
    gib = 2**30
    bpt = 46080  # the bundled model's bytes per token in float32
    # Plenty of memory: what the worker can use.
    tokens, why = default_cpu_pool_tokens(8192, 4, 16, bpt, 64 * gib)
    assert tokens == 8192 * 4
    assert "context 8192 x 4 running requests = 32768 tokens" in why and "under 10%" in why
    # Less: the share of MemAvailable, rounded down to whole pages.
    tokens, why = default_cpu_pool_tokens(8192, 64, 16, bpt, 8 * gib)
    cap = int(8 * gib * CPU_POOL_MEMORY_SHARE) // bpt
    assert tokens == cap // 16 * 16 and tokens * bpt <= CPU_POOL_MEMORY_SHARE * 8 * gib
    assert f"capped at 10% of MemAvailable 8.00 GiB = {cap} tokens" in why
    # Almost none: still one page.
    assert default_cpu_pool_tokens(8192, 64, 16, bpt, 1000)[0] == 16
    # Unknown memory: the old fixed default, or less when the worker cannot use that much.
    assert default_cpu_pool_tokens(8192, 64, 16, bpt, None)[0] == CPU_DEFAULT_MAX_TOTAL_TOKENS
    assert default_cpu_pool_tokens(2048, 2, 16, bpt, None)[0] == 4096


def test_mem_available_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683784 kB\nMemFree: 1 kB\nMemAvailable:   23357132 kB\n")
    assert mem_available_bytes(str(meminfo)) == 23357132 * 1024
    assert mem_available_bytes(str(tmp_path / "missing")) is None
    if os.path.exists("/proc/meminfo"):
        assert (mem_available_bytes() or 0) > 0


def test_a_cpu_runner_sizes_its_pool_and_says_why(tiny_folders, caplog):
    """Without --max-total-tokens the runner takes the formula's size and names it in the start-up
    line; with it, the flag."""
    import logging

    from pdserve.config import RuntimeConfig
    from pdserve.runtime.loader import load_model
    from pdserve.runtime.runner import ModelRunner

    loaded = load_model(tiny_folders["llama-untied"], dtype="float32", device="cpu")
    cfg = RuntimeConfig(device="cpu", max_running_requests=3, context_length=512, attention_backend="torch")
    with caplog.at_level(logging.INFO, logger="pdserve.runtime.runner"):
        runner = ModelRunner(cfg, loaded)
    want, why = default_cpu_pool_tokens(512, 3, 16, runner.geometry.bytes_per_token, mem_available_bytes())
    assert runner.max_total_tokens == want == 512 * 3  # a tiny model: far under the memory cap
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool:")]

    # MemAvailable moves between the runner's read and ours: compare the sentence without it.
    def no_mem(s: str) -> str:
        return re.sub(r"MemAvailable [0-9.]+ GiB", "MemAvailable", s)

    assert no_mem(line).endswith(no_mem(why)) and "memory taken as pages are first used" in line, line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pdserve.runtime.runner"):
        runner = ModelRunner(
            RuntimeConfig(device="cpu", max_total_tokens=256, attention_backend="torch"), loaded
        )
    assert runner.max_total_tokens == 256
    assert any(r.getMessage().endswith(": --max-total-tokens") for r in caplog.records)
