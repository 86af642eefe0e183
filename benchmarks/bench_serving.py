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
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import httpx
import numpy as np

from pdserve.launch.supervisor import pdserve_command
from pdserve.progress import Counter, stderr

BACKEND_PATHS = {
    "openai-chat": "/v1/chat/completions",
    "openai": "/v1/completions",
    "pdserve-native": "/generate",
}

# ---- datasets ----------------------------------------------------------------------------------

_TOPICS = [
    "volcanoes", "the Roman Empire", "machine learning", "coffee brewing", "black holes", "honeybees",
    "the French Revolution", "sourdough bread", "jazz music", "electric cars", "ocean tides", "chess openings",
    "photosynthesis", "the stock market", "mountain hiking", "ancient Egypt", "quantum computing", "origami",
    "the water cycle", "medieval castles", "solar panels", "the human heart", "rainforests", "the printing press",
]  # fmt: skip
_INSTRUCTIONS = [
    "Explain {t} to a curious twelve-year-old.", "Write a short poem about {t}.",
    "List five surprising facts about {t}.", "Summarize the history of {t} in one paragraph.",
    "What are the main advantages and drawbacks of {t}?", "Give me a step-by-step guide to learning about {t}.",
    "Describe {t} as if you were a museum tour guide.", "Compare {t} with {u} in a few sentences.",
    "Write a short story in which {t} plays a central role.", "What are common misconceptions about {t}?",
]  # fmt: skip
_CONTEXT = [
    "I am preparing a talk for my local library.", "Please keep the tone friendly and simple.",
    "My background is in accounting, not science.", "I only have a few minutes to read the answer.",
    "This is for a school newsletter.", "Avoid jargon where you can, and define any term you must use.",
    "I already know the basics, so focus on details that are less well known.",
    "Use concrete examples that a general audience would recognise.",
    "My friend claims the topic is boring, and I want to prove them wrong.",
    "Structure the answer so it is easy to skim.",
]  # fmt: skip


@dataclass(frozen=True)
class Prompt:
    text: str  # the user turn (chat) or the whole prompt (completions, native)
    system: str | None
    output_len: int
    history: tuple[tuple[str, str], ...] = ()  # earlier (user, assistant) turns of a conversation


def flat_text(p: Prompt) -> str:
    """The prompt as one string (completions, native): a conversation's turn k extends turn k-1's text."""
    parts = [p.system] if p.system else []
    for user, answer in p.history:
        parts += [user, answer]
    return "\n\n".join(parts + [p.text])


def chat_prompts(n: int, output_len: int, seed: int) -> list[Prompt]:
    """Chat-like prompts from a fixed local list: instruction x topic, plus 0-6 context sentences."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        t, u = rng.sample(_TOPICS, 2)
        parts = rng.sample(_CONTEXT, rng.randint(0, 6)) + [rng.choice(_INSTRUCTIONS).format(t=t, u=u)]
        system = "You are a helpful assistant." if rng.random() < 0.3 else None
        out.append(Prompt(" ".join(parts), system, output_len))
    return out


def random_prompts(
    n: int, input_len: int, output_len: int, ratio: float, seed: int, tokenizer
) -> list[Prompt]:
    """SGLang's `random`: lengths uniform in [len * ratio, len], text decoded from random token ids."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    out = []
    for _ in range(n):
        n_in = rng.randint(max(1, int(input_len * ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * ratio)), output_len)
        ids = [rng.choice(vocab) for _ in range(n_in)]
        out.append(Prompt(tokenizer.decode(ids), None, n_out))
    return out


_QUESTIONS = [
    "Summarize the document above in three sentences.", "Which part of it surprised you most, and why?",
    "Now rewrite your last answer for a ten-year-old.", "List the three most important points so far.",
    "What would a critic say about the document?", "Suggest a good title for it.",
    "Which claim in it would you check first, and how?", "Give one follow-up question worth researching.",
]  # fmt: skip


def _document(rng: random.Random, approx_tokens: int) -> str:
    """Sentences from the local lists until about `approx_tokens` (~4 characters a token in English)."""
    sentences: list[str] = []
    while sum(len(x) + 1 for x in sentences) < 4 * approx_tokens:
        t, u = rng.sample(_TOPICS, 2)
        sentences.append(rng.choice(_CONTEXT + _INSTRUCTIONS).format(t=t, u=u))
    return " ".join(sentences)


