"""Real clients of the other APIs against `pdserve up --api-key --admin-api-key` with the bundled model:
the openai client's Responses calls, the OpenAI Agents SDK, the anthropic client, LiteLLM, pydantic-ai,
lm-eval's remote tokenizer calls, and chat tool calls bounded by parallel_tool_calls.

The 135M model's free text is weak: forced tools and JSON schemas go through the grammar, which makes
their shape certain; free text is only checked for its structure.
"""

from __future__ import annotations

import asyncio
import json
import os
import warnings

import httpx
import pytest
from harness import start_up

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
KEY, OTHER_KEY = "sk-test-inference-3f9a", "sk-test-admin-77c1"
CITY = {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]}
WEATHER = {
    "type": "object",
    "properties": {"city": CITY},
    "required": ["city"],
    "additionalProperties": False,
}
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    }
]

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_up(
        tmp_path_factory.mktemp("api-clients"),
        extra=["--api-key", KEY, "--admin-api-key", OTHER_KEY, "--strict-openai-metadata"],
    )
    try:
        c.wait_healthy()
        yield c
    finally:
        c.stop()


def _openai(cluster, key: str = KEY, asynchronous: bool = False):
    from openai import AsyncOpenAI, OpenAI

    kind = AsyncOpenAI if asynchronous else OpenAI
    return kind(base_url=cluster.url + "/v1", api_key=key, timeout=300, max_retries=0)


def test_responses_create_stream_previous_get_delete(cluster):
    from openai import NotFoundError

    client = _openai(cluster)
    first = client.responses.create(
        model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert isinstance(first.output_text, str) and first.usage.input_tokens > 0
    second = client.responses.create(
        model=MODEL, input="Again.", previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    # The first turn's input and output come before the second's.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    with client.responses.stream(
        model=MODEL, input="Once more.", previous_response_id=second.id, max_output_tokens=8, temperature=0
    ) as stream:
        events = list(stream)
    # Cut by max_output_tokens, the stream ends as OpenAI's does: response.incomplete, not .completed.
    final = events[-1].response
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and final.usage.input_tokens > second.usage.input_tokens
    # Stored: read back by its key; another valid key finds nothing, nor does a deleted one.
    assert client.responses.retrieve(final.id).output_text == final.output_text
    other = _openai(cluster, OTHER_KEY)
    for call in (other.responses.retrieve, other.responses.delete):
        with pytest.raises(NotFoundError):
            call(first.id)
    with pytest.raises(NotFoundError):
        other.responses.create(model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=2)
    client.responses.delete(first.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_text_format_json_schema(cluster):
    schema = {
        "type": "object",
        "properties": {"city": CITY, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}}
    out = _openai(cluster).responses.create(
        model=MODEL, input="Weather in Paris as JSON.", text=fmt, max_output_tokens=40, temperature=0
    )
    value = json.loads(out.output_text)
    assert (
        set(value) == {"city", "sunny"} and value["city"] in CITY["enum"] and isinstance(value["sunny"], bool)
    )


def test_openai_agents_sdk_forced_function_tool(cluster):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    def agent() -> Agent:  # one per event loop: the async client's connections belong to its loop
        return Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            tools=[get_weather],
            model=OpenAIResponsesModel(model=MODEL, openai_client=_openai(cluster, asynchronous=True)),
            model_settings=ModelSettings(tool_choice="required", max_tokens=40, temperature=0),
            tool_use_behavior="stop_on_first_tool",
        )

    result = asyncio.run(Runner.run(agent(), "What is the weather in Paris?", max_turns=2))
    assert len(cities) == 1 and result.final_output == f"sunny in {cities[0]}"

    async def streamed() -> tuple[list[str], object]:
        run = Runner.run_streamed(agent(), "What is the weather in Rome?", max_turns=2)
        kinds = [getattr(ev, "name", ev.type) async for ev in run.stream_events()]
        return kinds, run.final_output

    kinds, final = asyncio.run(streamed())
    assert "tool_called" in kinds and "tool_output" in kinds, kinds
    assert len(cities) == 2 and final == f"sunny in {cities[1]}"


def test_anthropic_messages_tool_round_trip_forced_tool_and_stream(cluster):
    import anthropic

    client = anthropic.Anthropic(base_url=cluster.url, api_key=KEY, timeout=300, max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
    msgs: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    # (This client version no longer takes `temperature`; the forced calls are grammar-bound anyway.)
    kw = dict(model=MODEL, max_tokens=40, tools=tools)
    m = client.messages.create(**kw, messages=msgs, tool_choice={"type": "tool", "name": "get_weather"})
    assert m.type == "message" and m.stop_reason == "tool_use" and m.usage.input_tokens > 0
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in CITY["enum"]
    msgs += [
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rainy"}]},
    ]
    answer = client.messages.create(
        **{**kw, "max_tokens": 12}, messages=msgs, system=[{"type": "text", "text": "Be brief."}]
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.usage.output_tokens > 0
    # Streamed: a forced call ("any") arrives as a tool_use block with its input JSON.
    # one call (parallel calls allowed, a small model may repeat calls until max_tokens)
    one_call = {"type": "any", "disable_parallel_tool_use": True}
    with client.messages.stream(**kw, messages=msgs[:1], tool_choice=one_call) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert {"content_block_start", "content_block_stop", "message_delta"} <= set(kinds), kinds
    assert final.stop_reason == "tool_use" and final.content[-1].input["city"] in CITY["enum"]
    with client.messages.stream(model=MODEL, max_tokens=8, messages=msgs[:1], stop_sequences=["\n\n"]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert (
        text == "".join(b.text for b in final.content if b.type == "text") and final.usage.output_tokens > 0
    )


def test_anthropic_errors_have_anthropic_shape(cluster):
    import anthropic

    r = httpx.post(
        cluster.url + "/v1/messages",
        headers={"x-api-key": KEY},
        json={"model": MODEL, "messages": []},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    client = anthropic.Anthropic(base_url=cluster.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [{"type": "image"}]}]
        )
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=cluster.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    assert e.value.body["error"]["type"] == "authentication_error", e.value.body
    # An earlier turn's thinking is taken (the template drops it) but counts toward the length cap:
    # 1 MB of it is refused, not dropped unseen.
    for size, ok in ((200, True), (1 << 20, False)):
        turns = [
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm " * (size // 3), "signature": ""},
                    {"type": "text", "text": "Hello!"},
                ],
            },
            {"role": "user", "content": "Say it again."},
        ]
        if ok:
            assert client.messages.create(model=MODEL, max_tokens=4, messages=turns).usage.output_tokens > 0
            continue
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=MODEL, max_tokens=4, messages=turns)
        assert "thinking blocks included" in e.value.body["error"]["message"], e.value.body


