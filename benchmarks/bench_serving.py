"""Online serving benchmark: TTFT, ITL, TPOT, E2E and throughput against OpenAI-compatible servers.

    pdserve bench serving --base-url http://127.0.0.1:30000 --dataset chat --num-prompts 32 \\
        --max-concurrency 1,8,32 --output-len 64 --ignore-eos

Compare servers side by side in one run (the workload is identical; runs are interleaved, the order
alternating per round, because a shared machine drifts by tens of percent within minutes):

    pdserve bench serving --targets pdserve=http://127.0.0.1:30000,peer=http://127.0.0.1:8000 ...
    pdserve bench serving --launch-pdserve --launch-transformers-serve --dataset chat ...
    pdserve bench serving --launch-pdserve --launch-llama-server /path/to/llama-server --dataset chat ...

Prefix caching: `--dataset multiturn` runs conversations whose turns share their history (turn k's
prompt is turn k-1's prompt, its answer and a new question; the first question carries a long document),
turns in order, conversations concurrently; it reports per turn the median TTFT and the cache hit rate
(cached / prompt tokens, from `usage.prompt_tokens_details.cached_tokens` or `meta_info.cached_tokens`).
`--dataset shared-prefix` gives every request one long system prompt. Compare with the cache off:

    pdserve bench serving --launch-pdserve --launch-pdserve-variant nocache=--disable-radix-cache \\
        --dataset multiturn --num-prompts 4 --num-turns 4 --max-concurrency 2

Servers the benchmark launches start one at a time, each once the one before is healthy (so their
loads do not share the cores), and are timed and weighed: the time from spawn to healthy (`pdserve up`:
every worker in rotation; llama-server: /health 200), the PSS of each one's whole process tree (every
worker and the gateway of `pdserve up`) at its peak during start-up, idle once all are up, and at its
peak during each run (sampled every 0.5 s), reported beside the throughput and in the JSON
(benchmarks/launch_servers.py, process_memory.py; Linux). `--cold-start` gives each `pdserve up` an
empty PDSERVE_CACHE_DIR: a first start, quantizing its weights again. The OS page cache is not dropped
(that takes root); the share of each server's weight files it held at spawn is reported instead.
A short comparison, 8 requests at concurrency 1 and 16 at 8, 64 tokens each:

    pdserve bench serving --launch-pdserve --pdserve-args "--model-path M.gguf" \\
        --launch-llama-server /path/to/llama-server --llama-server-model M.gguf \\
        --max-concurrency 1,8 --num-prompts 8,16 --max-tokens 64 --ignore-eos --rounds 2

Ratios in the comparison table are first target / other target. Requests always stream.
TTFT is the time to the first non-empty content chunk, ITL the gaps between content chunks,
TPOT (e2e - ttft) / (output_tokens - 1). Output tokens come from the server's `usage`
(requested with stream_options.include_usage unless --no-usage), else from tokenizing the text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace

import httpx

from pdserve.bench.launch_servers import Launched, add_launch_args, plan_launches, start_in_turn
from pdserve.bench.process_memory import MemorySampler
from pdserve.bench.serving_report import (
    add_memory,
    format_comparison,
    format_result,
    format_server,
    format_starts,
    format_turns,
    server_counters,
    summarize,
    summarize_turns,
)
from pdserve.bench.serving_requests import (
    BACKEND_PATHS,
    RequestResult,
    RunConfig,
    Target,
    run_conversations,
    run_level,
    warm_up,
)
from pdserve.bench.serving_workload import (
    Prompt,
    chat_prompts,
    load_tokenizer,
    multiturn_conversations,
    random_prompts,
    shared_prefix_prompts,
)


def _model_id(url: str) -> str:
    r = httpx.get(url + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _targets(args: argparse.Namespace, launched: list[Launched]) -> list[Target]:
    pairs: list[tuple[str, str]] = [(s.name, s.url) for s in launched if s.name != "transformers"]
    if args.targets:
        pairs += [tuple(x.split("=", 1)) for x in args.targets.split(",")]
    if args.compare:
        pairs += [(u.split("//")[-1], u) for u in args.compare.split(",")]
    pairs += [(s.name, s.url) for s in launched if s.name == "transformers"]
    if not pairs:
        pairs = [("server", args.base_url)]
    extra = json.loads(args.extra_body) if args.extra_body else {}
    per = {k: json.loads(v) for k, v in (x.split("=", 1) for x in args.target_extra)}
    if args.ignore_eos and any(s.name == "transformers" for s in launched):
        # transformers serve rejects ignore_eos; an EOS id of -1 in its generation_config disables EOS.
        per.setdefault("transformers", {"generation_config": json.dumps({"eos_token_id": -1})})
    out = []
    for name, url in pairs:
        url = url.rstrip("/")
        body = {**extra, **per.get(name, {})}
        ignore = args.ignore_eos and "generation_config" not in body
        out.append(Target(name, url, args.model, not args.no_usage, ignore, body))
    return out


def _levels(args: argparse.Namespace) -> list[tuple[int, int]]:
    concs = [int(x) for x in str(args.max_concurrency).split(",")]
    nums = [int(x) for x in str(args.num_prompts).split(",")]
    if len(nums) == 1:
        nums = nums * len(concs)
    if len(nums) != len(concs):
        raise SystemExit("--num-prompts takes one value or one per --max-concurrency value")
    return list(zip(concs, nums))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser("pdserve bench serving", __doc__ or "")
    return check_args(p, p.parse_args(argv))


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The workload, target and launch flags (`pdserve bench goodput` adds its own to them)."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--compare", default="", help="URL_A,URL_B,...: run the same workload against each")
    p.add_argument("--targets", default="", help="name=url,name=url,...: like --compare, with names")
    p.add_argument("--target-extra", action="append", default=[], help="name=JSON: extra body for one target")
    p.add_argument("--backend", choices=sorted(BACKEND_PATHS), default="openai-chat")
    p.add_argument("--model", default=None, help="default: the first id from GET /v1/models")
    p.add_argument("--dataset", choices=["random", "chat", "multiturn", "shared-prefix"], default="chat")
    p.add_argument(
        "--num-prompts",
        default="32",
        help="one value, or one per concurrency level (multiturn: conversations)",
    )
    p.add_argument("--num-turns", type=int, default=4, help="multiturn: turns per conversation")
    p.add_argument(
        "--multiturn-doc-len", type=int, default=1024, help="multiturn: ~tokens of the document in turn 1"
    )
    p.add_argument(
        "--shared-prefix-len", type=int, default=1024, help="shared-prefix: ~tokens of the system prompt"
    )
    p.add_argument("--max-concurrency", default="8", help="one value or a comma list to sweep, e.g. 1,8,32")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--output-len", "--max-tokens", dest="output_len", type=int, default=None,
                   help="fixed max_tokens for every request")  # fmt: skip
    p.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos: true (comparable output lengths)"
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    p.add_argument("--no-usage", action="store_true", help="do not send stream_options; tokenize the output")
    p.add_argument(
        "--tokenizer", default=None, help="for the random dataset and --no-usage (default: bundled)"
    )
    p.add_argument("--fresh-connections", action="store_true", help="a new connection for every request")
    p.add_argument("--rounds", type=int, default=1, help="repeat every (target, level); results are pooled")
    p.add_argument("--warmup-requests", type=int, default=2)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-json", default=None)
    p.add_argument(
        "--plot",
        default=None,
        metavar="DIR",
        help="write TTFT and ITL CDFs, throughput against concurrency (PNG) and the raw results (JSON) here",
    )
    add_launch_args(p)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.num_turns < 1 or args.multiturn_doc_len < 0 or args.shared_prefix_len < 0:
        p.error("--num-turns must be >= 1, --multiturn-doc-len and --shared-prefix-len >= 0")
    return args


# After every launched server is healthy, this long before its idle memory is read: start-up's last
# allocations and frees (a worker's first registration, the gateway's first health check) settle.
IDLE_SETTLE_S = 3.0


def _pool(runs: list[tuple[list[RequestResult], float]]) -> dict:
    return summarize([r for rs, _ in runs for r in rs], sum(d for _, d in runs))


def _peak(peaks: list[int | None]) -> int | None:
    known = [p for p in peaks if p is not None]
    return max(known) if known else None


def _prompts(args: argparse.Namespace, n: int, tok) -> list[Prompt]:
    out_len = args.output_len or 64
    if args.dataset in ("chat", "multiturn"):  # multiturn warms up on chat: its own turn 1 stays uncached
        return chat_prompts(n, out_len, args.seed)
    if args.dataset == "shared-prefix":
        return shared_prefix_prompts(n, args.shared_prefix_len, out_len, args.seed)
    r = args.random_range_ratio
    prompts = random_prompts(n, args.random_input_len, args.random_output_len, r, args.seed, tok)
    return [replace(p, output_len=args.output_len) for p in prompts] if args.output_len else prompts


def _samples(pooled: dict[tuple[str, int], list]) -> dict[tuple[str, int], dict[str, list[float]]]:
    """Every successful request's TTFT and ITL samples (seconds), per (target, concurrency)."""
    out = {}
    for key, runs in pooled.items():
        ok = [r for rs, _ in runs for r in rs if r.ok]
        out[key] = {"ttft": [r.ttft for r in ok], "itl": [x for r in ok for x in r.itl]}
    return out


