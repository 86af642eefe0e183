"""The gateway as its own process (`pdserve gateway`, uvicorn) driven by the openai client."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from harness import start_gateway, stop_processes

from .conftest import WireWorker, text_script


@pytest.fixture
def gateway_process(tmp_path):
    flags = ["--served-model-name", "smol", "--heartbeat-interval", "0.1", "--log-level", "warning"]
    proc, port, cport = start_gateway(str(tmp_path), flags, env={"TOKENIZERS_PARALLELISM": "false"})
    try:
        yield f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{cport}"
    finally:
        stop_processes([proc], grace_s=10)


@pytest.mark.timeout(120)
def test_openai_client_and_disconnect(gateway_process, tokenizer):
    import openai

    base, addr = gateway_process
    reply = "Bonjour! Le café coûte 3 €."
    p = WireWorker(addr, "p0", "prefill").start()
    d = WireWorker(addr, "d0", "decode", script=text_script(tokenizer, reply)).start()
    try:
        assert httpx.get(f"{base}/health").status_code == 200
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        chat = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=50
        )
        assert chat.choices[0].message.content == reply and chat.model == "smol"
        stream = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        parts = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == reply
        assert parts[-1].usage.completion_tokens == len(tokenizer.encode(reply)) + 1
        comp = client.completions.create(model="smol", prompt="x", max_tokens=3)
        assert comp.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": "hi"}], temperature=-1
            )
        assert "temperature" in str(e.value)

        # A non-streaming client that gives up: both legs are aborted.
        d.step_s = 0.1
        d.script = text_script(tokenizer, " word" * 100)
        p.prefill_delay_s = 5.0
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{base}/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 90}}, timeout=0.5
            )
        room = d.requests()[-1].room
        deadline = time.monotonic() + 5
        while not (room in d.aborted and room in p.aborted) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert room in d.aborted and room in p.aborted
        assert httpx.get(f"{base}/health").status_code == 200
    finally:
        p.stop()
        d.stop()


@pytest.mark.timeout(60)
def test_keep_alive_responses_do_not_wait_for_the_clients_delayed_ack(gateway_process):
    """uvicorn writes a response's headers and body separately; with Nagle's algorithm on, the body of
    every response after a connection's first waited for the client's delayed ACK (>= 40 ms on Linux).
    The gateway turns it off on every connection: a keep-alive client gets `/v1/models` at once."""
    import socket
    import statistics

    base, _ = gateway_process
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        times = []
        for _ in range(7):
            t = time.perf_counter()
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while not (b"\r\n\r\n" in data and data.endswith(b"}")):
                chunk = s.recv(65536)
                assert chunk, "the gateway closed the connection"
                data += chunk
            times.append(time.perf_counter() - t)
            assert data.startswith(b"HTTP/1.1 200"), data[:100]
            time.sleep(0.02)
    assert statistics.median(times[1:]) < 0.03, times


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch_cpu" in f.read()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_the_gateway_holds_no_torch_until_a_constraint_needs_it(tmp_path):
    """transformers is imported without torch (gateway/text/tokenizer.py), about 150 MB less of the gateway's
    memory; tokenizing is unchanged, and the first structured-output request checks its constraint
    as ever (xgrammar imports torch itself then)."""
    proc, port, _ = start_gateway(str(tmp_path), ["--log-level", "warning"])
    base = f"http://127.0.0.1:{port}"
    try:
        assert not _maps_torch(proc.pid)
        body = {"text": "a", "sampling_params": {"max_new_tokens": 2, "regex": "(unclosed"}}
        r = httpx.post(f"{base}/generate", json=body, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "sampling_params.regex", r.text
        assert "parenthesis is not closed" in err["message"]
    finally:
        stop_processes([proc], grace_s=10)
