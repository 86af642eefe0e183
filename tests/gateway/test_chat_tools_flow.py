"""Tool calls and reasoning through the gateway, read by the real clients (openai, langchain-openai).

The workers speak the real wire protocol and decode a scripted reply, so the model's text is known:
the tests check what the clients make of it, whole and streamed (two tokens per step, so every
marker and JSON object arrives split across many chunks).
"""

from __future__ import annotations

import json

import pytest

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL_REPLY = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

pytestmark = pytest.mark.timeout(60)


def _openai(c):
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key="none", http_client=c.client, max_retries=0)


def test_openai_client_tool_call_whole(cluster):
    cluster.reply = CALL_REPLY
    out = _openai(cluster).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # The tools reached the prompt (the bundled template has no tool support: the system-prompt fallback).
    prompt = cluster.tokenizer.decode(cluster.prefill.requests()[-1].input_ids, skip_special_tokens=False)
    assert "# Tools" in prompt and '"name": "get_weather"' in prompt and "<tool_call>" in prompt


def test_openai_client_tool_call_streamed_and_reassembled(cluster):
    cluster.reply = CALL_REPLY
    stream = _openai(cluster).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, calls, finish, chunks = "", {}, None, 0
    for chunk in stream:
        chunks += 1
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert chunks > 5
    assert content == "Checking.\n" and finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    # A named function: the prompt says so, and the call comes back the same.
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = _openai(cluster).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice=named
    )
    assert json.loads(out.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    prompt = cluster.tokenizer.decode(cluster.prefill.requests()[-1].input_ids, skip_special_tokens=False)
    assert "You must call the function 'get_weather'." in prompt


def test_tool_choice_none_leaves_the_text_alone(cluster):
    cluster.reply = CALL_REPLY
    out = _openai(cluster).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="none"
    )
    assert out.choices[0].message.content == CALL_REPLY and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


def test_two_turn_history_renders_and_answers(cluster):
    cluster.reply = "It is sunny in Paris."
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_7",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21 C"},
    ]
    out = _openai(cluster).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert (
        out.choices[0].message.content == "It is sunny in Paris." and out.choices[0].finish_reason == "stop"
    )
    prompt = cluster.tokenizer.decode(cluster.prefill.requests()[-1].input_ids, skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


def test_langchain_bind_tools_round_trip(cluster):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(
        model=MODEL,
        base_url="http://testserver/v1",
        api_key="none",
        http_client=cluster.client,
        max_retries=0,
    ).bind_tools([get_weather])
    cluster.reply = CALL_REPLY
    ai = llm.invoke([HumanMessage("Weather in Paris?")])
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    assert ai.tool_calls[0]["args"] == {"city": "Paris"}
    result = get_weather.invoke(ai.tool_calls[0]["args"])
    cluster.reply = "It is sunny in Paris."
    final = llm.invoke(
        [HumanMessage("Weather in Paris?"), ai, ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"])]
    )
    assert final.content == "It is sunny in Paris." and not final.tool_calls
    prompt = cluster.tokenizer.decode(cluster.prefill.requests()[-1].input_ids, skip_special_tokens=False)
    assert "<tool_response>\nsunny in Paris\n</tool_response>" in prompt
    # Streamed: langchain reassembles the call from the chunks.
    cluster.reply = CALL_REPLY
    merged = None
    for chunk in llm.stream([HumanMessage("Weather in Paris?")]):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and merged.tool_calls[0]["args"] == {"city": "Paris"}


THINK_REPLY = "<think>\nThe user asks about Paris.\n</think>\n\nParis is sunny."


def test_reasoning_parser(wire_cluster, tokenizer):
    c = wire_cluster(reasoning_parser="qwen3")
    c.reply = THINK_REPLY
    client = _openai(c)
    msgs = [{"role": "user", "content": "Weather?"}]
    out = client.chat.completions.create(model=MODEL, messages=msgs)
    msg = out.choices[0].message
    assert msg.content == "Paris is sunny."
    assert msg.model_extra["reasoning_content"] == "\nThe user asks about Paris.\n"
    # The bundled tokenizer has no single </think> token: counted by decoding prefixes.
    want = next(k for k in range(1, 100) if "</think>" in tokenizer.decode(tokenizer.encode(THINK_REPLY)[:k]))
    assert out.usage.completion_tokens_details.reasoning_tokens == want
    # Streamed: reasoning in delta.reasoning_content, the answer in delta.content.
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(
        model=MODEL, messages=msgs, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage:
            assert chunk.usage.completion_tokens_details.reasoning_tokens == want
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            content += ch.delta.content or ""
    assert (reasoning, content) == ("\nThe user asks about Paris.\n", "Paris is sunny.")
    # separate_reasoning false, or thinking turned off in the template: all of it is content.
    for extra in ({"separate_reasoning": False}, {"chat_template_kwargs": {"enable_thinking": False}}):
        out = client.chat.completions.create(model=MODEL, messages=msgs, extra_body=extra)
        assert out.choices[0].message.content == THINK_REPLY
        assert out.usage.completion_tokens_details.reasoning_tokens == 0
    # The native API counts them in meta_info.
    meta = c.client.post("/generate", json={"text": "Weather?"}).json()["meta_info"]
    assert meta["reasoning_tokens"] == want


def test_llama3_parser_and_parallel_calls(wire_cluster):
    c = wire_cluster(tool_call_parser="llama3")
    c.reply = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'
    out = _openai(c).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOLS
    )
    calls = out.choices[0].message.tool_calls
    assert [json.loads(t.function.arguments)["city"] for t in calls] == ["Oslo", "Rome"]
    assert out.choices[0].message.content is None
    out = _openai(c).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOLS, parallel_tool_calls=False
    )
    assert len(out.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_constrained_json_reply_is_read_as_a_call(cluster, stream):
    """Under tool_choice required / named, a reply that is the JSON of function_call/schema.py (what a
    grammar backend makes the model write) is a call, streamed or not."""
    client = _openai(cluster)
    named = {"type": "function", "function": {"name": "get_weather"}}
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    for choice, reply in (
        (named, '{"city": "Lyon"}'),
        ("required", '[{"name": "get_weather", "parameters": {"city": "Lyon"}}]'),
    ):
        cluster.reply = reply
        if not stream:
            out = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice)
            m = out.choices[0].message
            calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls]
            content, finish = m.content, out.choices[0].finish_reason
        else:
            calls, content, finish = [], "", None
            for chunk in client.chat.completions.create(
                model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice, stream=True
            ):
                d = chunk.choices[0].delta
                content += d.content or ""
                calls += [(t.function.name, json.loads(t.function.arguments)) for t in d.tool_calls or []]
                finish = chunk.choices[0].finish_reason or finish
            content = content or None
        assert (calls, content, finish) == ([("get_weather", {"city": "Lyon"})], None, "tool_calls")
    # Under "auto" the same JSON is just text.
    out = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
    assert out.choices[0].message.content == cluster.reply and not out.choices[0].message.tool_calls