@dataclass(frozen=True)
class Conversation:
    turns: list[str]  # the user messages, in order; each turn's prompt holds all earlier turns
    output_len: int


def multiturn_conversations(
    n: int, turns: int, doc_len: int, output_len: int, seed: int
) -> list[Conversation]:
    """`n` conversations of `turns` turns; the first message is a ~`doc_len`-token document and a question."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        first = f"Read this document.\n\n{_document(rng, doc_len)}\n\n{rng.choice(_QUESTIONS)}"
        out.append(Conversation([first] + [rng.choice(_QUESTIONS) for _ in range(turns - 1)], output_len))
    return out


def shared_prefix_prompts(n: int, prefix_len: int, output_len: int, seed: int) -> list[Prompt]:
    """Chat prompts that all carry one ~`prefix_len`-token system prompt (a long instruction sheet)."""
    system = "You are a helpful assistant. Background notes:\n" + _document(random.Random(seed), prefix_len)
    return [replace(p, system=system) for p in chat_prompts(n, output_len, seed + 1)]


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    if path is None:
        from pdserve.model_source import resolve_model_source
        from pdserve.runtime.loader import model_folder

        path = model_folder(resolve_model_source(None))
    return AutoTokenizer.from_pretrained(path)


# ---- one request -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    model: str | None = None
    usage: bool = True  # send stream_options.include_usage
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not say
    text: str = ""
    error: str = ""
    status: int = 0


@dataclass(frozen=True)
class RunConfig:
    backend: str
    temperature: float
    timeout_s: float
    fresh_connections: bool


def request_body(backend: str, t: Target, p: Prompt, temperature: float, max_tokens: int) -> dict:
    if backend == "pdserve-native":
        sp = {"max_new_tokens": max_tokens, "temperature": temperature}
        if t.ignore_eos:
            sp["ignore_eos"] = True
        return {"text": flat_text(p), "sampling_params": sp, "stream": True, **t.extra_body}
    body: dict = {"model": t.model, "max_tokens": max_tokens, "temperature": temperature, "stream": True}
    if backend == "openai-chat":
        system = [{"role": "system", "content": p.system}] if p.system else []
        turns = [
            m
            for u, a in p.history
            for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})
        ]
        body["messages"] = system + turns + [{"role": "user", "content": p.text}]
    else:
        body["prompt"] = flat_text(p)
    if t.usage:
        body["stream_options"] = {"include_usage": True}
    if t.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **t.extra_body}


def _parse_chunk(backend: str, obj: dict, text_so_far: str) -> tuple[str, int | None, int | None, int | None]:
    """(new content, then completion, prompt and cached prompt tokens if reported) of one SSE chunk."""
    if backend == "pdserve-native":
        meta = obj.get("meta_info") or {}
        return (
            obj.get("text", "")[len(text_so_far) :],
            meta.get("completion_tokens"),
            meta.get("prompt_tokens"),
            meta.get("cached_tokens"),
        )
    choices = obj.get("choices") or []
    delta = ""
    if choices:
        c = choices[0]
        delta = (
            (c.get("delta") or {}).get("content") or "" if backend == "openai-chat" else c.get("text") or ""
        )
    usage = obj.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return delta, usage.get("completion_tokens"), usage.get("prompt_tokens"), cached


async def send_request(
    client: httpx.AsyncClient,
    cfg: RunConfig,
    t: Target,
    p: Prompt,
    count_tokens: Callable[[str], int] | None,
    max_tokens: int | None = None,
) -> RequestResult:
    """Stream one request; times are perf_counter seconds measured from just before the send."""
    res = RequestResult()
    body = request_body(cfg.backend, t, p, cfg.temperature, max_tokens or p.output_len)
    chunks = 0
    usage_out: int | None = None
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", t.url + BACKEND_PATHS[cfg.backend], json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    res.error = json.dumps(obj["error"])[:300]
                    return res
                delta, n_out, n_in, n_cached = _parse_chunk(cfg.backend, obj, res.text)
                usage_out = n_out if n_out is not None else usage_out
                res.prompt_tokens = n_in if n_in is not None else res.prompt_tokens
                res.cached_tokens = n_cached if n_cached is not None else res.cached_tokens
                if not delta:
                    continue
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
                res.text += delta
        res.e2e = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    if usage_out is not None:
        res.output_tokens = usage_out
    else:  # no usage from this server: tokenize what came back, or count chunks as a last resort
        res.output_tokens = count_tokens(res.text) if count_tokens else chunks
    if not res.prompt_tokens and count_tokens:  # approximate: the prompt without any chat template
        res.prompt_tokens = count_tokens(flat_text(p))
    res.ok = chunks > 0
    res.error = "" if res.ok else "no content in the stream"
    return res


def _client(cfg: RunConfig, concurrency: int) -> httpx.AsyncClient:
    # A pool of 0 keep-alive connections makes each request open its own (servers that close idle ones).
    keep = 0 if cfg.fresh_connections else concurrency
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=keep)
    return httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0), limits=limits)


async def run_level(
    cfg: RunConfig,
    t: Target,
    prompts: list[Prompt],
    concurrency: int,
    rate: float,
    seed: int,
    count_tokens: Callable[[str], int] | None,
) -> tuple[list[RequestResult], float]:
    """Send every prompt (Poisson arrivals at `rate`/s, at most `concurrency` in flight); wall time."""
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(concurrency)
    async with _client(cfg, concurrency) as client:
        bar = Counter(len(prompts), f"{t.name} concurrency {concurrency}", stderr)

        async def one(p: Prompt) -> RequestResult:
            async with sem:
                r = await send_request(client, cfg, t, p, count_tokens)
                bar.update()
                return r

        start = time.perf_counter()
        tasks = []
        for i, p in enumerate(prompts):
            if i and rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
            tasks.append(asyncio.create_task(one(p)))
        results = await asyncio.gather(*tasks)
        bar.close()
        return list(results), time.perf_counter() - start


async def run_conversations(
    cfg: RunConfig,
    t: Target,
    convs: list[Conversation],
    concurrency: int,
    count_tokens: Callable[[str], int] | None,
) -> tuple[list[list[RequestResult]], float]:
    """Each conversation's turns in order, each turn sent with the answers so far; at most `concurrency`
    conversations in flight. A failed turn ends its conversation (the next has no answer to build on)."""
    sem = asyncio.Semaphore(concurrency)
    async with _client(cfg, concurrency) as client:
        bar = Counter(
            sum(len(c.turns) for c in convs), f"{t.name} concurrency {concurrency}", stderr, "turns"
        )

        async def one(c: Conversation) -> list[RequestResult]:
            out: list[RequestResult] = []
            history: tuple[tuple[str, str], ...] = ()
            async with sem:
                for user in c.turns:
                    r = await send_request(
                        client, cfg, t, Prompt(user, None, c.output_len, history), count_tokens
                    )
                    out.append(r)
                    bar.update()
                    if not r.ok:
                        break
                    history += ((user, r.text),)
            return out

        start = time.perf_counter()
        results = await asyncio.gather(*(one(c) for c in convs))
        bar.close()
        return list(results), time.perf_counter() - start


# ---- metrics -----------------------------------------------------------------------------------


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
    ("Output token throughput (tok/s)", "output_throughput"), ("Concurrency (observed)", "concurrency"),
] + [
    (f"{s.capitalize()} {n.upper()} (ms)", f"{s}_{n}_ms")
    for n in ("ttft", "itl", "tpot", "e2e") for s in ("mean", "median", "p99")
]  # fmt: skip


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
        vals = [m[key] for m in ms]
        row = f"{label:<32}" + "".join(f"{_fmt(v):>14}" for v in vals)
        for n, v in zip(names[1:], vals[1:]):
            ratio = vals[0] / v if v else float("nan")
            row += f"{ratio:>{max(14, len(ref) + len(n) + 3)}.2f}"
        lines.append(row)
    for n, m in zip(names, ms):
        lines += [f"  {n} error: {e}" for e in m.get("errors", [])]
    return "\n".join(lines)


# ---- launching servers -------------------------------------------------------------------------


@dataclass
class Launched:
    name: str
    url: str
    proc: subprocess.Popen
    log: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass


def pdserve_up_argv(port: int, log_dir: str, *flags: str) -> list[str]:
    """`pdserve up` on `port`, its workers' logs in `log_dir`, then each string of extra flags split."""
    extra = [f for chunk in flags for f in shlex.split(chunk)]
    return pdserve_command("up", "--port", str(port), "--log-dir", log_dir, *extra)


