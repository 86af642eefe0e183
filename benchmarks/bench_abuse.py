"""The abuse table: what one hostile or careless client can do to a running cluster.

Each case is sent while a normal streaming request runs. A row shows the answer the abusive client
got and how long it took, the gateway's memory before and after, the normal request's latency
during the case against its baseline, whether any worker left rotation, and whether the gateway and
the workers went back to idle afterwards.

    pdserve bench abuse                    # launches `pdserve up` with the limits and keys below
    pdserve bench abuse --url URL --launcher-pid PID --api-key K --admin-api-key A   # a running one

The cluster's limits are set short so that the timeouts show within seconds (`LIMITS`); the defaults
are longer (60 s body, 30 s idle, 256 requests per client).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import httpx

from pdserve.bench.abuse_cases import CASES, DESTRUCTIVE
from pdserve.bench.abuse_target import BODY_TIMEOUT_S, IDLE_TIMEOUT_S, NORMAL, PER_CLIENT, Case, Target

# `pdserve up` flags the cases are written against.
LIMITS = [
    "--max-requests-per-client",
    str(PER_CLIENT),
    "--request-body-timeout",
    str(BODY_TIMEOUT_S),
    "--idle-timeout",
    str(IDLE_TIMEOUT_S),
]
# The keys the launched cluster runs with (`PDSERVE_API_KEY`, `PDSERVE_ADMIN_API_KEY`): the cases check
# that neither shows anywhere, and that the inference key cannot act as the admin key.
KEYS = {
    "PDSERVE_API_KEY": "inference-key-of-the-abuse-bench",
    "PDSERVE_ADMIN_API_KEY": "admin-key-of-the-abuse-bench",
}


@dataclass
class Row:
    case: str
    answer: str  # what the abusive client saw
    ok: bool  # the answer is the expected one
    seconds: float  # until the abusive client had its answer (or its sockets were all closed)
    rss_before_mib: float
    rss_after_mib: float
    normal_s: float  # the normal request's latency during the case
    workers_kept: bool  # no worker left rotation or re-registered
    idle_after: bool  # the gateway's pending counts and every worker's queues back to 0


# ---- measuring ------------------------------------------------------------------------------------


def normal_request(t: Target) -> float:
    start = time.perf_counter()
    with httpx.stream("POST", t.url + "/generate", json=NORMAL, timeout=120, headers=t.headers()) as r:
        r.raise_for_status()
        for _ in r.iter_bytes():
            pass
    return time.perf_counter() - start


def _metric(t: Target, name: str) -> float:
    total = 0.0
    for line in httpx.get(t.url + "/metrics", timeout=10).text.splitlines():
        head = line.split(" ")[0]
        if head == name or head.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _workers(t: Target) -> list[dict]:
    return list(httpx.get(t.url + "/workers", timeout=10, headers=t.headers(admin=True)).json()["workers"])


def _identity(workers: list[dict]) -> set[tuple]:
    return {(w["worker_id"], w["registered_at"], w["state"]) for w in workers}


def wait_idle(t: Target, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = _metric(t, "pdserve_pending_requests") + _metric(t, "pdserve_pending_generations")
        busy += sum(w["queued"] + w["running"] for w in _workers(t))
        if busy == 0:
            return True
        time.sleep(0.25)
    return False


def _rss_mib(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_case(t: Target, name: str, send: Case) -> Row:
    before = _identity(_workers(t))
    rss0 = _rss_mib(t.pids.get("gateway"))
    normal: list[float] = []
    t_normal = threading.Thread(target=lambda: normal.append(normal_request(t)))
    t_normal.start()
    time.sleep(0.2)  # the normal request is in flight
    start = time.perf_counter()
    try:
        answer, ok = send(t)
    except Exception as e:  # noqa: BLE001 - reported in the row
        answer, ok = f"client error: {type(e).__name__}: {e}"[:90], False
    seconds = time.perf_counter() - start
    t_normal.join(300)
    idle = wait_idle(t, 60.0)
    return Row(
        case=name,
        answer=answer,
        ok=ok,
        seconds=seconds,
        rss_before_mib=rss0,
        rss_after_mib=_rss_mib(t.pids.get("gateway")),
        normal_s=normal[0] if normal else float("nan"),
        workers_kept=_identity(_workers(t)) == before,
        idle_after=idle,
    )


def run_all(t: Target, destructive: bool = True) -> tuple[float, list[Row]]:
    """The normal request's baseline (median of 3, after a warm-up) and one row per case; with
    `destructive`, last, the case that kills a worker on purpose."""
    normal_request(t)
    baseline = statistics.median(normal_request(t) for _ in range(3))
    cases = CASES + (DESTRUCTIVE if destructive else [])
    return baseline, [run_case(t, name, send) for name, send in cases]


def format_table(baseline: float, rows: list[Row]) -> str:
    lines = [
        f"normal request (stream, 32 tokens) alone: {baseline:.2f} s",
        "",
        "| abuse | answer | time s | gateway RSS MiB | normal request s | workers kept | idle after |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        mark = "" if r.ok else " (UNEXPECTED)"
        lines.append(
            f"| {r.case} | {r.answer}{mark} | {r.seconds:.2f} | {r.rss_before_mib:.0f} -> {r.rss_after_mib:.0f} "
            f"| {r.normal_s:.2f} ({r.normal_s / baseline:.1f}x) | {'yes' if r.workers_kept else 'NO'} "
            f"| {'yes' if r.idle_after else 'NO'} |"
        )
    return "\n".join(lines)


def cluster_pids(launcher_pid: int) -> dict[str, int]:
    """The gateway's and each worker's pid under a `pdserve up` launcher, by role name
    ("gateway", and the workers' ids: "prefill-0", "decode-0", ...)."""
    import psutil

    out: dict[str, int] = {}
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if "pdserve.cli" not in cmd:
            continue
        role = cmd[cmd.index("pdserve.cli") + 1] if cmd.index("pdserve.cli") + 1 < len(cmd) else ""
        if role == "gateway":
            out["gateway"] = int(child.pid)
        elif "--worker-id" in cmd:
            out[cmd[cmd.index("--worker-id") + 1]] = int(child.pid)
    return out


def row_passes(r: Row) -> bool:
    destructive = {name for name, _ in DESTRUCTIVE}
    return r.ok and r.idle_after and (r.workers_kept or r.case in destructive)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser("pdserve bench abuse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running cluster started with the limits in LIMITS (default: launch one)")
    ap.add_argument(
        "--launcher-pid", type=int, help="with --url: the `pdserve up` pid (memory, stop, kill cases)"
    )
    ap.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY", ""), help="with --url")
    ap.add_argument("--admin-api-key", default=os.environ.get("PDSERVE_ADMIN_API_KEY", ""), help="with --url")
    ap.add_argument("--no-destructive", action="store_true", help="leave out the case that kills a worker")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    if args.url:
        pids = cluster_pids(args.launcher_pid) if args.launcher_pid else {}
        t = Target(args.url, args.api_key, args.admin_api_key, pids)
        baseline, rows = run_all(t, not args.no_destructive)
    else:
        from pdserve.bench.launch_servers import launch, pdserve_up_argv, wait_healthy

        log_dir = tempfile.mkdtemp(prefix="pdserve-abuse-")
        port = 31700
        server = launch(
            "pdserve", pdserve_up_argv(port, log_dir, *LIMITS), port, log_dir, env={**os.environ, **KEYS}
        )
        try:
            wait_healthy(server, 600)
            keys = KEYS["PDSERVE_API_KEY"], KEYS["PDSERVE_ADMIN_API_KEY"]
            t = Target(server.url, *keys, cluster_pids(server.proc.pid))
            baseline, rows = run_all(t, not args.no_destructive)
        finally:
            server.stop()
    print(f"cluster limits: {' '.join(LIMITS)}")
    print(format_table(baseline, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline_s": baseline, "rows": [r.__dict__ for r in rows]}, f, indent=1)
    sys.exit(0 if all(row_passes(r) for r in rows) else 1)


if __name__ == "__main__":
    main()
