"""Requests through the gateway to workers speaking the real wire protocol (scripted outputs)."""

from __future__ import annotations

import json
import re
import time

import pytest

from pdserve.gateway.errors import FAIL_STATUS
from pdserve.protocol import gateway as m
from pdserve.protocol.vocabulary import FailCode

SEED_META_KEYS = [
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "storage_prefetch_wait",
    "storage_staging_wait",
    "forward_entry_time",
    "prefill_finished_time",
    "queue_time",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "weight_versions",
    "cached_tokens_details",
    "dp_rank",
    "e2e_latency",
    "spec_accept_rate",
    "spec_accept_length",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
    "spec_verify_ct",
    "spec_correct_drafts_histogram",
    "request_received_ts",
    "first_token_latency",
    "api_server_dispatch_finish_ts",
    "request_finished_ts",
    "decode_throughput",
    "response_sent_to_client_ts",
]
ORDERED_TS = [
    "request_received_ts",
    "api_server_dispatch_finish_ts",
    "forward_entry_time",
    "prefill_finished_time",
    "request_finished_ts",
    "response_sent_to_client_ts",
]

pytestmark = pytest.mark.timeout(60)


def _sse(resp) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _check_meta(meta: dict, completion_tokens: int) -> None:
    assert list(meta)[: len(SEED_META_KEYS)] == SEED_META_KEYS
    assert meta["completion_tokens"] == completion_tokens
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": completion_tokens}]
    ts = [meta[k] for k in ORDERED_TS]
    assert ts == sorted(ts), dict(zip(ORDERED_TS, ts))
    first = meta["request_received_ts"] + meta["first_token_latency"]
    assert meta["prefill_finished_time"] <= first <= meta["request_finished_ts"]
    assert meta["e2e_latency"] == pytest.approx(meta["request_finished_ts"] - meta["request_received_ts"])
    for k in (
        "storage_prefetch_wait",
        "storage_staging_wait",
        "queue_time",
        "e2e_latency",
        "decode_throughput",
    ):
        assert isinstance(meta[k], float)
    assert meta["dp_rank"] is None and meta["reasoning_tokens"] == 0


def test_generate_full_response(cluster, tokenizer):
    r = cluster.client.post(
        "/generate", json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 64}}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    reply_ids = tokenizer.encode(cluster.reply)
    assert out["output_ids"] == reply_ids + [tokenizer.eos_token_id]
    assert out["text"] == cluster.reply
    meta = out["meta_info"]
    _check_meta(meta, len(reply_ids) + 1)
    assert meta["finish_reason"] == {"type": "stop", "matched": tokenizer.eos_token_id}
    assert meta["prompt_tokens"] == len(tokenizer.encode("The capital of France is"))
    assert meta["cached_tokens"] == 1 and meta["cached_tokens_details"] == {"device": 1, "host": 0}
    steps = -(-(len(reply_ids) + 1) // 2)
    assert meta["spec_verify_ct"] == steps
    assert meta["spec_accept_length"] == pytest.approx((len(reply_ids) + 1) / steps)
    assert meta["spec_correct_drafts_histogram"] == [1, 2, 0, 0]
    # Both legs got the same request with the prefill's bootstrap address.
    (preq,), (dreq,) = cluster.prefill.requests(), cluster.decode.requests()
    assert preq == dreq and preq.prefill_bootstrap_addr == "127.0.0.1:9"
    assert preq.prefill_worker == "p0" and preq.decode_worker == "d0" and len(preq.room) == 32


def test_generate_length_and_logprobs(cluster):
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 5},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    out = cluster.client.post("/generate", json=body).json()
    assert len(out["output_ids"]) == 5
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["output_token_logprobs"] == [[-0.5, t, None] for t in out["output_ids"]]
    assert meta["output_top_logprobs"][0] == [
        [-0.5, out["output_ids"][0], None],
        [-1.5, out["output_ids"][0] + 1, None],
    ]


def test_stop_string_cuts_text_and_aborts_decode(cluster, tokenizer):
    body = {"text": "Q:", "sampling_params": {"max_new_tokens": 64, "stop": ["Paris"]}}
    out = cluster.client.post("/generate", json=body).json()
    assert out["text"] == "The capital of France is "
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "Paris"}
    assert tokenizer.decode(out["output_ids"]).endswith("Paris")
    # The reply can reach the client before the decode worker's thread has read the abort.
    deadline = time.monotonic() + 2
    while not (cluster.decode.requests() and cluster.decode.aborted) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.room for r in cluster.decode.requests()] == cluster.decode.aborted
    ab = [x for x in cluster.decode.received if isinstance(x, m.AbortRequest)][0]
    assert ab.reason == "stop"


