"""The serving benchmark's numbers: per-run metrics, per-turn TTFT and cache hits, pdserve's own
KV-transfer counters, the memory of the servers the benchmark launched, and the tables printed from them."""

from __future__ import annotations

import httpx
import numpy as np

from pdserve.bench.serving_requests import RequestResult


def cache_hit_rate(results: list[RequestResult]) -> float:
    """Cached / prompt tokens over the successful responses whose server reported cached tokens."""
    told = [r for r in results if r.ok and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in told)
    return sum(r.cached_tokens or 0 for r in told) / prompt if prompt else float("nan")


# pdserve's own counters, read from /metrics around each run (other servers: not read).
SERVER_COUNTERS = (
    "pdserve_prompt_tokens_total",
    "pdserve_kv_transfer_bytes_total",
    "pdserve_transfer_skipped_tokens_total",
    "pdserve_local_prefill_requests_total",
)


def server_counters(url: str) -> dict[str, float]:
    try:
        r = httpx.get(url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    out = {}
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        if name in SERVER_COUNTERS:
            out[name] = float(value)
    return out


def format_server(before: dict[str, float], after: dict[str, float], requests: int) -> str | None:
    """What the run cost the server's KV transfer, from its counters; None when it has none."""
    if not after:
        return None
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    mib = d.get("pdserve_kv_transfer_bytes_total", 0.0) / 2**20
    prompt = d.get("pdserve_prompt_tokens_total", 0.0)
    skipped = d.get("pdserve_transfer_skipped_tokens_total", 0.0)
    return (
        f"  server: KV moved {mib:.1f} MiB ({mib / max(requests, 1):.2f} MiB/request), "
        f"{skipped / prompt if prompt else 0.0:.0%} of prompt tokens held by the decode worker (not moved), "
        f"{d.get('pdserve_local_prefill_requests_total', 0.0):.0f} local prefills"
    )


def _median_ms(xs: list[float]) -> float:
    return float(np.median(xs)) * 1e3 if xs else float("nan")


def summarize_turns(convs: list[list[RequestResult]]) -> dict:
    """Per turn: median TTFT and cache hit rate; and the median TTFT of turns 2+ over turn 1's."""
    by_turn = [
        [c[k] for c in convs if len(c) > k and c[k].ok] for k in range(max(map(len, convs), default=0))
    ]
    first = _median_ms([r.ttft for r in by_turn[0]]) if by_turn else float("nan")
    turns = []
    for k, rs in enumerate(by_turn):
        ttft = _median_ms([r.ttft for r in rs])
        turns.append({
            "turn": k + 1, "completed": len(rs), "median_ttft_ms": ttft, "ttft_ratio": ttft / first,
            "mean_prompt_tokens": sum(r.prompt_tokens for r in rs) / len(rs) if rs else 0.0,
            "cache_hit_rate": cache_hit_rate(rs),
        })  # fmt: skip
    later = _median_ms([r.ttft for rs in by_turn[1:] for r in rs])
    return {"turns": turns, "median_ttft_turn2plus_ms": later, "ttft_ratio_turn2plus": later / first}


def format_turns(title: str, names: list[str], summaries: list[dict]) -> str:
    """One row per turn; for each target its median TTFT, that over turn 1's, and its cache hit rate."""
    head = f"{'turn':<6}{'prompt tok':>11}" + "".join(
        f"{n + ' TTFT ms':>20}{'/turn 1':>9}{'hit':>7}" for n in names
    )
    lines = [f"== {title} ==", head]
    for k, row in enumerate(summaries[0]["turns"]):
        line = f"{row['turn']:<6}{row['mean_prompt_tokens']:>11.0f}"
        for s in summaries:
            t = (
                s["turns"][k]
                if k < len(s["turns"])
                else {
                    "median_ttft_ms": float("nan"),
                    "ttft_ratio": float("nan"),
                    "cache_hit_rate": float("nan"),
                }
            )
            line += f"{t['median_ttft_ms']:>20.0f}{t['ttft_ratio']:>9.2f}{t['cache_hit_rate']:>7.2f}"
        lines.append(line)
    line = f"{'2+':<6}{'':>11}"
    for s in summaries:
        line += f"{s['median_ttft_turn2plus_ms']:>20.0f}{s['ttft_ratio_turn2plus']:>9.2f}{'':>7}"
    return "\n".join(lines + [line])


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    m: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "cache_hit_rate": cache_hit_rate(results),
        "mean_output_len": out_tokens / len(ok) if ok else 0.0,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": in_tokens / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "concurrency": sum(r.e2e for r in ok) / duration if duration else 0.0,
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "itl": [x for r in ok for x in r.itl],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "e2e": [r.e2e for r in ok],
    }
    for name, xs in series.items():
        a = np.asarray(xs, dtype=np.float64) * 1e3  # ms
        for stat, fn in (("mean", np.mean), ("median", np.median), ("p99", lambda v: np.percentile(v, 99))):
            m[f"{stat}_{name}_ms"] = float(fn(a)) if a.size else float("nan")
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        m["errors"] = errors[:5]
    return m


