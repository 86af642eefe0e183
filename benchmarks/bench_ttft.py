"""Served time to first token against the offline engine's prefill, side by side in one run.

Launches `pdserve up` (or uses --url) and loads the offline engine in this process with the same
--dtype and --quantization. For each prompt length it alternates: the offline engine prefills a fresh
prompt (`Engine.generate(max_new_tokens=1)`, the KV pool's prefix cache holds none of it), then the
cluster answers another fresh one through `/generate` (raw token ids, `max_new_tokens` 1, not
streamed: the response comes with the first token), and a third one streamed with `max_new_tokens` 4,
timed to its first chunk. The served times are the client's wall clock, so they hold HTTP, routing, the
prefill forward and the reply (the first token comes with the prefill's PrefillDone, before the KV
lands on the decode node); the prefill worker's own forward is shown beside them
(`prefill_finished_time - forward_entry_time`).
Idle between calls (--gap-ms) lets each side's OpenMP threads stop spinning before the other runs.

    pdserve bench ttft [--lengths 128 512 1024] [--rounds 6] [--pdserve-args "..."]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time

import httpx
import torch

from pdserve.bench.launch_servers import Launched, launch, pdserve_up_argv, wait_healthy
from pdserve.config import RuntimeConfig
from pdserve.progress import Counter, stderr
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_model
from pdserve.sampling_params import SamplingParams


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024], help="prompt tokens")
    p.add_argument("--rounds", type=int, default=6, help="prompts per length and side (median shown)")
    p.add_argument("--dtype", default="auto", help="both sides (see `pdserve up --help`)")
    p.add_argument("--quantization", default="auto", help="both sides")
    p.add_argument(
        "--num-threads", type=int, default=None, help="offline torch threads (default: every core)"
    )
    p.add_argument("--url", default=None, help="a running cluster's gateway instead of launching one")
    p.add_argument("--pdserve-args", default="", help="extra flags for the launched `pdserve up`")
    p.add_argument("--launch-port", type=int, default=33200)
    p.add_argument("--gap-ms", type=float, default=100.0, help="idle time before each call")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.lengths) < 1 or args.rounds < 1:
        p.error("--lengths must be >= 1 and --rounds >= 1")
    return args


def _served(client: httpx.Client, url: str, ids: list[int]) -> tuple[float, float]:
    """(wall seconds, prefill forward seconds) of one /generate call that asks for one token."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    t = time.perf_counter()
    r = client.post(url + "/generate", json=body)
    wall = time.perf_counter() - t
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return wall, meta["prefill_finished_time"] - meta["forward_entry_time"]


def _streamed(client: httpx.Client, url: str, ids: list[int]) -> float:
    """Seconds to the first chunk with a token of a streamed /generate that asks for four."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    t = time.perf_counter()
    first = None
    with client.stream("POST", url + "/generate", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:]).get("output_ids"):
                first = time.perf_counter() - t
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.num_threads or os.cpu_count() or 1)
    launched: Launched | None = None
    url = args.url
    if url is None:
        log_dir = tempfile.mkdtemp(prefix="pdserve-bench-ttft-")
        flags = f"--dtype {shlex.quote(args.dtype)} --quantization {shlex.quote(args.quantization)}"
        argv_up = pdserve_up_argv(
            args.launch_port, os.path.join(log_dir, "pdserve"), flags, args.pdserve_args
        )
        launched = launch("pdserve", argv_up, args.launch_port, log_dir)
        url = launched.url
    try:
        loaded = load_model(None, args.dtype, "cpu", args.quantization)
        longest = max(args.lengths)
        engine = Engine(RuntimeConfig(max_total_tokens=4 * (longest + 64), max_running_requests=2), loaded)
        if launched is not None:
            wait_healthy(launched, 600)
        rng = random.Random(args.seed)
        vocab = loaded.spec.vocab_size

        def fresh(n: int) -> list[int]:  # random ids: no prefix cache on either side holds them
            return [rng.randrange(vocab // 8, vocab - 1) for _ in range(n)]

        one = SamplingParams(max_new_tokens=1, temperature=0)
        print(
            f"model {loaded.spec.architecture}, dtype {loaded.dtype}, quantization {loaded.quantization}, "
            f"offline torch threads {torch.get_num_threads()}, cluster {url}",
            flush=True,
        )
        rows = []
        with httpx.Client(timeout=600) as client:
            engine.generate([fresh(16)], one)  # warm-up of both sides
            _served(client, url, fresh(16))
            _streamed(client, url, fresh(16))
            bar = Counter(len(args.lengths) * args.rounds, "bench ttft", stderr, unit="pairs")
            for n in args.lengths:
                offline, served, forward, streamed = [], [], [], []
                for _ in range(args.rounds):
                    time.sleep(args.gap_ms / 1e3)
                    t = time.perf_counter()
                    engine.generate([fresh(n)], one)
                    offline.append(time.perf_counter() - t)
                    time.sleep(args.gap_ms / 1e3)
                    wall, fwd = _served(client, url, fresh(n))
                    served.append(wall)
                    forward.append(fwd)
                    time.sleep(args.gap_ms / 1e3)
                    streamed.append(_streamed(client, url, fresh(n)))
                    bar.update()
                med = statistics.median
                rows.append((n, med(offline), med(served), med(forward), med(streamed)))
            bar.close()
    finally:
        if launched is not None:
            launched.stop()
    print(
        f"{'prompt':>6} {'offline prefill ms':>19} {'served TTFT ms':>15} {'ratio':>6} "
        f"{'streamed TTFT ms':>17} {'ratio':>6} {'prefill forward ms':>19}"
    )
    for n, off, srv, fwd, stm in rows:
        print(
            f"{n:>6} {off * 1e3:19.1f} {srv * 1e3:15.1f} {srv / off:6.2f} "
            f"{stm * 1e3:17.1f} {stm / off:6.2f} {fwd * 1e3:19.1f}"
        )
    print(
        f"medians of {args.rounds} fresh prompts a side, alternating; ratio = served / offline "
        "(served: one token, plain; streamed: the first chunk of four tokens)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