async def _bench(
    args: argparse.Namespace,
    targets: list[Target],
    memory: MemorySampler | None = None,
    idle: dict[str, int] | None = None,
    starts: dict[str, dict] | None = None,
) -> tuple[list[dict], list[dict], dict[tuple[str, int], dict[str, list[float]]]]:
    """Every (level, round, target) run; `memory` samples the launched servers (by target name), whose
    idle PSS is `idle` and whose starts (StartUp dicts) are `starts`: each run's metrics carry the
    server's start-to-healthy time, start-up peak and idle PSS, and its peak during the run."""
    idle, starts = idle or {}, starts or {}
    weigh = lambda name, m, peak: add_memory(m, idle.get(name), peak, starts.get(name))  # noqa: E731
    cfg = RunConfig(args.backend, args.temperature, args.request_timeout, args.fresh_connections)
    levels = _levels(args)
    need_tok = args.dataset == "random" or args.no_usage or args.tokenizer is not None
    tok = load_tokenizer(args.tokenizer) if need_tok else None
    count_tokens = (lambda s: len(tok.encode(s, add_special_tokens=False))) if tok else None
    prompts = _prompts(args, max(n for _, n in levels), tok)
    multiturn = args.dataset == "multiturn"
    for i, t in enumerate(targets):
        t = t if t.model else replace(t, model=_model_id(t.url))
        targets[i] = await warm_up(cfg, t, prompts, args.warmup_requests, count_tokens)
    pooled: dict[tuple[str, int], list] = {}
    peaks: dict[tuple[str, int], list[int | None]] = {}
    pooled_convs: dict[tuple[str, int], list[list[RequestResult]]] = {}
    runs = []
    for li, (conc, n) in enumerate(levels):
        for rnd in range(args.rounds):
            # New documents at every level and round (the same for every target), so that turn 1
            # never finds a conversation cached by an earlier run on the same server.
            seed = args.seed + 1000 * li + rnd
            doc, out_len = args.multiturn_doc_len, args.output_len or 64
            convs = multiturn_conversations(n, args.num_turns, doc, out_len, seed) if multiturn else []
            order = targets if (li + rnd) % 2 == 0 else targets[::-1]
            for t in order:
                run = {"target": t.name, "url": t.url, "concurrency": conc, "num_prompts": n, "round": rnd}
                before = server_counters(t.url)
                if memory is not None:
                    memory.take_peaks()  # the run's window starts here
                if multiturn:
                    by_conv, dur = await run_conversations(cfg, t, convs, conc, count_tokens)
                    res = [r for c in by_conv for r in c]
                    pooled_convs.setdefault((t.name, conc), []).extend(by_conv)
                    run["turns"] = summarize_turns(by_conv)
                else:
                    res, dur = await run_level(
                        cfg, t, prompts[:n], conc, args.request_rate, args.seed, count_tokens
                    )
                peak = memory.take_peaks().get(t.name) if memory is not None else None
                m = run["metrics"] = weigh(t.name, summarize(res, dur), peak)
                pooled.setdefault((t.name, conc), []).append((res, dur))
                peaks.setdefault((t.name, conc), []).append(peak)
                runs.append(run)
                print(format_result(t.name, args.backend, conc, args.request_rate, m), flush=True)
                after = server_counters(t.url)
                server = format_server(before, after, len(res))
                if server:
                    run["server"] = {k: after[k] - before.get(k, 0.0) for k in after}
                    print(server, flush=True)
    summary = []
    for conc, n in levels:
        ms = [weigh(t.name, _pool(pooled[(t.name, conc)]), _peak(peaks[(t.name, conc)])) for t in targets]
        summary += [{"target": t.name, "concurrency": conc, "num_prompts": n, "metrics": m}
                    for t, m in zip(targets, ms)]  # fmt: skip
        if len(targets) > 1:
            title = f"concurrency {conc}, {n} prompts x {args.rounds} round(s), dataset {args.dataset}"
            print(format_comparison(title, [t.name for t in targets], ms), flush=True)
        if multiturn:
            turns = [summarize_turns(pooled_convs[(t.name, conc)]) for t in targets]
            for s, tu in zip(summary[-len(targets) :], turns):
                s["turns"] = tu
            title = f"per turn: concurrency {conc}, {n} conversations x {args.num_turns} turns"
            title += f" x {args.rounds} round(s)"
            print(format_turns(title, [t.name for t in targets], turns), flush=True)
    return runs, summary, _samples(pooled)


