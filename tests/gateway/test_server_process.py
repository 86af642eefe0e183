"""The gateway as its own process (`pdserve gateway`, uvicorn) driven by the openai client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from .conftest import WireWorker, text_script


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gateway_process():
    port, cport = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--control-host", "127.0.0.1", "--control-port", str(cport), "--served-model-name", "smol"]
    cmd += ["--heartbeat-interval", "0.1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{base}/v1/models", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None, "gateway exited"
                time.sleep(0.2)
        yield base, f"tcp://127.0.0.1:{cport}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


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