def launch(
    name: str, argv: list[str], port: int, log_dir: str, env: dict[str, str] | None = None
) -> Launched:
    log = os.path.join(log_dir, f"{name}.log")
    with open(log, "ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    print(f"launched {name} (pid {proc.pid}): {shlex.join(argv)}; log {log}", flush=True)
    return Launched(name, f"http://127.0.0.1:{port}", proc, log)


def wait_healthy(s: Launched, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if s.proc.poll() is not None:
            raise RuntimeError(f"{s.name} exited with {s.proc.returncode}; see {s.log}")
        try:
            # /health is 200 only once a server can serve (pdserve: workers registered); a server
            # without /health (404) is ready when it lists its models.
            health = httpx.get(s.url + "/health", timeout=5).status_code
            if health == 200 or (
                health == 404 and httpx.get(s.url + "/v1/models", timeout=5).status_code == 200
            ):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{s.name} not healthy within {timeout_s:.0f} s; see {s.log}")


def _variants(args: argparse.Namespace) -> list[tuple[str, str]]:
    out = [tuple(v.split("=", 1)) for v in args.launch_pdserve_variant]
    names = [n for n, *_ in out]
    if any(len(v) != 2 or not v[0] for v in out) or len(set(names)) != len(names):
        raise SystemExit("--launch-pdserve-variant takes NAME=FLAGS, each NAME once")
    if {"pdserve", "transformers"} & set(names):
        raise SystemExit("--launch-pdserve-variant: the names pdserve and transformers are taken")
    return out  # type: ignore[return-value]


def _launch_all(args: argparse.Namespace, log_dir: str) -> list[Launched]:
    out = []
    pd = [("pdserve", "")] if args.launch_pdserve else []
    # Variants sit 20 ports up, two apart: each `pdserve up` also takes port + 1 for its control socket.
    for i, (name, flags) in enumerate(pd + _variants(args), start=-len(pd)):
        port = args.launch_port + (20 + 2 * i if i >= 0 else 0)
        argv = pdserve_up_argv(port, os.path.join(log_dir, name), args.pdserve_args, flags)
        out.append(launch(name, argv, port, log_dir))
    if args.launch_transformers_serve:
        from pdserve.model_source import resolve_model_source
        from pdserve.runtime.loader import model_folder

        port = args.launch_port + 10
        exe = os.path.join(os.path.dirname(sys.executable), "transformers")
        argv = [exe, "serve", model_folder(resolve_model_source(None)), "--continuous-batching",
                "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
                *shlex.split(args.transformers_args)]  # fmt: skip
        out.append(launch("transformers", argv, port, log_dir))
    if args.launch_llama_server:
        out.append(launch("llama-server", llama_server_argv(args), args.launch_port + 12, log_dir))
    return out


def llama_server_argv(args: argparse.Namespace) -> list[str]:
    """llama.cpp's `llama-server` on the bundled GGUF (or --llama-server-model), on --launch-port + 12."""
    if not os.access(args.launch_llama_server, os.X_OK):
        raise SystemExit(f"--launch-llama-server: {args.launch_llama_server!r} is not an executable file")
    model = args.llama_server_model
    if model is None:
        from pdserve.model_source import resolve_model_source

        model = resolve_model_source(None).gguf_path
    return [args.launch_llama_server, "-m", str(model), "--host", "127.0.0.1",
            "--port", str(args.launch_port + 12), *shlex.split(args.llama_server_args)]  # fmt: skip


# ---- driver ------------------------------------------------------------------------------------


def _model_id(url: str) -> str:
    r = httpx.get(url + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def warm_up(cfg: RunConfig, t: Target, prompts: list[Prompt], n: int, count_tokens) -> Target:
    """A few short requests; a field the server rejects (4xx) is dropped from this target's requests."""
    async with _client(cfg, 1) as client:
        for i in range(n):
            p = prompts[i % len(prompts)]
            r = await send_request(client, cfg, t, p, count_tokens, max_tokens=min(8, p.output_len))
            if not r.ok and 400 <= r.status < 500 and (t.usage or t.ignore_eos):
                print(f"{t.name}: rejected a request ({r.error[:120]}); retrying without "
                      "stream_options/ignore_eos (outputs may then end early at EOS)", flush=True)  # fmt: skip
                t = replace(t, usage=False, ignore_eos=False)
                r = await send_request(client, cfg, t, p, count_tokens, max_tokens=min(8, p.output_len))
            if not r.ok:
                raise RuntimeError(f"warm-up request to {t.name} failed: {r.error}")
    return t


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
    p = argparse.ArgumentParser(prog="pdserve bench serving", description=__doc__,
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
    p.add_argument("--output-len", type=int, default=None, help="fixed max_tokens for every request")
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
    p.add_argument("--launch-pdserve", action="store_true", help="start `pdserve up` and stop it at the end")
    p.add_argument("--pdserve-args", default="", help="extra flags for the launched `pdserve up`")
    p.add_argument("--launch-pdserve-variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="start another `pdserve up` with --pdserve-args plus FLAGS, as target NAME "
                   "(e.g. nocache=--disable-radix-cache)")  # fmt: skip
    p.add_argument("--launch-transformers-serve", action="store_true", help="start `transformers serve` too")
    # Unbounded, transformers' continuous batching sizes its KV cache to ~90% of free memory (host RAM
    # on CPU); these match pdserve's default CPU pool (32768 tokens) and chunked prefill (2048).
    p.add_argument("--transformers-args", default="--cb-num-blocks 128 --cb-max-batch-tokens 2048",
                   help="extra flags for the launched transformers serve (default: %(default)s)")  # fmt: skip
    p.add_argument("--launch-llama-server", default=None, metavar="PATH",
                   help="start llama.cpp's llama-server binary at PATH on the bundled GGUF as target llama-server")  # fmt: skip
    p.add_argument(
        "--llama-server-model",
        default=None,
        help="the GGUF file llama-server serves (default: the bundled one)",
    )
    # 16 slots of 1024 tokens each (llama-server splits -c among its -np slots), every core for both
    # generation and batches; --no-repack keeps ggml off its AMX repacking path, which crashes on
    # some of the CPUs this was measured on.
    cores = os.cpu_count() or 1
    p.add_argument("--llama-server-args", default=f"-t {cores} -tb {cores} -np 16 -c 16384 --no-repack",
                   help="extra flags for the launched llama-server (default: %(default)s)")  # fmt: skip
    p.add_argument("--launch-port", type=int, default=33100,
                   help="pdserve's port; transformers gets +10, llama-server +12")  # fmt: skip
    p.add_argument("--launch-timeout", type=float, default=600.0)
    p.add_argument("--launch-log-dir", default=None)
    args = p.parse_args(argv)
    if args.num_turns < 1 or args.multiturn_doc_len < 0 or args.shared_prefix_len < 0:
        p.error("--num-turns must be >= 1, --multiturn-doc-len and --shared-prefix-len >= 0")
    return args


def _pool(runs: list[tuple[list[RequestResult], float]]) -> dict:
    return summarize([r for rs, _ in runs for r in rs], sum(d for _, d in runs))


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
    args: argparse.Namespace, targets: list[Target]
) -> tuple[list[dict], list[dict], dict[tuple[str, int], dict[str, list[float]]]]:
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
                if multiturn:
                    by_conv, dur = await run_conversations(cfg, t, convs, conc, count_tokens)
                    res = [r for c in by_conv for r in c]
                    pooled_convs.setdefault((t.name, conc), []).extend(by_conv)
                    run["turns"] = summarize_turns(by_conv)
                else:
                    res, dur = await run_level(
                        cfg, t, prompts[:n], conc, args.request_rate, args.seed, count_tokens
                    )
                m = run["metrics"] = summarize(res, dur)
                pooled.setdefault((t.name, conc), []).append((res, dur))
                runs.append(run)
                print(format_result(t.name, args.backend, conc, args.request_rate, m), flush=True)
                after = server_counters(t.url)
                server = format_server(before, after, len(res))
                if server:
                    run["server"] = {k: after[k] - before.get(k, 0.0) for k in after}
                    print(server, flush=True)
    summary = []
    for conc, n in levels:
        ms = [_pool(pooled[(t.name, conc)]) for t in targets]
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = args.launch_log_dir or tempfile.mkdtemp(prefix="pdserve-bench-")
    os.makedirs(log_dir, exist_ok=True)
    launched = _launch_all(args, log_dir)
    try:
        for s in launched:
            wait_healthy(s, args.launch_timeout)
        targets = _targets(args, launched)
        runs, summary, samples = asyncio.run(_bench(args, targets))
    finally:
        for s in launched:
            s.stop()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"config": vars(args), "targets": [asdict(t) for t in targets], "runs": runs,
                       "summary": summary}, f, indent=2)  # fmt: skip
    if args.plot:
        from pdserve.bench.plots import write_plots

        for path in write_plots(args.plot, summary, samples, vars(args)):
            print(f"wrote {path}", flush=True)
    return 0 if all(r["metrics"]["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