def _said(s: Launched) -> None:
    """The line printed as each launched server becomes healthy (the start-up table follows them all)."""
    if s.start is not None:
        peak = f"{s.start.peak_pss / 1e9:.2f} GB" if s.start.peak_pss else "unknown"
        print(f"{s.name} healthy {s.start.healthy_s:.2f} s after spawn; start-up peak PSS {peak}", flush=True)


def _idle(launched: list[Launched]) -> tuple[MemorySampler | None, dict[str, int]]:
    """A sampler of every launched server, started, and their idle PSS read IDLE_SETTLE_S after the last
    one became healthy."""
    if not launched:
        return None, {}
    memory = MemorySampler({s.name: s.proc.pid for s in launched})
    time.sleep(IDLE_SETTLE_S)
    idle = memory.sample()
    return memory.start(), idle


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = args.launch_log_dir or tempfile.mkdtemp(prefix="pdserve-bench-")
    os.makedirs(log_dir, exist_ok=True)
    launched: list[Launched] = []
    memory: MemorySampler | None = None
    try:
        launched = start_in_turn(plan_launches(args, log_dir), log_dir, args.launch_timeout, _said)
        memory, idle = _idle(launched)
        starts = {s.name: asdict(s.start) for s in launched if s.start is not None}
        if starts:
            print(format_starts(starts, idle), flush=True)
        targets = _targets(args, launched)
        runs, summary, samples = asyncio.run(_bench(args, targets, memory, idle, starts))
    finally:
        if memory is not None:
            memory.stop()
        for s in launched:
            s.stop()
    if args.output_json:
        servers = {n: {**st, "idle_pss": idle.get(n)} for n, st in starts.items()}
        with open(args.output_json, "w") as f:
            json.dump({"config": vars(args), "targets": [asdict(t) for t in targets], "launched": servers,
                       "runs": runs, "summary": summary}, f, indent=2)  # fmt: skip
    if args.plot:
        from pdserve.bench.plots import write_plots

        for path in write_plots(args.plot, summary, samples, vars(args)):
            print(f"wrote {path}", flush=True)
    return 0 if all(r["metrics"]["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
