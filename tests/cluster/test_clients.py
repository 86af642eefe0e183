"""Real clients against `pdserve up` with the bundled model: SGLang's bench_serving request shapes, the
openai client and langchain-openai doing tool calls the model itself writes, and SGLang's endpoints.

The 135M model does not call tools from a description alone, but it follows a few examples in its
history: three earlier turns (question, call, result, answer) rendered through the system-prompt
fallback make it write a real `<tool_call>` for the fourth question, which the parser turns into
`tool_calls`. That drives the history rendering, the parser and the client's reassembly end to end.
"""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

pytestmark = pytest.mark.timeout(600)


def _few_shot(question: str) -> list[dict]:
    msgs: list[dict] = []
    for i, city in enumerate(["London", "Berlin", "Madrid"]):
        call = {
            "id": f"c{i}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
        }
        msgs += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "sunny"},
            {"role": "assistant", "content": f"It is sunny in {city}."},
        ]
    return [*msgs, {"role": "user", "content": question}]


def _sse(resp: httpx.Response) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


# The bodies bench_serving sends (python/sglang/bench_serving.py), output_len 8, ignore_eos on.
def _bench_payload(backend: str, prompt: str, stream: bool) -> tuple[str, dict]:
    if backend == "sglang":
        return "/generate", {
            "text": prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
            "stream": stream,
            "lora_path": None,
            "return_logprob": False,
            "logprob_start_len": -1,
        }
    if backend == "sglang-oai":
        return "/v1/completions", {
            "model": MODEL,
            "prompt": prompt,
            "temperature": 0.0,
            "best_of": 1,
            "max_tokens": 8,
            "stream": stream,
            "ignore_eos": True,
        }
    return "/v1/chat/completions", {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0.0,
        "max_completion_tokens": 8,
        "stream": stream,
        "ignore_eos": True,
    }


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_bench_serving_request_shapes(cluster, backend, stream):
    path, body = _bench_payload(backend, "The capital of France is", stream)
    with httpx.Client(base_url=cluster.url, timeout=300) as c:
        if not stream:
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            if backend == "sglang":
                text, n = out["text"], out["meta_info"]["completion_tokens"]
            elif backend == "sglang-oai":
                text, n = out["choices"][0]["text"], out["usage"]["completion_tokens"]
            else:
                text, n = out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]
        else:
            with c.stream("POST", path, json=body) as r:
                assert r.status_code == 200, r.read()
                chunks = _sse(r)
            # Read as bench_serving reads them.
            if backend == "sglang":
                text, n = chunks[-1]["text"], chunks[-1]["meta_info"]["completion_tokens"]
            elif backend == "sglang-oai":
                text, n = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]), 8
            else:
                text = "".join(
                    ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"]
                )
                n = 8
    assert n == 8 and text


def test_sglang_endpoints_on_a_real_cluster(cluster):
    with httpx.Client(base_url=cluster.url, timeout=120) as c:
        assert c.get("/health_generate").status_code == 200
        assert c.get("/get_model_info").json()["model_path"] == MODEL
        assert c.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
        info = c.get("/get_server_info").json()
        assert info["served_model_name"] == MODEL and len(info["internal_states"]) == 2
        r = c.put(
            "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        )
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def test_openai_client_named_tool_call_and_answer(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key="none", timeout=300, max_retries=0)
    msgs = _few_shot("What is the weather in Paris?")
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=60
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # Streamed, the same call reassembled from the chunks.
    args, name, finish = "", "", None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=60, stream=True
    ):
        for tc in chunk.choices[0].delta.tool_calls or []:
            name += tc.function.name or ""
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, json.loads(args), finish) == ("get_weather", {"city": "Paris"}, "tool_calls")
    # Second turn: the call and its result in the history, then the model's answer.
    msgs += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "rainy"},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, temperature=0, max_tokens=30
    )
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    assert "Paris" in final.choices[0].message.content


def test_langchain_bind_tools_round_trip(cluster):
    from langchain_core.messages import convert_to_messages
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city"""
        return f"cloudy in {city}"

    llm = ChatOpenAI(model=MODEL, base_url=cluster.url + "/v1", api_key="none", temperature=0, max_tokens=60)
    llm = llm.bind_tools([get_weather])
    history = convert_to_messages(_few_shot("What is the weather in Rome?"))
    ai = llm.invoke(history)
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"] and ai.tool_calls[0]["args"] == {
        "city": "Rome"
    }
    answer = llm.invoke([*history, ai, get_weather.invoke(ai.tool_calls[0])])
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_choice_is_a_valid_call_without_examples(cluster, choice):
    """No examples in the history: the 135M model alone does not write a call, but `required` and a named
    function constrain its reply to the tools' schemas (function_call/schema.py), so the reply is a call
    whose arguments follow the function's parameters, whole and streamed."""
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key="none", timeout=300, max_retries=0)
    msgs = [{"role": "user", "content": "What is the weather in Tokyo?"}]
    tc = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=tc, temperature=0, max_tokens=60)
    out = client.chat.completions.create(**kw)
    assert out.choices[0].finish_reason == "tool_calls", out.choices[0]
    calls = out.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    for c in calls:
        args = json.loads(c.function.arguments)
        assert set(args) == {"city"} and isinstance(args["city"], str), args
    name, args_text = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.index == 0:
                name += d.function.name or ""
                args_text += d.function.arguments or ""
    assert name == "get_weather" and json.loads(args_text) == json.loads(calls[0].function.arguments)