def test_generate_batch_and_n(cluster):
    out = cluster.client.post(
        "/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 3, "n": 2}}
    ).json()
    assert isinstance(out, list) and len(out) == 4
    assert all(o["meta_info"]["completion_tokens"] == 3 for o in out)
    assert len({o["meta_info"]["id"] for o in out}) == 4


def test_generate_stream_cumulative(cluster):
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 64}, "stream": True}
    with cluster.client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        events = _sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 3
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["text"] == cluster.reply
    _check_meta(chunks[-1]["meta_info"], len(chunks[-1]["output_ids"]))
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_chat_completion_shape(cluster, tokenizer):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Capital of France?"}],
        "max_tokens": 64,
    }
    out = cluster.client.post("/v1/chat/completions", json=body).json()
    assert list(out) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
        "metadata",
    ]
    assert out["object"] == "chat.completion" and out["model"] == MODEL
    (choice,) = out["choices"]
    assert choice == {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": cluster.reply,
            "reasoning_content": None,
            "tool_calls": None,
        },
        "logprobs": None,
        "finish_reason": "stop",
        "matched_stop": tokenizer.eos_token_id,
    }
    n_out = len(tokenizer.encode(cluster.reply)) + 1
    prompt = tokenizer.hf.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    assert cluster.prefill.requests()[0].input_ids == list(prompt)
    assert out["usage"] == {
        "prompt_tokens": len(prompt),
        "total_tokens": len(prompt) + n_out,
        "completion_tokens": n_out,
        "prompt_tokens_details": {"cached_tokens": 1},
        "completion_tokens_details": {"reasoning_tokens": 0},
        "reasoning_tokens": 0,
    }
    # As the seed has it: the per-token segments inside `metadata`.
    segments = [{"version": "default", "start": 0, "end": n_out}]
    assert out["metadata"] == {"weight_version": "default", "weight_versions": segments}


def test_strict_openai_metadata_holds_strings_only(wire_cluster):
    """--strict-openai-metadata: `metadata` is OpenAI's map of strings; the segments sit beside it."""
    cluster = wire_cluster(strict_openai_metadata=True)
    cluster.reply = "Paris."
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Capital?"}], "max_tokens": 8}
    out = cluster.client.post("/v1/chat/completions", json=body).json()
    assert list(out)[-2:] == ["metadata", "weight_versions"]
    assert out["metadata"] == {"weight_version": "default"}
    assert out["weight_versions"][0]["version"] == "default"
    text = {"model": MODEL, "prompt": "Capital?", "max_tokens": 8}
    out = cluster.client.post("/v1/completions", json=text).json()
    assert out["metadata"] == {"weight_version": "default"} and out["weight_versions"]


def test_chat_logprobs_and_n(cluster):
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 3,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 1,
        "seed": 7,
    }
    out = cluster.client.post("/v1/chat/completions", json=body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" and c["matched_stop"] is None for c in out["choices"])
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert len(content[0]["top_logprobs"]) == 1
    seeds = sorted(r.sampling.seed for r in cluster.decode.requests())
    assert seeds == [7, 8]


def test_chat_stream_with_usage(cluster):
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": "France",
    }
    with cluster.client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = _sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks if c["choices"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text == "The capital of "
    assert content[-1]["choices"][0]["finish_reason"] == "stop"
    assert content[-1]["choices"][0]["matched_stop"] == "France"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0


def test_completions(cluster):
    out = cluster.client.post(
        "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 4, "logprobs": 1}
    ).json()
    assert out["object"] == "text_completion"
    assert [c["index"] for c in out["choices"]] == [0, 1]
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and lp["token_logprobs"] == [-0.5] * 4 and lp["text_offset"][0] == 0
    assert out["usage"]["completion_tokens"] == 8
    with cluster.client.stream(
        "POST", "/v1/completions", json={"prompt": "a", "max_tokens": 64, "stream": True}
    ) as r:
        events = _sse(r)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cluster.reply


def test_context_length_checks(cluster):
    # The workers register context_length 2048.
    r = cluster.client.post(
        "/generate", json={"input_ids": [5] * 2000, "sampling_params": {"max_new_tokens": 100}}
    )
    assert r.status_code == 400 and "context length is 2048" in r.json()["error"]["message"]
    r = cluster.client.post("/generate", json={"input_ids": [5] * 2048})
    assert r.status_code == 400
    # Not given: capped to the remaining context.
    r = cluster.client.post("/generate", json={"input_ids": [5] * 2040, "sampling_params": {"n": 1}})
    assert r.status_code == 200
    assert cluster.decode.requests()[-1].sampling.max_new_tokens == 8


def test_prefill_failure_is_an_error_and_aborts_decode(cluster):
    cluster.prefill.fail_code = "transfer"
    # As with real workers, the decode produces nothing before its KV arrives (which it never does
    # here): otherwise its first tokens could race the prefill's failure and the request would live on.
    cluster.decode.kv_wait_s = 2.0
    r = cluster.client.post("/generate", json={"text": "hi"})
    assert r.status_code == 503
    msg = r.json()["error"]["message"]
    assert "prefill" in msg and "p0" in msg and "transfer" in msg
    # The 503 can reach the client before the decode worker's thread has read the request (or its abort).
    deadline = time.monotonic() + 2
    while not (cluster.decode.requests() and cluster.decode.aborted) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.room for r in cluster.decode.requests()] == cluster.decode.aborted
    assert "pdserve_kv_transfer_failures_total 1.0" in cluster.client.get("/metrics").text