_ROWS = [  # (label, metric key)
    ("Successful requests", "completed"), ("Failed requests", "failed"),
    ("Benchmark duration (s)", "duration_s"), ("Total input tokens", "total_input_tokens"),
    ("Total generated tokens", "total_output_tokens"), ("Cache hit rate", "cache_hit_rate"),
    ("Mean output tokens/request", "mean_output_len"),
    ("Request throughput (req/s)", "request_throughput"), ("Input token throughput (tok/s)", "input_throughput"),
    ("Output token throughput (tok/s)", "output_throughput"),
    # Launched servers only (launch_servers.py, process_memory.py): the time from spawn to healthy, the PSS
    # of the server's process tree at its peak during start-up, idle after start-up, and the highest
    # sample during the run(s).
    ("Start to healthy (s)", "start_to_healthy_s"), ("Memory start-up peak, PSS (GB)", "startup_peak_pss_gb"),
    ("Memory idle, PSS (GB)", "idle_pss_gb"), ("Memory peak, PSS (GB)", "peak_pss_gb"),
    ("Concurrency (observed)", "concurrency"),
] + [
    (f"{s.capitalize()} {n.upper()} (ms)", f"{s}_{n}_ms")
    for n in ("ttft", "itl", "tpot", "e2e") for s in ("mean", "median", "p99")
]  # fmt: skip


def add_memory(m: dict, idle: int | None, peak: int | None, start: dict | None = None) -> dict:
    """`m` with the server's idle and peak PSS in GB (1e9 bytes), for those known, and from `start` (a
    launched server's StartUp as a dict) its start-to-healthy time and start-up peak; returns `m`."""
    if start is not None:
        m["start_to_healthy_s"] = start["healthy_s"]
        if start.get("peak_pss") is not None:
            m["startup_peak_pss_gb"] = start["peak_pss"] / 1e9
    if idle is not None:
        m["idle_pss_gb"] = idle / 1e9
    if peak is not None:
        m["peak_pss_gb"] = peak / 1e9
    return m


def _share(v: float | None) -> str:
    return "unknown" if v is None else f"{v:.0%}"


def format_starts(starts: dict[str, dict], idle: dict[str, int]) -> str:
    """The launched servers' starts, one row each (`starts`: StartUp dicts by name; `idle`: idle PSS in
    bytes), with what kind of start each was."""
    lines = [
        "== start-up: one server at a time, each spawned once the one before was healthy ==",
        f"{'server':<16}{'spawn to healthy (s)':>21}{'start-up peak (GB)':>20}{'idle (GB)':>11}"
        f"{'weights in page cache':>23}  start",
    ]
    for name, s in starts.items():
        peak, rest = s.get("peak_pss"), idle.get(name)
        kind = {True: "cold: empty PDSERVE_CACHE_DIR", False: "warm: the usual PDSERVE_CACHE_DIR"}
        lines.append(
            f"{name:<16}{s['healthy_s']:>21.2f}{'' if peak is None else f'{peak / 1e9:.2f}':>20}"
            f"{'' if rest is None else f'{rest / 1e9:.2f}':>11}{_share(s.get('page_cache_share')):>23}"
            f"  {kind.get(s.get('cold'), '-')}"
        )
    lines.append(
        "(PSS of each server's process tree; weights in page cache: the share of its weight files the OS "
        "page cache held at spawn, which the benchmark does not drop)"
    )
    return "\n".join(lines)


def _fmt(v: float) -> str:
    return f"{v:.0f}" if isinstance(v, int) else f"{v:.2f}"


def format_result(name: str, backend: str, concurrency: int, rate: float, m: dict) -> str:
    lines = [
        f"{' Serving Benchmark Result: ' + name + ' ':=^56}",
        f"{'Backend:':<40}{backend:>16}",
        f"{'Traffic request rate:':<40}{rate:>16}",
        f"{'Max request concurrency:':<40}{concurrency:>16}",
    ]
    for label, key in _ROWS:
        if key in m:  # memory: launched servers only
            lines.append(f"{label + ':':<40}{_fmt(m[key]):>16}")
    lines += [f"  error: {e}" for e in m.get("errors", [])] + ["=" * 56]
    return "\n".join(lines)


def format_comparison(title: str, names: list[str], ms: list[dict]) -> str:
    """Side by side; ratio columns are first target / each other target."""
    ref = names[0]
    head = f"{'metric':<32}" + "".join(f"{n:>14}" for n in names)
    head += "".join(f"{ref + '/' + n:>{max(14, len(ref) + len(n) + 3)}}" for n in names[1:])
    lines = [f"== {title} ==", head]
    for label, key in _ROWS:
        if not any(key in m for m in ms):
            continue
        vals = [m.get(key, float("nan")) for m in ms]
        row = f"{label:<32}" + "".join(f"{_fmt(v):>14}" for v in vals)
        for n, v in zip(names[1:], vals[1:]):
            ratio = vals[0] / v if v else float("nan")
            row += f"{ratio:>{max(14, len(ref) + len(n) + 3)}.2f}"
        lines.append(row)
    for n, m in zip(names, ms):
        lines += [f"  {n} error: {e}" for e in m.get("errors", [])]
    return "\n".join(lines)
