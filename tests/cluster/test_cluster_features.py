"""Cluster behaviours beyond plain greedy serving, through real processes and the bundled model.

- stop strings that span two tokens, streamed (native and OpenAI): no chunk shows text that is later cut;
- seeded sampling with logprobs across the prefill -> decode split equals the offline engine;
- a prefill worker killed mid-load and restarted at the same KV address: no request hangs or is lost;
- a stalled KV transfer ends by the timeout that fits the stall: `--kv-wait-timeout` while the data
  has not started, `--transfer-timeout` once it has.

Two clusters: the shared `pdserve up` one (first two), and one of separate roles whose prefill
worker is restarted with different test hooks (last two).
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from harness import start_roles, start_worker
from reliability.calls import (
    GATEWAY_FLAGS,
    PROMPT,
    body,
    generate,
    pool_sizes,
    stream,
    wait_for,
    wait_pools,
    workers,
)

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the bundled model's served name

pytestmark = pytest.mark.timeout(600)

# Greedy continuation " 11, 12, 13, ...": "13" is two tokens ("1", "3"), and "1" alone (a prefix of
# the stop string) shows up in "11" and "12" first, so the gateway must hold it back and let it go.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
SAMPLED_PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a"]
TRANSFER_TIMEOUT_S = 3.0  # one KV send/recv once data flows
KV_WAIT_TIMEOUT_S = 15.0  # the decode's wait for data (covers the prefill's queue and forward too)
ROLE_FLAGS = ["--transfer-timeout", str(TRANSFER_TIMEOUT_S), "--kv-wait-timeout", str(KV_WAIT_TIMEOUT_S)]


@pytest.fixture(scope="module")
def tok():
    from pdserve.gateway.text.tokenizer import Tokenizer

    return Tokenizer.load(None)


@pytest.fixture(scope="module")
def engine():
    from pdserve.config import RuntimeConfig
    from pdserve.runtime.engine import Engine

    return Engine(RuntimeConfig(dtype="float32", max_total_tokens=8192, num_threads=1))


def sse_chunks(url: str, req: dict, timeout: float = 300) -> list[dict]:
    """Every event of a streamed response, in order; the stream must end with [DONE]."""
    chunks, done = [], False
    with httpx.stream("POST", url, json=req, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert done and chunks, chunks
    return chunks


def post(url: str, req: dict) -> dict:
    r = httpx.post(url, json=req, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


# ---- stop strings across token boundaries, streamed ---------------------------------------------


def test_stop_string_across_two_tokens_native_stream(cluster, tok):
    stop = "13"
    idle = pool_sizes(cluster.url)
    sp = {"max_new_tokens": 24, "temperature": 0}
    free = post(cluster.url + "/generate", {"text": COUNTING, "sampling_params": sp})
    pieces = [tok.decode([t]) for t in free["output_ids"]]
    assert stop in "".join(pieces) and not any(stop in p for p in pieces), pieces  # it spans tokens
    expected = free["text"][: free["text"].index(stop)]

    req = {"text": COUNTING, "sampling_params": {**sp, "stop": [stop]}}
    chunks = sse_chunks(cluster.url + "/generate", {**req, "stream": True})
    assert len(chunks) > 2, chunks  # streamed token by token, not in one piece
    for ch in chunks:
        # Cumulative text: every chunk is a prefix of the final text, which the stop string cut.
        assert expected.startswith(ch["text"]), (ch["text"], expected)
    assert chunks[-1]["text"] == expected
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    plain = post(cluster.url + "/generate", req)
    assert plain["text"] == expected and plain["meta_info"]["finish_reason"]["type"] == "stop"
    # The gateway aborted the decode leg on the match: both pools hold nothing afterwards.
    wait_pools(cluster.url, idle)


def _openai_stream_text(url: str, req: dict, chat: bool) -> tuple[str, list[dict]]:
    """The streamed deltas joined, and the chunks that carried a finish reason."""
    text, finals = "", []
    for ch in sse_chunks(url, {**req, "stream": True}):
        for c in ch["choices"]:
            text += (c["delta"].get("content") or "") if chat else c["text"]
            if c["finish_reason"] is not None:
                finals.append(c)
    return text, finals


@pytest.mark.parametrize(
    "chat,stop",
    [(False, "13"), (True, "5\n6")],  # completions: " 11, 12, 13"; chat: "1. 1\n2. 2\n...5. 5\n6. 6"
    ids=["completions", "chat"],
)
def test_stop_string_across_two_tokens_openai_stream(cluster, chat, stop):
    idle = pool_sizes(cluster.url)
    if chat:
        url = cluster.url + "/v1/chat/completions"
        req = {"messages": [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]}
    else:
        url, req = cluster.url + "/v1/completions", {"prompt": COUNTING}
    req = {**req, "model": MODEL, "max_tokens": 48, "temperature": 0}
    free = post(url, {**req, "logprobs": True} if chat else {**req, "logprobs": 0})["choices"][0]
    if chat:
        full, pieces = free["message"]["content"], [t["token"] for t in free["logprobs"]["content"]]
    else:
        full, pieces = free["text"], free["logprobs"]["tokens"]
    assert stop in full and not any(stop in p for p in pieces), pieces  # it spans tokens
    expected = full[: full.index(stop)]

    text, finals = _openai_stream_text(url, {**req, "stop": stop}, chat)
    # Deltas cannot be taken back: their concatenation is exactly the text before the stop string.
    assert text == expected, (text, expected)
    assert len(finals) == 1 and finals[0]["finish_reason"] == "stop", finals
    assert finals[0]["matched_stop"] == stop, finals
    wait_pools(cluster.url, idle)


# ---- seeded sampling and logprobs across the prefill -> decode split ------------------------------


def test_seeded_sampling_with_logprobs_equals_engine(cluster, engine, tok):
    from pdserve.sampling_params import SamplingParams

    ids = [tok.encode(t) for t in SAMPLED_PROMPTS]
    knobs = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "max_new_tokens": 24}
    ref = engine.generate(ids, SamplingParams(**knobs, seed=1234, logprobs=True))
    greedy = engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=24))
    assert [r.output_ids for r in ref] != [g.output_ids for g in greedy]  # the seed drives real draws

    # Native: the first token is sampled on the prefill node, the rest on the decode node.
    outs = post(
        cluster.url + "/generate",
        {"input_ids": ids, "sampling_params": {**knobs, "seed": 1234}, "return_logprob": True},
    )
    for out, r in zip(outs, ref):
        assert out["output_ids"] == r.output_ids
        lps = out["meta_info"]["output_token_logprobs"]  # [[logprob, token id, None], ...]
        assert [t for _, t, _ in lps] == r.output_ids
        assert [lp for lp, _, _ in lps] == pytest.approx(r.output_logprobs, abs=1e-3)
    other = post(cluster.url + "/generate", {"input_ids": ids[0], "sampling_params": {**knobs, "seed": 99}})
    assert other["output_ids"] != ref[0].output_ids  # another seed, other draws

    # OpenAI completions with `seed`: the same draws, the same logprobs.
    comp = post(
        cluster.url + "/v1/completions",
        {
            "model": MODEL,
            "prompt": SAMPLED_PROMPTS[0],
            "max_tokens": knobs["max_new_tokens"],
            "temperature": knobs["temperature"],
            "top_p": knobs["top_p"],
            "top_k": knobs["top_k"],
            "seed": 1234,
            "logprobs": 0,
        },
    )["choices"][0]
    assert comp["text"] == tok.decode(ref[0].output_ids)
    assert comp["logprobs"]["token_logprobs"] == pytest.approx(ref[0].output_logprobs, abs=1e-3)


# ---- a prefill worker restarted at the same KV address; stalled transfers --------------------------


@pytest.fixture(scope="module")
def roles(tmp_path_factory):
    """Gateway, prefill-0 and decode-1 as separate processes; prefill-0 is restarted by the tests."""
    c = start_roles(
        tmp_path_factory.mktemp("restart"),
        [("prefill", {}, ROLE_FLAGS), ("decode", {}, ROLE_FLAGS)],
        # A heartbeat timeout longer than a restart takes: the new process registers while the
        # gateway still holds requests on the old one.
        gateway_flags=[*GATEWAY_FLAGS, "--heartbeat-timeout", "120"],
    )
    try:
        c.wait_healthy(workers=2)
        # The port prefill-0 bound first; every restart binds it again (the same KV bootstrap address).
        c.bootstrap_port = int(workers(c.url)["prefill-0"]["bootstrap_addr"].rsplit(":", 1)[1])
        c.idle = pool_sizes(c.url)
        yield c
    finally:
        c.stop()


def _kill_prefill(c) -> None:
    p = c.procs[1]  # procs: gateway, prefill-0, decode-1
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def _start_prefill(c, hooks: list[str]) -> None:
    """prefill-0 again, at the same bootstrap port, with `hooks` (hidden test flags)."""
    flags = [*ROLE_FLAGS, "--disaggregation-bootstrap-port", str(c.bootstrap_port), *hooks]
    c.procs[1] = start_worker(c, "prefill", "prefill-0", {}, flags)


def _wait_registered(c, log_size: int, timeout_s: float = 240) -> None:
    """The restarted prefill-0 logged its registration (after `log_size` bytes of its log)."""
    path = os.path.join(c.log_dir, "prefill-0.log")

    def registered() -> bool:
        assert c.procs[1].poll() is None, f"prefill-0 exited; see {path}"
        with open(path, "rb") as f:
            f.seek(log_size)
            return b"prefill worker prefill-0 registered" in f.read()

    wait_for(registered, timeout_s, "the restarted prefill-0 to register")
    wait_for(lambda: "prefill-0" in workers(c.url), 30, "prefill-0 in the gateway's registry")


def _restart_prefill(c, hooks: list[str]) -> None:
    size = os.path.getsize(os.path.join(c.log_dir, "prefill-0.log"))
    _kill_prefill(c)
    _start_prefill(c, hooks)
    _wait_registered(c, size)


def _reference(engine, tok, text: str, n: int) -> list[int]:
    """The offline engine's greedy ids for `reliability.calls.body(n, text=text)`."""
    from pdserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    return engine.generate([tok.encode(text)], params)[0].output_ids