def test_decode_failure_streaming_ends_with_abort_and_error(cluster):
    cluster.decode.fail_code = "oom"
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    with cluster.client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = _sse(r)
    assert events[-1] == "[DONE]"
    assert events[-3]["choices"][0]["finish_reason"] == "abort"
    assert "decode" in events[-2]["error"]["message"] and "oom" in events[-2]["error"]["message"]


@pytest.mark.timeout(60)
def test_decode_death_fails_in_flight_request(cluster):
    # A decode that never finishes; then it dies.
    cluster.decode.step_s = 0.2
    cluster.reply = " word" * 200
    import threading

    result = {}

    def call() -> None:
        result["r"] = cluster.client.post(
            "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 300}}
        )

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.5)
    cluster.decode.stop()
    t.join(timeout=10)
    r = result["r"]
    assert r.status_code == 503
    assert "decode worker d0 stopped responding" in r.json()["error"]["message"]
    room = cluster.prefill.requests()[0].room
    # Health reflects the loss. The prefill leg is aborted although its PrefillDone arrived: a
    # transfer to the dead decode may still hold its pages (docs/reliability.md).
    assert cluster.client.get("/health").status_code == 503
    deadline = time.monotonic() + 2
    while room not in cluster.prefill.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cluster.prefill.aborted == [room]


