"""Structured output through a real cluster (`pdserve up`, the bundled model), plain, with NGRAM
speculation, and with local prefill: the prefill node masks the first token (or the decode node,
when it computes the prompt itself), the decode node the rest (drafts included).

Greedy constrained output must equal the offline engine's token for token, and what the official
`openai` client and `instructor` get back must validate against the schema, streamed or not.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from harness import start_up
from reliability.calls import metric

pytestmark = pytest.mark.timeout(600)

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the served name of the bundled model

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "number"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe Paris as JSON."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


@pytest.fixture(
    scope="module",
    # A cluster start each; "local": every prompt is prefilled on the decode worker (conditional
    # disaggregation), whose first token is then masked there.
    params=[
        "plain",
        pytest.param("NGRAM", marks=pytest.mark.slow),
        pytest.param("local", marks=pytest.mark.slow),
    ],
)
def cluster(request, tmp_path_factory):
    extra = {
        "plain": [],
        "NGRAM": ["--speculative-algorithm", "NGRAM"],
        "local": ["--disaggregation-min-prefill-tokens", "100000"],
    }[request.param]
    c = start_up(tmp_path_factory.mktemp(f"structured-{request.param}"), extra=extra)
    try:
        c.wait_healthy()
        yield c
    finally:
        c.stop()


@pytest.fixture
def cluster_kind(request) -> str:
    return request.node.callspec.params["cluster"]


@pytest.fixture(scope="module")
def openai_client(cluster):
    import openai

    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", timeout=300)


def test_chat_json_schema_validates(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=RESPONSE_FORMAT, max_tokens=128, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_json_schema_streamed_validates(openai_client):
    stream = openai_client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format=RESPONSE_FORMAT,
        max_tokens=128,
        temperature=0.8,
        seed=3,
        stream=True,
    )
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop", (text, reasons)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_json_object_and_native_regex(cluster, openai_client):
    r = openai_client.completions.create(
        model=MODEL,
        prompt="A JSON object describing a cat:",
        max_tokens=96,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # the model may ramble past max_tokens; what it wrote is still an object's prefix
        assert r.choices[0].text.startswith("{")
    body = {
        "text": "The year the Berlin wall fell:",
        "sampling_params": {"max_new_tokens": 16, "temperature": 0, "regex": "(19|20)[0-9]{2}"},
    }
    out = httpx.post(f"{cluster.url}/generate", json=body, timeout=300).json()
    assert re.fullmatch(r"(19|20)[0-9]{2}", out["text"]), out
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_greedy_constrained_equals_offline_engine(cluster, cluster_kind, bundled, tokenizer):
    """Same tokens as the offline engine under the same grammar (float32, greedy): the masks on
    the prefill and decode nodes (and on verify rows with NGRAM) change nothing but the grammar."""
    from pdserve.config import RuntimeConfig
    from pdserve.runtime.engine import Engine
    from pdserve.sampling_params import SamplingParams

    prompt = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    sp = {"max_new_tokens": 96, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    engine = Engine(RuntimeConfig(device="cpu", max_total_tokens=2048, attention_backend="torch"), bundled)
    ref = engine.generate([ids], SamplingParams(**sp))[0]
    local_before = metric(cluster.url, "pdserve_local_prefill_requests_total")
    out = httpx.post(
        f"{cluster.url}/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=300
    ).json()
    assert out["output_ids"] == ref.output_ids
    local = metric(cluster.url, "pdserve_local_prefill_requests_total") - local_before
    assert local == (1 if cluster_kind == "local" else 0)
    jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_instructor_returns_validated_object(openai_client):
    import instructor
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=32)
        age: int = Field(ge=0, le=150)

    client = instructor.from_openai(openai_client, mode=instructor.Mode.JSON_SCHEMA)
    msgs = [{"role": "user", "content": "Extract: Ada Lovelace is 36 years old."}]
    p = client.chat.completions.create(
        model=MODEL, response_model=Person, messages=msgs, max_tokens=64, temperature=0, max_retries=0
    )
    assert isinstance(p, Person) and p.name
    partials = list(
        client.chat.completions.create_partial(
            model=MODEL, response_model=Person, messages=msgs, max_tokens=64, temperature=0
        )
    )
    final = Person.model_validate(partials[-1].model_dump())  # validates the streamed object
    assert final.model_dump() == p.model_dump()  # streamed and whole: the same greedy object


def test_langchain_with_structured_output(cluster):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """A person named in the text."""

        name: str = Field(max_length=32)
        age: int = Field(ge=0, le=150)

    llm = ChatOpenAI(model=MODEL, base_url=f"{cluster.url}/v1", api_key="none", temperature=0, max_tokens=64)
    structured = llm.with_structured_output(Person, method="json_schema")
    msg = "Extract: Alan Turing was 41 years old."
    p = structured.invoke(msg)
    assert isinstance(p, Person) and p.name
    streamed = list(structured.stream(msg))
    assert streamed and streamed[-1] == p  # streamed and whole: the same greedy object


def test_forced_tool_call_is_valid_under_every_cluster_kind(openai_client):
    """tool_choice names a function: the reply is constrained to its parameters (plain, NGRAM, local)."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}}]
    choice = {"type": "function", "function": {"name": "lookup"}}
    out = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=tools, tool_choice=choice, max_tokens=128, temperature=0
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "lookup" and out.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
