"""The disaggregated cluster end to end: real processes, real sockets, the bundled model."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from harness import start_roles, start_up

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the bundled model's served name

pytestmark = pytest.mark.timeout(600)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "List three primary colors:",
]
CONVERSATION = [
    "You are a patient tutor. A student asks: why does the sky look blue during the day but red and"
    " orange at sunset? Explain it in two short sentences.",
    " Thanks! And why are clouds white?",
]
SEED_FILE = os.path.join(os.path.dirname(__file__), "..", "data", "seed_responses.txt")


def load_seed() -> dict[str, dict]:
    """The reference response of each endpoint, keyed by 'POST /generate' etc."""
    text = open(SEED_FILE).read()
    out, head, buf = {}, None, []
    for line in text.splitlines():
        if line.startswith("POST "):
            if head:
                out[head] = json.loads("\n".join(buf))
            head, buf = line.strip(), []
        else:
            buf.append(line)
    out[head] = json.loads("\n".join(buf))
    return out


def assert_same_shape(ours, ref, path="") -> None:
    """Every key of the reference is present in ours with the same JSON type (null matches anything)."""
    if isinstance(ref, dict):
        assert isinstance(ours, dict), f"{path}: expected an object, got {ours!r}"
        for k, v in ref.items():
            assert k in ours, f"{path}.{k} missing"
            assert_same_shape(ours[k], v, f"{path}.{k}")
    elif isinstance(ref, list):
        assert isinstance(ours, list), f"{path}: expected a list"
        if ref and ours and not isinstance(ref[0], (int, float)):
            assert_same_shape(ours[0], ref[0], f"{path}[0]")
    elif ref is None:
        return
    elif isinstance(ref, bool):
        assert isinstance(ours, bool), f"{path}: expected bool, got {ours!r}"
    elif isinstance(ref, float):
        assert isinstance(ours, float), f"{path}: expected a float, got {ours!r}"
    elif isinstance(ref, int):
        assert isinstance(ours, int) and not isinstance(ours, bool), f"{path}: expected an int, got {ours!r}"
    else:
        assert isinstance(ours, type(ref)), f"{path}: expected {type(ref).__name__}, got {ours!r}"


def timeline(mi: dict) -> list[float]:
    """The stitched events in the order causality requires."""
    return [
        mi["request_received_ts"],
        mi["api_server_dispatch_finish_ts"],
        mi["forward_entry_time"],
        mi["prefill_finished_time"],
        mi["request_received_ts"] + mi["first_token_latency"],
        mi["request_finished_ts"],
        mi["response_sent_to_client_ts"],
    ]


def tokenize(cluster, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    from pdserve.model_source import resolve_model_source
    from pdserve.runtime.loader import model_folder

    tok = AutoTokenizer.from_pretrained(model_folder(resolve_model_source(None)))
    return [tok(t).input_ids for t in texts]


def generate(url: str, body: dict, timeout: float = 300) -> dict:
    r = httpx.post(url + "/generate", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_generate_equals_engine_and_transformers(cluster, engine_reference):
    ids = tokenize(cluster, PROMPTS)
    ours_engine, hf = engine_reference(ids, 16)
    batch = generate(
        cluster.url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    )
    assert isinstance(batch, list) and len(batch) == len(PROMPTS)
    for out, eng, ref in zip(batch, ours_engine, hf):
        assert out["output_ids"] == eng
        assert out["output_ids"] == ref[: len(out["output_ids"])]
    # Text prompts are tokenized by the gateway exactly like transformers does.
    single = generate(
        cluster.url, {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    )
    assert single["output_ids"] == hf[0][: len(single["output_ids"])]
    assert single["meta_info"]["prompt_tokens"] == len(ids[0])


def test_second_turn_reuses_the_first_turns_cached_prefix(cluster, engine_reference):
    """Turn 2's prompt starts with turn 1's prompt and answer: the prefill node serves turn 1's whole
    prompt pages from its prefix cache, and the output is the engine's without a cache."""
    page = 16  # the workers' --page-size default
    (p1,) = tokenize(cluster, [CONVERSATION[0]])
    (q2,) = tokenize(cluster, [CONVERSATION[1]])
    assert len(p1) >= 2 * page
    sp = {"max_new_tokens": 12, "temperature": 0}
    t1 = generate(cluster.url, {"input_ids": p1, "sampling_params": sp})
    assert t1["meta_info"]["cached_tokens"] == 0  # nothing before started this way
    p2 = p1 + t1["output_ids"] + q2
    t2 = generate(cluster.url, {"input_ids": p2, "sampling_params": sp})
    assert t2["meta_info"]["cached_tokens"] >= len(p1) // page * page
    assert t2["meta_info"]["cached_tokens"] % page == 0 and t2["meta_info"]["cached_tokens"] < len(p2)
    (want1, want2), _ = engine_reference([p1, p2], 12)
    assert t1["output_ids"] == want1 and t2["output_ids"] == want2
    # Turn 2's own prompt pages are cached now; the OpenAI usage reports them the same way.
    r = httpx.post(
        cluster.url + "/v1/completions",
        json={"model": MODEL, "prompt": p2, "max_tokens": 4, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(p2) - 1) // page * page


def test_generate_meta_info_matches_seed_shape_and_order(cluster):
    seed = load_seed()["POST /generate"]
    out = generate(
        cluster.url,
        {
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        },
    )
    assert list(out) == list(seed)
    assert_same_shape(out, seed)
    mi = out["meta_info"]
    assert list(mi) == list(seed["meta_info"])
    assert mi["finish_reason"] == {"type": "length", "length": 12}
    assert mi["completion_tokens"] == len(out["output_ids"]) == 12
    t = timeline(mi)
    assert t == sorted(t), t
    assert mi["e2e_latency"] == pytest.approx(mi["request_finished_ts"] - mi["request_received_ts"], abs=1e-6)


def test_streamed_generate_equals_non_streamed(cluster):
    body = {"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 20, "temperature": 0}}
    full = generate(cluster.url, body)
    chunks = []
    with httpx.stream("POST", cluster.url + "/generate", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert chunks, "no streamed chunks"
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]


def test_openai_client_chat_stream_completions_models(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", timeout=300)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]

    seed = load_seed()["POST /v1/chat/completions"]
    msgs = [{"role": "user", "content": "What is the third planet from the sun? Answer in one word."}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    # The seed's shape: the per-token weight-version segments inside `metadata`, which the openai client
    # types as a map of strings (so its dump warns; --strict-openai-metadata moves them beside it).
    assert_same_shape(chat.model_dump(warnings=False), seed)
    assert chat.metadata["weight_version"] == "default" and chat.metadata["weight_versions"]
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens >= 1
    assert chat.choices[0].finish_reason in ("stop", "length")

    stream = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == chat.choices[0].message.content
    assert finish == chat.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens

    comp = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert comp.choices[0].text.startswith(" Paris")
    assert comp.usage.prompt_tokens == 5


def test_bad_input_with_live_workers(cluster):
    cases = [
        ({"input_ids": [1, 2, 10**7], "sampling_params": {"max_new_tokens": 4}}, "vocab"),
        ({"input_ids": [1] * 9000, "sampling_params": {"max_new_tokens": 4}}, "context"),
        ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ]
    for body, word in cases:
        r = httpx.post(cluster.url + "/generate", json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert word in r.json()["error"]["message"].lower()
    assert generate(cluster.url, {"text": "hi", "sampling_params": {"max_new_tokens": 2}})["output_ids"]


def test_two_by_two_cluster_serves_32_concurrent_requests(tmp_path, engine_reference):
    ids = tokenize(None, PROMPTS)
    ref, _ = engine_reference(ids, 8)
    c = start_up(tmp_path, num_prefill=2, num_decode=2)
    try:
        c.wait_healthy(workers=4)

        def one(i: int) -> tuple[int, dict]:
            body = {
                "input_ids": ids[i % len(ids)],
                "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            }
            return i, generate(c.url, body, timeout=500)

        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(one, range(32)))
        assert len(results) == 32
        for i, out in results:
            assert out["output_ids"] == ref[i % len(ids)], i
        registered = httpx.get(c.url + "/workers", timeout=5).json()["workers"]
        assert len(registered) == 4  # no worker dropped out under the load
    finally:
        c.stop()


def clock_estimates(url: str) -> dict[str, tuple[float, float]]:
    """worker id -> (offset, rtt) of the gateway's clock estimate, from the gauges each Pong sets together."""
    got: dict[str, dict[str, float]] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in ("offset", "rtt"):
            if line.startswith(f"pdserve_worker_clock_{name}_seconds{{"):
                worker = re.search(r'worker="([^"]+)"', line).group(1)
                got.setdefault(worker, {})[name] = float(line.rsplit(" ", 1)[1])
    return {w: (v["offset"], v["rtt"]) for w, v in got.items() if len(v) == 2}


def test_timeline_ordered_under_clock_skew(tmp_path):
    # The prefill clock runs 7 s ahead, the decode clock 4 s behind.
    skews = {"prefill-0": 7.0, "decode-1": -4.0}
    c = start_roles(
        tmp_path,
        [("prefill", {}, ["--test-clock-skew", "7"]), ("decode", {}, ["--test-clock-skew", "-4"])],
    )
    # A 360-token prompt and 32 decode steps: the prefill's and the decode's work take far longer than
    # the gaps between a worker's events and the gateway's receipts around them.
    long_prompt = " ".join(PROMPTS * 12)
    try:
        c.wait_healthy()
        generate(c.url, {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}})  # pair group built
        for i in range(3):
            out = generate(
                c.url,
                {
                    # A different start each time: a prefix cache hit would shrink the prefill span.
                    "text": f"Run {i}. {long_prompt}",
                    "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True},
                },
            )
            mi = out["meta_info"]
            t = timeline(mi)
            assert t == sorted(t), t
            # Mapped onto the gateway clock: within the request's own lifetime, not seconds away.
            assert mi["request_received_ts"] <= mi["forward_entry_time"] <= mi["response_sent_to_client_ts"]
            assert 0 <= mi["queue_time"] < mi["e2e_latency"]
            # Each mapped time lands near the gateway's own witness: the idle prefill starts at once,
            # the first token follows the prefill's end by a transfer, the final output reaches the
            # gateway right after the decode finished. An offset ignored or flipped clamps a time to
            # the far end of its window: the prefill (or decode) span collapses to 0 and these fail.
            _, dispatched, forward_entry, prefill_finished, first, finished, sent = t
            prefill_span, decode_span = prefill_finished - forward_entry, finished - first
            assert forward_entry - dispatched < prefill_span / 2, t
            assert first - prefill_finished < prefill_span / 2, t
            assert sent - finished < decode_span / 2, t
        # Each worker's offset estimate is the injected skew, within its error bound (rtt / 2).
        est = clock_estimates(c.url)
        assert set(est) == set(skews), est
        for worker, (offset, rtt) in est.items():
            assert abs(offset - skews[worker]) <= rtt / 2 + 1e-6, (worker, offset, rtt)
    finally:
        c.stop()


def test_prompt_logprobs_equal_transformers_log_softmax(cluster, hf_bundled, tokenizer):
    """`return_logprob` with `logprob_start_len` gives the prompt's logprobs, computed on the prefill node,
    equal to transformers' log-softmax (fp32, 1e-4), also when the prompt's prefix is cached; completions
    with `echo` and `logprobs` (what lm-eval's loglikelihood reads) give the same numbers."""
    import torch

    (ids,) = tokenize(cluster, ["The quick brown fox jumps over the lazy dog because it was in a hurry to reach"
                                " the river before the sun went down behind the hills"])  # fmt: skip
    with torch.no_grad():
        ref = torch.log_softmax(hf_bundled(torch.tensor([ids])).logits[0].float(), -1)
    want = [None] + [ref[k - 1, ids[k]].item() for k in range(1, len(ids))]
    top2 = [None] + [ref[k - 1].topk(2).indices.tolist() for k in range(1, len(ids))]

    def close(got: list, expect: list) -> bool:
        return len(got) == len(expect) and all(
            (g is None and e is None) or (g is not None and e is not None and abs(g - e) < 1e-4)
            for g, e in zip(got, expect)
        )

    for start in (0, 20, 0):  # the second 0: the prompt's pages are cached by now
        body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2,
                "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}  # fmt: skip
        meta = generate(cluster.url, body)["meta_info"]
        got = meta["input_token_logprobs"]
        assert [t for _, t, _ in got] == ids[start:]
        assert close([lp for lp, _, _ in got], want[start:]), (start, got[:3], want[start : start + 3])
        assert got[-1][2] == tokenizer.decode([ids[-1]])  # return_text_in_logprobs
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(ids) - start and (start > 0 or tops[0] is None)
        assert [[t for _, t, _ in top] for top in tops if top] == [x for x in top2[start:] if x]
        assert len(meta["output_token_logprobs"]) == 2

    r = httpx.post(
        cluster.url + "/v1/completions",
        json={"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    prompt_text = tokenizer.decode(ids)
    assert choice["text"].startswith(prompt_text) and len(choice["text"]) > len(prompt_text)
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["tokens"][0] == tokenizer.decode([ids[0]])
    assert close(lp["token_logprobs"][: len(ids)], want)
    assert lp["text_offset"][len(ids)] == len(prompt_text)
    stream = httpx.post(
        cluster.url + "/v1/completions", json={"prompt": ids, "echo": True, "stream": True}, timeout=60
    )
    assert stream.status_code == 400 and "echo" in stream.json()["error"]["message"]


def _decode_legs_routed(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        float(v)
        for v in re.findall(r'^pdserve_routed_requests_total\{role="decode"[^}]*\} (\S+)$', text, re.M)
    )


def test_prefill_only_requests_give_prompt_logprobs_and_no_token(cluster, tokenizer):
    """max_new_tokens 0 (SGLang's prefill-only request; completions' `max_tokens: 0` with `echo`): the
    prefill node answers alone with the prompt's logprobs, no output token and no decode leg. A one-token
    request has no decode leg either, and its token is the one a longer request starts with."""
    import openai

    (ids,) = tokenize(cluster, ["Prefill only: the prompt's own logprobs, and nothing generated after them."])
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    routed = _decode_legs_routed(cluster.url)
    one = generate(cluster.url, {**body, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
    assert _decode_legs_routed(cluster.url) == routed
    two = generate(
        cluster.url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    )
    assert two["output_ids"][:1] == one["output_ids"] and _decode_legs_routed(cluster.url) == routed + 1
    routed += 1
    out = generate(cluster.url, {**body, "sampling_params": {"max_new_tokens": 0}})
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == ""
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["completion_tokens"] == 0
    assert meta["output_token_logprobs"] == []
    got = [lp for lp, _, _ in meta["input_token_logprobs"]]
    want = [lp for lp, _, _ in one["meta_info"]["input_token_logprobs"]]
    assert len(got) == len(ids) and got[0] is None
    assert all(abs(g - w) < 1e-4 for g, w in zip(got[1:], want[1:])), (got[:4], want[:4])
    tops = [[[t for _, t, _ in top] for top in m["input_top_logprobs"][1:]] for m in (meta, one["meta_info"])]
    assert tops[0] == tops[1]
    ts = [meta[k] for k in ("request_received_ts", "forward_entry_time", "prefill_finished_time",
                            "request_finished_ts", "response_sent_to_client_ts")]  # fmt: skip
    assert ts == sorted(ts), ts
    assert _decode_legs_routed(cluster.url) == routed  # no decode worker took part

    with httpx.stream("POST", cluster.url + "/generate", timeout=60,
                      json={"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 0}}) as r:  # fmt: skip
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]" and len(chunks) == 2, chunks
    last = json.loads(chunks[0])
    assert last["output_ids"] == [] and last["meta_info"]["finish_reason"]["type"] == "length"

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", timeout=300)
    comp = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    choice = comp.choices[0]
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
    assert comp.usage.completion_tokens == 0 and comp.usage.prompt_tokens == len(ids)
    assert len(choice.logprobs.token_logprobs) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert all(abs(g - w) < 1e-4 for g, w in zip(choice.logprobs.token_logprobs[1:], want[1:]))
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say nothing."}], max_tokens=0
    )
    assert chat.choices[0].message.content == "" and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 0
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say nothing."}], max_tokens=0, stream=True
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert _decode_legs_routed(cluster.url) == routed
