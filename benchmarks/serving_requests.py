"""The serving benchmark's load: one streamed request timed chunk by chunk, a concurrency level of them
with Poisson arrivals, conversations turn after turn, and the warm-up that adapts a target to its server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import httpx
import numpy as np

from pdserve.bench.serving_workload import Conversation, Prompt, flat_text
from pdserve.progress import Counter, stderr

BACKEND_PATHS = {
    "openai-chat": "/v1/chat/completions",
    "openai": "/v1/completions",
    "pdserve-native": "/generate",
}


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
    sent_at: float = 0.0  # run_level: seconds from the run's start to the send


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
    arrivals: list[float] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every prompt at its arrival time (`arrivals`: seconds from the start, e.g. a trace's; else
    Poisson arrivals at `rate`/s), at most `concurrency` in flight; wall time. Arrivals keep to the
    clock, so that a slow send never delays the ones after it."""
    if arrivals is None:
        rng = np.random.default_rng(seed)
        n_gaps = max(len(prompts) - 1, 0)
        gaps = [0.0] * n_gaps if rate == float("inf") else list(rng.exponential(1.0 / rate, n_gaps))
        arrivals = [float(x) for x in np.cumsum([0.0, *gaps])][: len(prompts)]
    sem = asyncio.Semaphore(concurrency)
    async with _client(cfg, concurrency) as client:
        bar = Counter(len(prompts), f"{t.name} concurrency {concurrency}", stderr)

        async def one(p: Prompt) -> RequestResult:
            async with sem:
                sent_at = time.perf_counter() - start
                r = await send_request(client, cfg, t, p, count_tokens)
                r.sent_at = sent_at
                bar.update()
                return r

        start = time.perf_counter()
        tasks = []
        for p, at in zip(prompts, arrivals, strict=True):
            wait = start + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
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
