"""The multiturn and shared-prefix workloads: their pure parts, and multiturn against real clusters with the
prefix cache on and off."""

from __future__ import annotations

import json
import math
import socket

import pytest

from pdserve.bench.bench_serving import main
from pdserve.bench.serving_report import summarize_turns
from pdserve.bench.serving_requests import RequestResult
from pdserve.bench.serving_workload import flat_text, multiturn_conversations, shared_prefix_prompts


def test_conversations_are_seeded_with_a_long_first_turn():
    a = multiturn_conversations(3, 4, doc_len=500, output_len=16, seed=5)
    assert a == multiturn_conversations(3, 4, doc_len=500, output_len=16, seed=5)
    assert a != multiturn_conversations(3, 4, doc_len=500, output_len=16, seed=6)
    assert all(len(c.turns) == 4 and c.output_len == 16 for c in a)
    assert all(len(c.turns[0]) >= 4 * 500 > 10 * len(c.turns[1]) for c in a)  # ~4 characters a token


def test_shared_prefix_prompts_share_one_system_prompt():
    ps = shared_prefix_prompts(8, prefix_len=300, output_len=16, seed=2)
    assert len({p.system for p in ps}) == 1 and len(ps[0].system or "") >= 4 * 300
    assert len({p.text for p in ps}) > 4
    assert flat_text(ps[0]).startswith(ps[0].system or "")


def test_summarize_turns_known_numbers():
    def r(ttft: float, prompt: int, cached: int | None) -> RequestResult:
        return RequestResult(ok=True, ttft=ttft, prompt_tokens=prompt, cached_tokens=cached)

    convs = [
        [r(1.0, 100, 0), r(0.2, 150, 96), r(0.1, 200, 144)],
        [r(3.0, 100, 0), r(0.4, 150, None)],  # a server that stays silent is left out of the hit rate
    ]
    s = summarize_turns(convs)
    assert [t["completed"] for t in s["turns"]] == [2, 2, 1]
    assert [t["median_ttft_ms"] for t in s["turns"]] == pytest.approx([2000.0, 300.0, 100.0])
    assert [t["cache_hit_rate"] for t in s["turns"]] == pytest.approx([0.0, 96 / 150, 144 / 200])
    assert s["median_ttft_turn2plus_ms"] == pytest.approx(200.0)  # median of 0.2, 0.4, 0.1 s
    assert s["ttft_ratio_turn2plus"] == pytest.approx(0.1)
    assert math.isnan(summarize_turns([[r(1.0, 100, None)]])["turns"][0]["cache_hit_rate"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(600)
def test_multiturn_with_and_without_the_prefix_cache(tmp_path):
    out = tmp_path / "multiturn.json"
    rc = main([
        "--launch-pdserve", "--launch-port", str(_free_port()), "--launch-log-dir", str(tmp_path),
        "--pdserve-args", "--threads-per-worker 1 --max-total-tokens 8192",
        "--launch-pdserve-variant", "nocache=--disable-radix-cache",
        "--dataset", "multiturn", "--num-prompts", "2", "--num-turns", "2", "--multiturn-doc-len", "128",
        "--max-concurrency", "2", "--output-len", "8", "--ignore-eos", "--warmup-requests", "1",
        "--output-json", str(out),
    ])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert [(r["target"], len(r["turns"]["turns"])) for r in data["runs"]] == [("pdserve", 2), ("nocache", 2)]
    by = {s["target"]: s for s in data["summary"]}
    assert list(by) == ["pdserve", "nocache"]
    for s in by.values():
        assert (s["metrics"]["completed"], s["metrics"]["failed"]) == (4, 0)
        first, second = s["turns"]["turns"]
        assert (first["turn"], first["completed"], second["turn"], second["completed"]) == (1, 2, 2, 2)
        # Turn 2 holds turn 1's prompt, its 8-token answer and a question.
        assert second["mean_prompt_tokens"] > first["mean_prompt_tokens"] + 8 > 100
        assert first["median_ttft_ms"] > 0 and second["median_ttft_ms"] > 0
        assert s["turns"]["ttft_ratio_turn2plus"] > 0
    on, off = by["pdserve"]["turns"]["turns"], by["nocache"]["turns"]["turns"]
    # Turn 2 reuses turn 1's prompt, less at most its last partial page (16 tokens).
    assert on[1]["cache_hit_rate"] * on[1]["mean_prompt_tokens"] >= on[0]["mean_prompt_tokens"] - 16
    assert off[0]["cache_hit_rate"] == off[1]["cache_hit_rate"] == 0.0  # reported, and zero
    assert by["nocache"]["metrics"]["cache_hit_rate"] == 0.0 < by["pdserve"]["metrics"]["cache_hit_rate"]
    # The servers' own counters: turn 2's history stays on the decode worker, whose pages do not move again.
    srv = {r["target"]: r["server"] for r in data["runs"]}
    assert srv["nocache"]["pdserve_transfer_skipped_tokens_total"] == 0
    assert srv["pdserve"]["pdserve_transfer_skipped_tokens_total"] >= on[0]["mean_prompt_tokens"] - 16
    assert (
        0
        < srv["pdserve"]["pdserve_kv_transfer_bytes_total"]
        < srv["nocache"]["pdserve_kv_transfer_bytes_total"]
    )
