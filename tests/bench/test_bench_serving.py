"""The serving benchmark against a real `pdserve up` cluster, and its pure parts on fixed inputs."""

from __future__ import annotations

import json
import math
import os

import pytest
from harness import start_up

from pdserve.bench.bench_serving import main, parse_args
from pdserve.bench.launch_servers import llama_server_argv
from pdserve.bench.serving_report import add_memory, format_comparison, format_result, summarize
from pdserve.bench.serving_requests import RequestResult
from pdserve.bench.serving_workload import chat_prompts


def test_llama_server_launch_line(tmp_path):
    """--launch-llama-server serves the bundled GGUF on --launch-port + 12; a bad path is named."""
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    args = parse_args(["--launch-llama-server", str(exe), "--launch-port", "40000"])
    argv = llama_server_argv(args)
    assert argv[0] == str(exe) and argv[argv.index("--port") + 1] == "40012"
    assert argv[argv.index("-m") + 1].endswith(".gguf")
    cores = str(os.cpu_count() or 1)
    assert argv[argv.index("-t") + 1] == cores and argv[argv.index("-tb") + 1] == cores
    assert argv[argv.index("-np") + 1] == "16" and argv[argv.index("-c") + 1] == "16384"
    assert "--no-repack" in argv
    args = parse_args(["--launch-llama-server", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="not an executable file"):
        llama_server_argv(args)


def test_chat_prompts_are_seeded_and_varied():
    a, b = chat_prompts(16, 64, seed=3), chat_prompts(16, 64, seed=3)
    assert a == b
    assert chat_prompts(16, 64, seed=4) != a
    lengths = {len(p.text.split()) for p in a}
    assert len(lengths) > 4, lengths  # context sentences vary the prompt length
    assert all(p.output_len == 64 for p in a)


def test_summarize_known_numbers():
    ok = RequestResult(ok=True, ttft=0.1, e2e=1.1, itl=[0.2] * 5, output_tokens=6, prompt_tokens=10)
    bad = RequestResult(ok=False, error="HTTP 500: boom")
    m = summarize([ok, ok, bad], duration=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["output_throughput"] == pytest.approx(6.0)  # 12 tokens / 2 s
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["mean_tpot_ms"] == pytest.approx(200.0)  # (1.1 - 0.1) / (6 - 1)
    assert m["p99_itl_ms"] == pytest.approx(200.0)
    assert m["concurrency"] == pytest.approx(1.1)
    assert m["errors"] == ["HTTP 500: boom"]


def test_memory_rows_beside_throughput():
    """Launched servers' idle and peak PSS print beside the throughput, with the first target's ratio;
    a server the benchmark did not launch has no such rows of its own."""
    ok = RequestResult(ok=True, ttft=0.1, e2e=1.1, itl=[0.2] * 5, output_tokens=6, prompt_tokens=10)
    pd = add_memory(summarize([ok], 1.0), 1_300_000_000, 1_450_000_000)
    peer = add_memory(summarize([ok], 1.0), 650_000_000, None)
    assert (pd["idle_pss_gb"], pd["peak_pss_gb"]) == (1.3, 1.45) and "peak_pss_gb" not in peer
    table = format_comparison("c=1", ["pdserve", "llama-server"], [pd, peer]).splitlines()
    rows = [line.split() for line in table]
    throughput = next(i for i, r in enumerate(rows) if r[:3] == ["Output", "token", "throughput"])
    assert rows[throughput + 1][-3:] == ["1.30", "0.65", "2.00"]  # idle: pdserve, llama-server, ratio
    assert rows[throughput + 2][-3:] == ["1.45", "nan", "nan"]
    assert "Memory idle, PSS (GB):" in format_result("pdserve", "openai-chat", 1, 1.0, pd)
    assert "Memory" not in format_result("other", "openai-chat", 1, 1.0, summarize([ok], 1.0))


@pytest.mark.timeout(300)
def test_bench_against_cluster(tmp_path):
    c = start_up(tmp_path)
    try:
        c.wait_healthy()
        out = tmp_path / "result.json"
        common = ["--dataset", "chat", "--num-prompts", "4", "--max-concurrency", "2", "--output-len", "8",
                  "--ignore-eos", "--warmup-requests", "1"]  # fmt: skip
        rc = main(["--base-url", c.url, *common, "--output-json", str(out)])
        # Two names for one server: the comparison path, over the native streaming API.
        cmp_out = tmp_path / "compare.json"
        plots = tmp_path / "plots"
        cmp_rc = main([f"--targets=a={c.url},b={c.url}", "--backend", "pdserve-native", *common,
                       "--max-concurrency", "1,2", "--fresh-connections", "--output-json", str(cmp_out),
                       "--plot", str(plots)])  # fmt: skip
        # Goodput: the same server under a target it meets and one nobody meets (a microsecond to TTFT).
        from pdserve.bench.bench_goodput import main as goodput_main

        good = {}
        for name, ttft in (("loose", "60"), ("tight", "0.000001")):
            good[name] = tmp_path / f"goodput-{name}.json"
            flags = ["--base-url", c.url, "--dataset", "chat", "--num-prompts", "4", "--output-len", "8",
                     "--ignore-eos", "--warmup-requests", "0", "--rates", "2,50", "--ttft-slo", ttft,
                     "--tpot-slo", "30", "--output-json", str(good[name])]  # fmt: skip
            assert goodput_main(flags) == 0
    finally:
        c.stop()
    assert rc == 0
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    m = run["metrics"]
    assert (m["completed"], m["failed"]) == (4, 0)
    assert m["total_output_tokens"] == 32  # ignore_eos: every request runs to its 8 tokens
    assert m["output_throughput"] > 0 and m["request_throughput"] > 0
    for name in ("ttft", "itl", "tpot", "e2e"):
        assert 0 < m[f"median_{name}_ms"] <= m[f"p99_{name}_ms"], name
    assert m["median_ttft_ms"] < m["median_e2e_ms"]
    assert m["total_input_tokens"] > 0  # usage came back through stream_options

    loose = json.loads(good["loose"].read_text())["results"]["server"]
    tight = json.loads(good["tight"].read_text())["results"]["server"]
    assert [r["rate"] for r in loose] == [2.0, 50.0]
    for r in loose:  # every request served well within a minute: all of it is goodput
        assert (r["requests"], r["good"], r["failed"]) == (4, 4, 0) and r["attainment"] == 1.0
        assert abs(r["goodput"] - r["throughput"]) < 1e-9 and r["goodput"] == 4 / r["duration_s"]
    for r in tight:
        assert r["good"] == 0 and r["goodput"] == 0.0 and r["ttft_attainment"] == 0.0 and r["throughput"] > 0

    assert cmp_rc == 0
    cmp = json.loads(cmp_out.read_text())
    assert [(s["target"], s["concurrency"]) for s in cmp["summary"]] == [
        ("a", 1),
        ("b", 1),
        ("a", 2),
        ("b", 2),
    ]
    for s in cmp["summary"]:
        assert s["metrics"]["completed"] == 4
        assert s["metrics"]["total_output_tokens"] == 32
        assert not math.isnan(s["metrics"]["median_itl_ms"])

    # --plot: non-empty PNGs with the expected axes, both targets on each, and the raw samples.
    for name in ("ttft_cdf.png", "itl_cdf.png", "throughput.png"):
        png = (plots / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, (name, len(png))
    raw = json.loads((plots / "results.json").read_text())
    for name, what in (("ttft_cdf.png", "TTFT (ms)"), ("itl_cdf.png", "inter-token latency (ms)")):
        axes = raw["plots"][name]
        assert [a["title"] for a in axes] == ["concurrency 1", "concurrency 2"]
        assert all(a["xlabel"] == what and a["series"] == ["a", "b"] for a in axes), axes
    (tp,) = raw["plots"]["throughput.png"]
    assert (tp["xlabel"], tp["ylabel"], tp["series"]) == (
        "concurrency",
        "output throughput (tok/s)",
        ["a", "b"],
    )
    by = {(s["target"], s["concurrency"]): s for s in raw["samples"]}
    assert set(by) == {("a", 1), ("b", 1), ("a", 2), ("b", 2)}
    assert all(len(s["ttft"]) == 4 and len(s["itl"]) > 0 for s in by.values())


def test_goodput_counts_requests_within_both_targets():
    from pdserve.bench.bench_goodput import best, goodput, tpot
    from pdserve.bench.serving_requests import RequestResult

    rs = [
        RequestResult(ok=True, ttft=0.5, e2e=1.5, output_tokens=11),  # TPOT 0.1: within both
        RequestResult(ok=True, ttft=2.0, e2e=3.0, output_tokens=11),  # TTFT missed
        RequestResult(ok=True, ttft=0.2, e2e=4.2, output_tokens=11),  # TPOT 0.4 missed
        RequestResult(ok=False, ttft=0.1, e2e=0.2, output_tokens=0),  # failed: meets nothing
    ]
    assert tpot(rs[2]) == 0.4 and tpot(RequestResult(ok=True, output_tokens=1)) == 0.0
    g = goodput(rs, duration=2.0, ttft_slo=1.0, tpot_slo=0.2)
    assert (g["good"], g["failed"], g["goodput"], g["throughput"]) == (1, 1, 0.5, 1.5)
    assert (g["attainment"], g["ttft_attainment"], g["tpot_attainment"]) == (0.25, 0.5, 0.5)
    rows = [{"rate": 1.0, "goodput": 0.9}, {"rate": 2.0, "goodput": 1.7}, {"rate": 4.0, "goodput": 1.7}]
    assert best(rows)["rate"] == 2.0  # a tie goes to the lower rate


def test_goodput_shift_to_changes_the_random_workloads_second_half():
    import argparse

    from pdserve.bench.bench_goodput import _shape, _workload
    from pdserve.bench.serving_workload import load_tokenizer

    tok = load_tokenizer(None)
    args = argparse.Namespace(
        dataset="random", random_input_len=200, random_output_len=8, random_range_ratio=1.0,
        output_len=None, seed=3, shift_to=(20, 96),
    )  # fmt: skip
    prompts = _workload(args, 5, tok, seed=3)
    assert [p.output_len for p in prompts] == [8, 8, 8, 96, 96]
    sizes = [len(tok.encode(p.text, add_special_tokens=False)) for p in prompts]
    assert all(150 <= n <= 250 for n in sizes[:3]) and all(10 <= n <= 40 for n in sizes[3:]), sizes
    assert [
        p.output_len for p in _workload(argparse.Namespace(**{**vars(args), "shift_to": None}), 4, tok, 3)
    ] == [8] * 4
    with pytest.raises(argparse.ArgumentTypeError):
        _shape("64")
