"""The serving benchmark against a real `pdserve up` cluster, and its pure parts on fixed inputs."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
from harness import start_up

from pdserve.bench.bench_serving import main, parse_args
from pdserve.bench.launch_servers import llama_server_argv
from pdserve.bench.serving_report import (
    add_memory,
    format_comparison,
    format_result,
    format_starts,
    summarize,
)
from pdserve.bench.serving_requests import RequestResult
from pdserve.bench.serving_workload import chat_prompts
from pdserve.launch.supervisor import pdserve_command


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


def test_start_rows_beside_memory():
    """A launched server's start (spawn to healthy, start-up peak) prints beside its idle and run peaks,
    and the start-up table says which start each was and how much of its weights the page cache held."""
    ok = RequestResult(ok=True, ttft=0.1, e2e=1.1, itl=[0.2] * 5, output_tokens=6, prompt_tokens=10)
    pd_start = {"healthy_s": 30.0, "peak_pss": 2_600_000_000, "cold": True, "page_cache_share": 1.0}
    ls_start = {"healthy_s": 2.0, "peak_pss": None, "cold": None, "page_cache_share": 0.5}
    pd = add_memory(summarize([ok], 1.0), 1_300_000_000, 1_450_000_000, pd_start)
    peer = add_memory(summarize([ok], 1.0), 650_000_000, None, ls_start)
    assert (pd["start_to_healthy_s"], pd["startup_peak_pss_gb"]) == (30.0, 2.6)
    assert "startup_peak_pss_gb" not in peer
    rows = [
        line.split()
        for line in format_comparison("c=1", ["pdserve", "llama-server"], [pd, peer]).splitlines()
    ]
    start = next(i for i, r in enumerate(rows) if r[:3] == ["Start", "to", "healthy"])
    assert rows[start][-3:] == ["30.00", "2.00", "15.00"]
    assert rows[start + 1][-3:] == ["2.60", "nan", "nan"] and rows[start + 2][:2] == ["Memory", "idle,"]
    table = format_starts({"pdserve": pd_start, "llama-server": ls_start}, {"pdserve": 1_300_000_000})
    lines = table.splitlines()
    assert lines[2].split()[:6] == ["pdserve", "30.00", "2.60", "1.30", "100%", "cold:"]
    assert lines[3].split() == ["llama-server", "2.00", "50%", "-"]
    assert "does not drop" in lines[-1]


def test_a_short_comparison_is_one_line_of_flags():
    """8 requests at concurrency 1 and 16 at 8, 64 tokens each: --num-prompts per level, --max-tokens."""
    from pdserve.bench.bench_serving import _levels

    args = parse_args(["--max-concurrency", "1,8", "--num-prompts", "8,16", "--max-tokens", "64"])
    assert _levels(args) == [(1, 8), (8, 16)] and args.output_len == 64
    assert parse_args(["--output-len", "32"]).output_len == 32 and not args.cold_start
    with pytest.raises(SystemExit):
        _levels(parse_args(["--max-concurrency", "1,8", "--num-prompts", "8,16,32"]))


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
                     "--tpot-slo", "30", "--slo-percentile", "90", "--output-json", str(good[name])]  # fmt: skip
            assert goodput_main(flags) == 0
        # A Mooncake trace replayed: arrivals at 0, 0.1, 0.2 and 1.5 s (2/s on average), lengths its own.
        trace = tmp_path / "trace.jsonl"
        trace.write_text("".join(
            json.dumps({"timestamp": ms, "input_length": 12, "output_length": n, "hash_ids": [1]}) + "\n"
            for ms, n in ((0, 3), (100, 5), (200, 2), (1500, 4))))  # fmt: skip
        good["trace"] = tmp_path / "goodput-trace.json"
        goodput_plots = tmp_path / "goodput-plots"
        flags = ["--base-url", c.url, "--trace", str(trace), "--num-prompts", "10", "--ignore-eos",
                 "--warmup-requests", "0", "--rates", "1,20", "--ttft-slo", "60", "--tpot-slo", "30",
                 "--output-json", str(good["trace"]), "--plot", str(goodput_plots)]  # fmt: skip
        assert goodput_main(flags) == 0
        # The planner's profile through this cluster, at points small enough for a test.
        from pdserve.plan.measure_cluster import ClusterPoints, measure_cluster

        points = ClusterPoints(prefill_tokens=(16, 64), prefix_tokens=(64,), batches=(1, 2), contexts=(16,),
                               fit_shapes=((64, 8), (16, 12)))  # fmt: skip
        profile = measure_cluster(c.url, layers=30, rounds=1, steps=6, points=points)
    finally:
        c.stop()
    assert rc == 0
    # Every point measured and positive; the efficiency fitted within its range.
    assert profile.prefill_tokens == [16, 64] and min(profile.prefill_s) > 0
    assert profile.prefix_tokens == [64] and len(profile.prefix_s[0]) == 2 and min(profile.prefix_s[0]) > 0
    assert len(profile.decode_s) == 2 and all(len(r) == 1 and r[0] > 0 for r in profile.decode_s)
    assert (
        0 < profile.shared_efficiency <= 1
        and "fitted to 2 traces of 24 Poisson arrivals" in profile.notes[-1]
    )
    # ... and the trace run replayed over it: both rates, predicted beside measured.
    profile.save(str(tmp_path / "profile.json"))
    replayed = subprocess.run(pdserve_command("plan", "--profile", str(tmp_path / "profile.json"), "--replay",
                                              str(good["trace"]), "--replay-split", "server=1P1D"),
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    lines = [line.split() for line in replayed.stdout.splitlines() if line.split()[:2] == ["server", "1P1D"]]
    rows, (capacity,) = lines[:-1], lines[-1:]
    assert [r[2] for r in rows] == ["1", "20"], replayed.stdout
    # Targets this loose are met at both rates: DistServe's goodput is at least the higher, both ways.
    assert capacity[2:4] == [">=20", ">=20"], replayed.stdout
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
    # --slo-percentile 90: every loose rate passes, no tight one does (its p90 TTFT is over a microsecond).
    assert all(r["passes"] and 0 < r["ttft_p"] < 60 for r in loose)
    assert not any(r["passes"] for r in tight)
    # The trace: its 4 requests at each rate; at 1/s (a clock 2x slower) the last arrives 3 s in, so the
    # run lasts at least that; at 20/s (10x faster) it arrives 0.15 s in.
    replay = json.loads(good["trace"].read_text())["results"]["server"]
    assert [(r["rate"], r["requests"], r["good"]) for r in replay] == [(1.0, 4, 4), (20.0, 4, 4)]
    assert replay[0]["duration_s"] >= 3.0 and replay[1]["duration_s"] < replay[0]["duration_s"] - 1.5
    # Each request as `pdserve plan --replay` simulates it again: sent on the trace's clock, its prompt
    # as the server counted it, the lengths the trace asked for (--ignore-eos: all of them produced).
    sent = replay[0]["per_request"]
    assert [r["sent_at"] for r in sent] == pytest.approx([0.0, 0.2, 0.4, 3.0], abs=0.15)
    assert [(r["max_tokens"], r["output_tokens"], r["ok"]) for r in sent] == [
        (3, 3, True), (5, 5, True), (2, 2, True), (4, 4, True)]  # fmt: skip
    assert all(r["prompt_tokens"] >= 12 and 0 < r["ttft"] <= r["e2e"] for r in sent)
    png = (goodput_plots / "goodput.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    drawn = json.loads((goodput_plots / "goodput.json").read_text())["plots"]["goodput.png"]
    assert [a["xlabel"] for a in drawn] == ["request rate (req/s)"] * 2
    assert drawn[0]["series"] == ["server", "offered rate"] and drawn[1]["series"] == ["server"]

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


def test_goodput_percentiles_count_a_failed_request_as_late():
    from pdserve.bench.bench_goodput import best_passing, goodput, percentile
    from pdserve.bench.serving_requests import RequestResult

    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert percentile([1.0, float("inf")], 50) == float("inf") and percentile([], 90) == float("inf")
    ok = [RequestResult(ok=True, ttft=0.1 * k, e2e=0.1 * k + 1.0, output_tokens=11) for k in range(1, 10)]
    g = goodput(ok, 1.0, ttft_slo=0.9, tpot_slo=0.11, slo_percentile=90)
    assert g["ttft_p"] == pytest.approx(0.82) and g["tpot_p"] == pytest.approx(0.1) and g["passes"]
    # One failed request of 10: p80 falls between the 8th and 9th TTFT, p90 on the failed one's inf.
    with_failed = [*ok, RequestResult(ok=False)]
    g = goodput(with_failed, 1.0, ttft_slo=0.9, tpot_slo=0.11, slo_percentile=80)
    assert g["ttft_p"] == pytest.approx(0.82) and g["passes"]
    g = goodput(with_failed, 1.0, ttft_slo=0.9, tpot_slo=0.11, slo_percentile=90)
    assert g["ttft_p"] == float("inf") and not g["passes"]
    assert "passes" not in goodput(ok, 1.0, 0.9, 0.1)
    rows = [{"rate": 1.0, "passes": True}, {"rate": 2.0, "passes": True}, {"rate": 4.0, "passes": False}]
    assert best_passing(rows)["rate"] == 2.0 and best_passing(rows[2:]) is None


def test_a_trace_is_read_in_either_format_and_scaled_to_a_rate(tmp_path):
    from pdserve.bench.goodput_trace import TraceError, arrivals_at, load_trace, mean_rate

    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"timestamp": 2000, "input_length": 7, "output_length": 3}\n\n'
                     '{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [4, 5]}\n'
                     '{"timestamp": 4000, "input_length": 9, "output_length": 1}\n')  # fmt: skip
    rows = load_trace(str(jsonl))
    assert [(r.arrival_s, r.input_len, r.output_len) for r in rows] == [(0, 5, 2), (2, 7, 3), (4, 9, 1)]
    assert mean_rate(rows) == 0.5 and arrivals_at(rows, 2.0) == [0.0, 0.5, 1.0]
    assert len(load_trace(str(jsonl), limit=2)) == 2
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.1805900,396,109\n")  # fmt: skip
    rows = load_trace(str(azure))
    assert [r.input_len for r in rows] == [374, 396] and rows[1].arrival_s == pytest.approx(3.5)
    bad = {
        "x.jsonl": (
            '{"timestamp": 0, "input_length": 5}\n',
            "needs timestamp, input_length and output_length",
        ),
        "y.jsonl": ('{"timestamp": 0, "input_length": 0, "output_length": 1}\n', "input_length must be >= 1"),
        "z.jsonl": ("not json\n", "z.jsonl:1: not JSON"),
        "w.jsonl": ('{"timestamp": 5, "input_length": 1, "output_length": 1}\n', "at least 2 requests"),
        "v.csv": ("TIMESTAMP,Tokens\n1,2\n", "the header needs"),
        "u.csv": ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n1,1,1\n", "neither seconds"),
        "t.txt": ("", "a trace is .jsonl"),
    }
    for name, (text, message) in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(TraceError, match=message):
            load_trace(str(tmp_path / name))