def test_prefill_restarted_at_the_same_address_mid_load(roles, engine, tok):
    """kill -9 prefill-0 while it holds requests and start it again at once on the same port. The
    requests it held end in a clear error (its re-registration, or the decode's KV wait), none hangs;
    afterwards the decode node re-handshakes with the new process and every request succeeds."""
    c = roles
    n = 16
    # Long prompts keep the prefill node busy, so it holds requests when it dies; each starts
    # differently, so the prefix cache cannot shortcut them.
    texts = [f"Part {i}. " + " ".join(["the history of the printing press"] * 30) for i in range(8)]
    ref = _reference(engine, tok, PROMPT, n)
    long_refs = [_reference(engine, tok, t, n) for t in texts]
    log_size = os.path.getsize(os.path.join(c.log_dir, "prefill-0.log"))
    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        first = [pool.submit(generate, c.url, body(n, text=t), 150) for t in texts[:6]]
        first += [pool.submit(stream, c.url, body(n, stream=True, text=t), 150) for t in texts[6:]]
        held = lambda: (w := workers(c.url)["prefill-0"])["queued"] + w["running"] > 0  # noqa: E731
        wait_for(held, 60, "requests held by prefill-0")
        _kill_prefill(c)
        _start_prefill(c, [])
        # More requests while the new process loads: the gateway still routes them to the dead one.
        during = [pool.submit(generate, c.url, body(n), 150) for _ in range(4)]
        outs = [f.result(timeout=200) for f in first] + [f.result(timeout=200) for f in during]
    elapsed = time.monotonic() - t0
    kinds: dict[str, int] = {}
    for o, expect in zip(outs, long_refs + [ref] * len(during)):
        if o.ok:
            assert o.output_ids == expect
        else:
            assert o.status in (200, 503), o  # an HTTP error, or an error event ending a stream
            assert "transfer" in o.error or "prefill" in o.error, o.error
        key = "ok" if o.ok else o.error[:70]
        kinds[key] = kinds.get(key, 0) + 1
    print(f"prefill restart mid-load: {kinds}; all ended within {elapsed:.1f} s")
    assert not all(o.ok for o in outs[: len(first)]), "the kill hit no request in flight"

    # The restarted process serves every request; the decode node re-handshakes with it.
    _wait_registered(c, log_size)
    with ThreadPoolExecutor(4) as pool:
        after = list(pool.map(lambda _: generate(c.url, body(n), 120), range(6)))
    assert all(o.ok for o in after), [o.error for o in after if not o.ok]
    assert all(o.output_ids == ref for o in after)
    wait_pools(c.url, c.idle)