def test_client_disconnect_aborts_both_legs(cluster):
    cluster.decode.step_s = 0.05
    cluster.reply = " word" * 200
    cluster.prefill.prefill_delay_s = 5.0  # prefill still holds the request when the client leaves
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 300}, "stream": True}
    with cluster.client.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    room = cluster.decode.requests()[0].room
    deadline = time.monotonic() + 3
    while (
        not (room in cluster.decode.aborted and room in cluster.prefill.aborted)
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    assert room in cluster.decode.aborted and room in cluster.prefill.aborted


def test_overload_answers_503_at_once(tokenizer):
    from .conftest import WireWorker, control_addr, gateway_client, text_script

    with gateway_client(tokenizer, max_pending_generations=1) as c:
        addr = control_addr(c)
        ws = [
            WireWorker(addr, "p0", "prefill").start(),
            WireWorker(addr, "d0", "decode", script=text_script(tokenizer, " x" * 100), step_s=0.05).start(),
        ]
        try:
            import threading

            t = threading.Thread(
                target=lambda: c.post(
                    "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 40}}
                )
            )
            t.start()
            time.sleep(0.3)
            t0 = time.monotonic()
            r = c.post("/generate", json={"text": "b"})
            assert time.monotonic() - t0 < 0.5
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "limit of 1 pending generations" in r.json()["error"]["message"]
            t.join(10)
            assert (
                c.post("/generate", json={"text": "b", "sampling_params": {"max_new_tokens": 2}}).status_code
                == 200
            )
        finally:
            for w in ws:
                w.stop()


def _clock_estimates(client) -> dict[str, tuple[float, float]]:
    """worker id -> (offset, rtt) of its clock estimate, from the two gauges each Pong sets together."""
    got: dict[str, dict[str, float]] = {}
    for line in client.get("/metrics").text.splitlines():
        for name in ("offset", "rtt"):
            if line.startswith(f"pdserve_worker_clock_{name}_seconds{{"):
                worker = re.search(r'worker="([^"]+)"', line).group(1)
                got.setdefault(worker, {})[name] = float(line.rsplit(" ", 1)[1])
    return {w: (v["offset"], v["rtt"]) for w, v in got.items() if len(v) == 2}


def test_skewed_worker_clocks_give_ordered_timeline(tokenizer):
    from .conftest import WireWorker, control_addr, gateway_client, text_script

    skews = {"p0": 5.0, "d0": -5.0}
    with gateway_client(tokenizer) as c:
        addr = control_addr(c)
        # PrefillDone 0.3 s after the prefill events, then 16 decode steps of 20 ms after a 0.3 s wait
        # for the KV: an offset ignored or flipped moves the mapped times to the far end of their
        # causal window, 0.3 s away from the true ones.
        prefill = WireWorker(addr, "p0", "prefill", skew_s=skews["p0"], prefill_delay_s=0.3).start()
        decode = WireWorker(
            addr, "d0", "decode", skew_s=skews["d0"], step_s=0.02, script=text_script(tokenizer, " word" * 40)
        ).start()
        decode.kv_wait_s = 0.3
        try:
            deadline = time.monotonic() + 5
            while len(_clock_estimates(c)) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)  # until a ping round trip from each worker
            time.sleep(0.3)  # a few more round trips
            out = c.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 32}}).json()
            meta = out["meta_info"]
            _check_meta(meta, 32)
            # The estimate is within its own error bound (rtt / 2) of the injected skew.
            for worker, (offset, rtt) in _clock_estimates(c).items():
                assert abs(offset - skews[worker]) <= rtt / 2 + 1e-6, (worker, offset, rtt)
            # Each mapped event lands near the moment the worker stamped it (its time minus the skew).
            room = prefill.requests()[0].room
            p_true = {k: t - skews["p0"] for k, t in prefill.events[room].items()}
            d_true = {k: t - skews["d0"] for k, t in decode.events[room].items()}
            assert abs(meta["forward_entry_time"] - p_true["forward_entry"]) < 0.05, (meta, p_true)
            assert abs(meta["prefill_finished_time"] - p_true["prefill_finished"]) < 0.05, (meta, p_true)
            assert abs(meta["request_finished_ts"] - d_true["finished"]) < 0.05, (meta, d_true)
        finally:
            prefill.stop()
            decode.stop()


def test_routing_spreads_over_workers(cluster):
    cluster.add("d1", "decode")
    cluster.add("p1", "prefill")
    for _ in range(4):
        assert (
            cluster.client.post(
                "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}}
            ).status_code
            == 200
        )
    per = {w.worker_id: len(w.requests()) for w in cluster.workers}
    assert per == {"p0": 2, "p1": 2, "d0": 2, "d1": 2}


def test_request_timeout_is_504_and_aborts_both(tokenizer):
    from .conftest import WireWorker, control_addr, gateway_client, text_script

    with gateway_client(tokenizer, request_timeout_s=0.5) as c:
        addr = control_addr(c)
        p = WireWorker(addr, "p0", "prefill", prefill_delay_s=5.0).start()
        d = WireWorker(addr, "d0", "decode", script=text_script(tokenizer, " x" * 100), step_s=0.2).start()
        try:
            t0 = time.monotonic()
            r = c.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 90}})
            assert 0.4 < time.monotonic() - t0 < 2.0
            assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
            room = d.requests()[0].room
            deadline = time.monotonic() + 2
            while not (room in d.aborted and room in p.aborted) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert room in d.aborted and room in p.aborted
        finally:
            p.stop()
            d.stop()


def test_late_prefill_done_is_awaited_for_the_timeline(cluster):
    cluster.prefill.prefill_delay_s = 0.4  # PrefillDone arrives after the decode has finished
    out = cluster.client.post(
        "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}}
    ).json()
    meta = out["meta_info"]
    # queue_time comes only from PrefillDone's events (forward_entry - queue_entry = 1 ms there).
    assert meta["queue_time"] == pytest.approx(0.001, abs=1e-6)
    _check_meta(meta, 2)


def test_stop_token_id_counted_but_not_shown(cluster, tokenizer):
    (period,) = tokenizer.encode(".")
    body = {"text": "a", "sampling_params": {"max_new_tokens": 64, "stop_token_ids": [period]}}
    out = cluster.client.post("/generate", json=body).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": period}
    assert out["output_ids"][-1] == period
    assert out["text"] == "The capital of France is Paris"


