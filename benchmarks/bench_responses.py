"""Multi-turn Responses conversations: time to first token per turn, with and without cache affinity.

A conversation is `--turns` calls of `POST /v1/responses`, each chained to the one before by
`previous_response_id` (the gateway's stored history), so turn k's prompt is every earlier input and answer
plus the new input. The first input is a long document with a question; later ones are short questions.
With the default routing (`cache_aware`: the prefill and the decode worker whose prefix caches hold most of
the prompt, weighed against their load) turn k goes where turn k-1's KV is and computes only what is new;
with `round_robin` it goes wherever the rotation points, and on a cluster of several prefill workers it
mostly finds none of its history there. Both clusters run at once, used in turn, conversation by
conversation (each conversation's document starts with its own header, so conversations share no prefix).
TTFT is the client's clock from sending a turn to its first `response.output_text.delta` event; the
response's `usage.input_tokens_details.cached_tokens` says how much of the prompt a worker found cached.

    pdserve bench responses [--turns 6] [--conversations 6] [--pdserve-args "--num-prefill 2 --num-decode 2"]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import httpx

from pdserve.bench.launch_servers import Launched, launch, pdserve_up_argv, wait_healthy
from pdserve.bench.quant_text import PASSAGE, PROMPTS

VARIANTS = {
    "affinity (cache_aware)": "",
    "no affinity (round_robin)": "--prefill-policy round_robin --decode-policy round_robin",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench responses", description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--conversations", type=int, default=6, help="per cluster")
    p.add_argument("--max-output-tokens", type=int, default=24)
    p.add_argument("--doc-repeats", type=int, default=3, help="copies of the passage in the first input")
    p.add_argument("--pdserve-args", default="--num-prefill 2 --num-decode 2", help="flags of both clusters")
    p.add_argument("--port", type=int, default=33300, help="the first cluster's port; the second's is +20")
    p.add_argument("--start-timeout", type=float, default=600.0)
    return p.parse_args(argv)


def turn(
    client: httpx.Client, url: str, text: str, previous: str | None, max_tokens: int
) -> tuple[float, str, int]:
    """(TTFT seconds, response id, cached prompt tokens) of one streamed turn."""
    model = client.get(url + "/v1/models").json()["data"][0]["id"]
    body: dict[str, object] = {"model": model, "input": text, "max_output_tokens": max_tokens}
    body["stream"], body["temperature"] = True, 0.0
    if previous:
        body["previous_response_id"] = previous
    start = time.perf_counter()
    ttft = float("nan")
    rid, cached = "", 0
    with client.stream("POST", url + "/v1/responses", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            kind = event.get("type")
            if kind == "response.output_text.delta" and ttft != ttft:
                ttft = time.perf_counter() - start
            if kind in ("response.completed", "response.incomplete"):
                resp = event["response"]
                rid = resp["id"]
                cached = ((resp.get("usage") or {}).get("input_tokens_details") or {}).get("cached_tokens", 0)
    return ttft, rid, cached


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="pdserve-bench-responses-")
    servers: list[Launched] = []
    try:
        for i, flags in enumerate(VARIANTS.values()):
            port = args.port + 20 * i
            argv_ = pdserve_up_argv(port, os.path.join(log_dir, f"v{i}"), args.pdserve_args, flags)
            servers.append(launch(f"v{i}", argv_, port, log_dir))
        for s in servers:
            wait_healthy(s, args.start_timeout)
        doc = " ".join([PASSAGE] * args.doc_repeats)
        questions = PROMPTS[1 : args.turns]
        # ttfts[variant][turn] and cached[variant][turn], over conversations
        ttfts: dict[str, list[list[float]]] = {n: [[] for _ in range(args.turns)] for n in VARIANTS}
        cached: dict[str, list[list[int]]] = {n: [[] for _ in range(args.turns)] for n in VARIANTS}
        with httpx.Client(timeout=600) as client:
            for s in servers:  # one warm-up conversation turn each
                turn(client, s.url, "Hello.", None, 4)
            for c in range(args.conversations):
                for (name, _), s in zip(VARIANTS.items(), servers):
                    previous = None
                    for k in range(args.turns):
                        text = (
                            f"Document {c}.\n{doc}\n\n{PROMPTS[0]}"
                            if k == 0
                            else questions[(k - 1) % len(questions)]
                        )
                        t, previous, hit = turn(client, s.url, text, previous, args.max_output_tokens)
                        ttfts[name][k].append(t)
                        cached[name][k].append(hit)
                print(f"conversation {c + 1}/{args.conversations} done", file=sys.stderr, flush=True)
        names = list(VARIANTS)
        print(f"{args.conversations} conversations x {args.turns} turns per cluster ({args.pdserve_args}); "
              "median TTFT ms (median cached prompt tokens)")  # fmt: skip
        print(f"{'turn':>4}  " + "  ".join(f"{n:>28}" for n in names) + "   ratio")
        for k in range(args.turns):
            med = [statistics.median(ttfts[n][k]) * 1e3 for n in names]
            cells = [f"{m:>18.1f} ({statistics.median(cached[n][k]):>6.0f})" for m, n in zip(med, names)]
            print(f"{k + 1:>4}  " + "  ".join(f"{c:>28}" for c in cells) + f"   {med[1] / med[0]:.2f}x")
        later = [
            statistics.median([t for k in range(1, args.turns) for t in ttfts[n][k]]) * 1e3 for n in names
        ]
        print(
            f"turns 2-{args.turns}: median {later[0]:.1f} ms with affinity, {later[1]:.1f} without ({later[1] / later[0]:.2f}x)"
        )
    finally:
        for s in servers:
            s.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