def test_kv_wait_timeout_ends_a_send_that_never_starts(roles):
    """The prefill node holds each finished prefill back (--test-stall-kv-send): no data is
    announced, so the decode's KV wait timeout (15 s) fires, not the transfer timeout (3 s)."""
    c = roles
    _restart_prefill(c, ["--test-stall-kv-send", "120"])
    with ThreadPoolExecutor(2) as pool:
        outs = list(
            pool.map(
                lambda f: f(),
                [lambda: generate(c.url, body(8), 90), lambda: stream(c.url, body(8, stream=True), 90)],
            )
        )
    for o in outs:
        assert not o.ok
        assert f"timed out after {KV_WAIT_TIMEOUT_S}s waiting for KV data" in o.error, o.error
        # Not before the wait timeout: the per-operation timeout must not cut a wait.
        assert KV_WAIT_TIMEOUT_S <= o.seconds < KV_WAIT_TIMEOUT_S + 15, o.seconds
    wait_pools(c.url, c.idle)


def test_transfer_timeout_ends_a_transfer_stalled_mid_way(roles):
    """The prefill node announces the transfer, then holds its data back (--test-stall-kv-data):
    the decode's receive times out by the transfer timeout (3 s), well before the KV wait timeout."""
    c = roles
    stall_s = 20.0
    # The pair group's own per-operation timeout is under test: no shared memory for this prefill node.
    _restart_prefill(c, ["--test-stall-kv-data", str(stall_s), "--kv-transport", "dist"])
    o = generate(c.url, body(8), 90)
    assert not o.ok
    assert "receiving KV failed" in o.error, o.error
    # gloo's own per-operation timeout, set from --transfer-timeout.
    assert f"Timed out waiting {TRANSFER_TIMEOUT_S * 1000:.0f}ms for recv" in o.error, o.error
    assert "waiting for KV data" not in o.error, o.error
    assert TRANSFER_TIMEOUT_S <= o.seconds < KV_WAIT_TIMEOUT_S, o.seconds
    # The prefill node frees its pages once the held-back send gives up after the stall.
    wait_pools(c.url, c.idle, timeout_s=stall_s + 40)


