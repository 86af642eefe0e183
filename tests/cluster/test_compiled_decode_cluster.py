"""`pdserve up --enable-torch-compile`: the decode worker compiles its step before it registers, then
serves the same greedy tokens as the eager offline engine (fp32) through /generate and the OpenAI client.

One request at a time (`--max-running-requests 1`) keeps the warm-up to one graph: compiling is slow on
a 2-core machine, and the batched graphs are checked against eager steps in
tests/runtime/test_compiled_decode.py.
"""

from __future__ import annotations

import glob
import os

import httpx
import pytest
from harness import start_up

pytestmark = pytest.mark.timeout(900)

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def compiled_cluster(tmp_path_factory):
    c = start_up(
        tmp_path_factory.mktemp("compiled"), extra=["--enable-torch-compile", "--max-running-requests", "1"]
    )
    try:
        c.wait_healthy(timeout_s=600, workers=2)
        yield c
    finally:
        c.stop()


def test_compiled_decode_serves_the_engines_greedy_tokens(compiled_cluster, engine_reference):
    from openai import OpenAI
    from transformers import AutoTokenizer

    from pdserve.model_source import resolve_model_source
    from pdserve.runtime.loader import model_folder

    tok = AutoTokenizer.from_pretrained(model_folder(resolve_model_source(None)))
    ids = [tok(t).input_ids for t in PROMPTS]
    want, _ = engine_reference(ids, 24)
    for p, w in zip(ids, want):
        r = httpx.post(
            compiled_cluster.url + "/generate",
            json={"input_ids": p, "sampling_params": {"max_new_tokens": 24, "temperature": 0}},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == w
    # The decode worker compiled before it registered, and no step fell back to eager.
    logs = "".join(open(f).read() for f in glob.glob(os.path.join(compiled_cluster.log_dir, "decode*.log")))
    assert "compiled decode step: batch sizes 1-1 warm" in logs
    assert "run eagerly" not in logs

    client = OpenAI(base_url=compiled_cluster.url + "/v1", api_key="none")
    chunks = client.completions.create(
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        prompt=PROMPTS[0],
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == tok.decode(want[0], skip_special_tokens=True)