def test_request_larger_than_decode_pool_refused(tokenizer):
    from .conftest import WireWorker, control_addr, gateway_client

    with gateway_client(tokenizer) as c:
        addr = control_addr(c)
        ws = [
            WireWorker(addr, "p0", "prefill").start(),
            WireWorker(addr, "d0", "decode", max_total_tokens=256).start(),
        ]
        try:
            r = c.post("/generate", json={"input_ids": [5] * 200, "sampling_params": {"max_new_tokens": 100}})
            assert r.status_code == 400 and "KV capacity is 256" in r.json()["error"]["message"]
        finally:
            for w in ws:
                w.stop()


def test_decode_draining_before_first_token_is_retried_once_on_another_pair(cluster):
    cluster.decode.fail_code = "draining"
    d1 = cluster.add("d1", "decode")
    rooms_before = len(d1.requests())
    r = cluster.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    tried = cluster.decode.requests() + d1.requests()[rooms_before:]
    # One attempt on each decode worker, each under its own room id; the prefill saw both.
    assert len(cluster.decode.requests()) == 1 and len(d1.requests()) - rooms_before == 1
    assert len({q.room for q in tried}) == 2
    assert len(cluster.prefill.requests()) == 2
    assert "pdserve_request_retries_total 1.0" in cluster.client.get("/metrics").text


def test_a_second_lost_leg_is_an_error_not_another_retry(cluster):
    cluster.decode.fail_code = "draining"
    cluster.add("d1", "decode", fail_code="draining")
    r = cluster.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 503
    assert "draining" in r.json()["error"]["message"]
    assert len(cluster.prefill.requests()) == 2  # the first try and exactly one retry


def test_every_fail_code_has_its_http_status():
    assert set(FAIL_STATUS) == set(FailCode)
    assert FAIL_STATUS[FailCode.DEADLINE] == 504


def _queued_on(cluster, worker: str, n: int) -> None:
    """`worker` reports `n` queued requests in its heartbeats, and the gateway has heard it."""
    w = next(w for w in cluster.workers if w.worker_id == worker)
    w.link.load.queued = n
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        listed = {x["worker_id"]: x for x in cluster.client.get("/workers").json()["workers"]}
        if listed[worker]["queued"] == n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the gateway never heard {worker} report {n} queued")


def test_transfer_failed_behind_an_overloaded_prefill_is_not_retried_on_the_same_queue(cluster):
    # The decode gave up waiting for the KV (its --waiting-timeout) while the prompt was still queued on
    # the only prefill worker: another attempt there would only lengthen the queue.
    cluster.prefill.prefill_delay_s = 60  # no PrefillDone before the failure
    cluster.decode.fail_code = "transfer"
    d1 = cluster.add("d1", "decode")
    _queued_on(cluster, "p0", 7)
    r = cluster.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 503
    msg = r.json()["error"]["message"]
    assert "not retried: the prompt was still waiting on prefill worker p0, 7 requests queued there" in msg, (
        msg
    )
    assert d1.requests() == [] and len(cluster.prefill.requests()) == 1
    metrics = cluster.client.get("/metrics").text
    assert "pdserve_request_retries_withheld_total 1.0" in metrics
    assert "pdserve_request_retries_total 0.0" in metrics


def test_transfer_failed_behind_an_overloaded_prefill_is_retried_on_another_prefill(cluster):
    # Both pairs slow and failing, so that whichever pair routing picks first, the retry must go to
    # the other prefill worker (hard-avoided, not merely less preferred) and the other decode worker.
    cluster.decode.fail_code = "transfer"
    d1 = cluster.add("d1", "decode", fail_code="transfer")
    p1 = cluster.add("p1", "prefill")
    for p in (cluster.prefill, p1):
        p.prefill_delay_s = 60
        _queued_on(cluster, p.worker_id, 7)
    r = cluster.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 503 and "transfer" in r.json()["error"]["message"]
    assert len(cluster.prefill.requests()) == len(p1.requests()) == 1
    assert len(cluster.decode.requests()) == len(d1.requests()) == 1
    metrics = cluster.client.get("/metrics").text
    assert "pdserve_request_retries_total 1.0" in metrics
    assert "pdserve_request_retries_withheld_total 0.0" in metrics


def test_transfer_failed_with_the_prefill_idle_is_retried_on_the_same_prefill(cluster):
    # Nothing queued on the prefill worker but this request: the link, not the load, failed; the same
    # prefill may do.
    cluster.decode.fail_code = "transfer"
    cluster.prefill.prefill_delay_s = 60
    d1 = cluster.add("d1", "decode")
    _queued_on(cluster, "p0", 1)
    r = cluster.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    assert len(d1.requests()) == 1 and len(cluster.prefill.requests()) == 2
    assert "pdserve_request_retries_total 1.0" in cluster.client.get("/metrics").text