def test_first_token_comes_before_its_kv(roles, engine, tok):
    """The first token reaches the client with PrefillDone, before the KV lands on the decode node:
    with every hand-off held back 6 s (--test-stall-kv-send), a request its first token finishes (a stop
    token; its decode leg still gets the KV) is answered and a stream shows its first token well before
    then; the stream's later tokens follow the KV, and no token or logprob comes twice. A one-token
    request has no decode leg at all."""
    c = roles
    stall_s = 6.0
    _restart_prefill(c, ["--test-stall-kv-send", str(stall_s)])
    ref = _reference(engine, tok, PROMPT, 6)

    stopped = body(4)
    stopped["sampling_params"]["stop_token_ids"] = ref[:1]
    one = generate(c.url, stopped, 60)
    assert one.ok and one.output_ids == ref[:1] and one.meta["finish_reason"]["type"] == "stop", one
    assert one.seconds < stall_s / 2, one.seconds
    alone = generate(c.url, body(1), 60)
    assert alone.ok and alone.output_ids == ref[:1] and alone.seconds < stall_s / 2, alone

    t0 = time.monotonic()
    first_at: list[float] = []
    o = stream(
        c.url,
        {**body(6, stream=True), "return_logprob": True},
        90,
        first_chunk=lambda: first_at.append(time.monotonic() - t0),
    )
    assert o.ok and o.output_ids == ref, o
    assert first_at[0] < stall_s / 2 <= stall_s <= o.seconds, (first_at, o.seconds)
    assert o.meta is not None
    assert [t for _, t, _ in o.meta["output_token_logprobs"]] == ref
    assert o.meta["completion_tokens"] == 6
    # The stopped request's KV went to the decode node after the stall; nobody waits for it there.
    wait_pools(c.url, c.idle, timeout_s=stall_s + 30)
