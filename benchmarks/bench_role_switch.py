"""What a role switch costs the requests in flight: `pdserve up` with two prefill workers and one decode
worker, 8 clients each sending one long prompt at once; in a `switch` round prefill-1 is moved to
decode half a second in (and back afterwards, unmeasured, so that every round starts from the same
cluster); in a `plain` round nothing happens. Per round: the slowest and the median request latency,
the requests retried on another pair, the seconds until the switched worker registered in its new role.

    python -m pdserve.bench.bench_role_switch [--rounds 3] [--pdserve-args "--switch-handoff 3"]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from pdserve.bench.launch_servers import launch, pdserve_up_argv, wait_healthy

PROMPTS = [
    f"Write a short note about the number {i} and why it matters."
    + " Consider its history, its uses in science and art, and its place in daily life." * 24
    for i in range(8)
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_role_switch", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of each kind (plain, switch)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--pdserve-args", default="", help="extra flags of the cluster")
    p.add_argument("--port", type=int, default=33600)
    p.add_argument("--start-timeout", type=float, default=600.0)
    return p.parse_args(argv)


def workers(url: str) -> dict[str, dict]:
    rows = httpx.get(url + "/workers", params={"all": 1}, timeout=10).json()["workers"]
    return {w["worker_id"]: w for w in rows}


def wait_role(url: str, worker_id: str, role: str, timeout_s: float = 300.0) -> float:
    """Seconds until `worker_id` is listed healthy in `role`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        w = workers(url).get(worker_id, {})
        if w.get("role") == role and w.get("state") == "healthy":
            return time.monotonic() - t0
        time.sleep(0.1)
    raise TimeoutError(f"{worker_id} not a healthy {role} worker within {timeout_s:.0f} s")


def call(url: str, text: str, max_new_tokens: int) -> tuple[float, int]:
    """(seconds, HTTP status) of one greedy /generate call."""
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    t0 = time.monotonic()
    r = httpx.post(url + "/generate", json=body, timeout=600)
    return time.monotonic() - t0, r.status_code


def retries(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve_request_retries_total "):
            return float(line.split()[1])
    return 0.0


def one_round(url: str, switch: bool, max_new_tokens: int) -> dict[str, float]:
    before = retries(url)
    registered = float("nan")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        calls = [pool.submit(call, url, p, max_new_tokens) for p in PROMPTS]
        if switch:
            time.sleep(0.5)  # every worker holds prompts, queued or in a forward
            r = httpx.post(url + "/workers/prefill-1/role", json={"role": "decode"}, timeout=10)
            r.raise_for_status()
            registered = wait_role(url, "prefill-1", "decode") + 0.5
        results = [f.result() for f in calls]
    if switch:  # back, unmeasured: the next round starts from 2 prefill + 1 decode
        httpx.post(url + "/workers/prefill-1/role", json={"role": "prefill"}, timeout=10).raise_for_status()
        wait_role(url, "prefill-1", "prefill")
    lat = [s for s, _ in results]
    return {
        "slowest": max(lat),
        "p50": statistics.median(lat),
        "failed": sum(status != 200 for _, status in results),
        "retried": retries(url) - before,
        "registered": registered,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="pdserve-bench-role-switch-")
    flags = f"--num-prefill 2 --num-decode 1 {args.pdserve_args}"
    s = launch("pdserve", pdserve_up_argv(args.port, log_dir, flags), args.port, log_dir)
    try:
        wait_healthy(s, args.start_timeout)
        while sum(w["state"] == "healthy" for w in workers(s.url).values()) < 3:
            time.sleep(0.5)
        call(s.url, PROMPTS[0], 4)  # warm-up
        print(
            f"{'round':<8} {'slowest s':>10} {'p50 s':>8} {'failed':>7} {'retried':>8} {'switched in s':>14}"
        )
        rows: dict[str, list[dict[str, float]]] = {"plain": [], "switch": []}
        for _ in range(args.rounds):
            for kind in ("plain", "switch"):
                row = one_round(s.url, kind == "switch", args.max_new_tokens)
                rows[kind].append(row)
                print(
                    f"{kind:<8} {row['slowest']:>10.2f} {row['p50']:>8.2f} {row['failed']:>7.0f} "
                    f"{row['retried']:>8.0f} {row['registered']:>14.2f}",
                    flush=True,
                )
        for kind, rs in rows.items():
            print(
                f"{kind}: slowest median {statistics.median(r['slowest'] for r in rs):.2f} s "
                f"(min {min(r['slowest'] for r in rs):.2f}, max {max(r['slowest'] for r in rs):.2f}), "
                f"p50 median {statistics.median(r['p50'] for r in rs):.2f} s over {len(rs)} rounds"
            )
        return 0 if not any(r["failed"] for rs in rows.values() for r in rs) else 1
    finally:
        s.stop()


if __name__ == "__main__":
    sys.exit(main())