def test_litellm_and_openai_dump_without_serializer_warnings(cluster):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list
    import litellm

    msgs = [{"role": "user", "content": "Hi"}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = litellm.completion(
            model=f"openai/{MODEL}", api_base=cluster.url + "/v1", api_key=KEY, messages=msgs, max_tokens=4
        )
        out.model_dump()
        chat = _openai(cluster).chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
        chat.model_dump()
    assert out.choices[0].message.content is not None
    assert chat.metadata == {"weight_version": "default"}
    bad = [str(w.message) for w in caught if "serializ" in str(w.message).lower()]
    assert not bad, bad


def test_pydantic_ai_structured_output(cluster):
    from typing import Literal

    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Capital(BaseModel):
        city: Literal["Paris", "Rome", "Tokyo"]
        country: Literal["France", "Italy", "Japan"]

    provider = OpenAIProvider(base_url=cluster.url + "/v1", api_key=KEY)
    agent = Agent(OpenAIChatModel(MODEL, provider=provider), output_type=Capital)
    result = agent.run_sync("The capital of France?", model_settings={"max_tokens": 60, "temperature": 0})
    assert isinstance(result.output, Capital)


def test_parallel_tool_calls_false_is_one_call_and_a_cut_keeps_complete_calls(cluster):
    client = _openai(cluster)
    msgs = [{"role": "user", "content": "Weather in Paris, Rome and Tokyo?"}]
    kw = dict(model=MODEL, messages=msgs, tools=CHAT_TOOLS, tool_choice="required", temperature=0)
    one = client.chat.completions.create(**kw, parallel_tool_calls=False, max_tokens=100).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1, one
    cut = client.chat.completions.create(**kw, max_tokens=40).choices[0]
    assert cut.message.tool_calls, cut  # the complete calls before the cut, if it was cut
    assert cut.message.content is None and all(
        json.loads(c.function.arguments)["city"] in CITY["enum"] for c in cut.message.tool_calls
    )


def test_lm_eval_remote_tokenizer_calls_and_keys_stay_out_of_logs(cluster):
    """The HTTP calls lm-eval's RemoteTokenizer (tokenizer_backend=remote) makes, with its bearer key."""
    from pdserve.gateway.text.tokenizer import Tokenizer

    tok = Tokenizer.load(None)
    with httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        info = c.get("/tokenizer_info").json()
        assert info["eos_token"] == tok.hf.eos_token and info["chat_template"] == tok.hf.chat_template
        ids = c.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
        assert (
            ids["tokens"] == tok.hf.encode("Hello world", add_special_tokens=False) and ids["max_model_len"]
        )
        assert c.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "Hello world"
        chat = c.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        assert chat["tokens"] == tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert httpx.post(cluster.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    for name in os.listdir(cluster.log_dir):
        path = os.path.join(cluster.log_dir, name)
        if os.path.isfile(path):
            text = open(path, errors="replace").read()
            assert KEY not in text and OTHER_KEY not in text, name
