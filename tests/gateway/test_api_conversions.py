"""Messages and Responses requests as the chat completions bodies they run as, and their 4xx."""

from __future__ import annotations

import pytest

from pdserve.gateway.api.anthropic_api import to_chat
from pdserve.gateway.api.responses_api import _Turn
from pdserve.gateway.api.responses_store import ResponseStore
from pdserve.gateway.errors import ApiError
from pdserve.gateway.request_models import ChatCompletionBody

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_messages_request_as_chat():
    chat = to_chat(
        {
            "model": "m",
            "max_tokens": 9,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "A"}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "rainy"}],
                },
            ],
            "tools": [{"name": "w", "input_schema": SCHEMA}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "top_k": 5,
        }
    )
    body = ChatCompletionBody.model_validate(chat)
    assert [m.role for m in body.messages] == ["system", "user", "assistant", "tool"]
    assert body.messages[2].tool_calls[0].function.arguments == '{"city": "A"}'
    assert body.messages[3].tool_call_id == "t1" and body.messages[3].text() == "rainy"
    assert body.tool_choice == "required" and body.parallel_tool_calls is False
    assert body.tools[0].function.parameters == SCHEMA and body.stop == ["END"] and body.top_k == 5


@pytest.mark.parametrize(
    "raw",
    [
        {"messages": [{"role": "user", "content": "x"}]},  # no max_tokens
        {"max_tokens": 4, "messages": []},
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}},
        {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "temperature": 3},
    ],
)
def test_bad_messages_requests_are_400(raw):
    with pytest.raises(ApiError) as e:
        to_chat(raw)
    assert e.value.status == 400


def test_responses_request_as_chat_with_its_previous_turn():
    store = ResponseStore()
    store.put(
        "resp_1", "open", {}, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    )
    turn = _Turn(store, "open")
    chat = turn.to_chat(
        {
            "input": [
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"role": "user", "content": [{"type": "input_text", "text": "And?"}]},
            ],
            "instructions": "Be brief.",
            "previous_response_id": "resp_1",
            "tools": [{"type": "function", "name": "w", "parameters": SCHEMA}],
            "tool_choice": {"type": "function", "name": "w"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}},
            "max_output_tokens": 7,
        }
    )
    body = ChatCompletionBody.model_validate(chat)
    assert [m.role for m in body.messages] == ["system", "user", "assistant", "assistant", "tool", "user"]
    assert body.tool_choice.function.name == "w" and body.max_completion_tokens == 7
    assert body.response_format == {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    # Another owner does not find the previous turn.
    with pytest.raises(ApiError) as e:
        _Turn(store, "someone-else").to_chat({"input": "x", "previous_response_id": "resp_1"})
    assert e.value.status == 404


@pytest.mark.parametrize(
    "raw",
    [
        {},
        {"input": [{"type": "item_reference", "id": "x"}]},
        {"input": "x", "tools": [{"type": "web_search", "name": "s"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
        {"input": "x", "tool_choice": {"type": "allowed_tools"}},
    ],
)
def test_bad_responses_requests_are_400(raw):
    with pytest.raises(ApiError) as e:
        _Turn(ResponseStore(), "open").to_chat(raw)
    assert e.value.status == 400


def test_earlier_thinking_is_taken_and_counted_toward_the_length_cap():
    thought = {"type": "thinking", "thinking": "t" * 1000, "signature": ""}
    raw = {
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [thought, {"type": "text", "text": "ok"}]},
            {"role": "user", "content": "more"},
        ],
    }
    assert to_chat(raw, max_chars=2000)["messages"][1]["reasoning_content"] == "t" * 1000
    with pytest.raises(ApiError) as e:  # the rest of the prompt fits; with the thinking it does not
        to_chat(raw, max_chars=900)
    assert e.value.status == 400 and "thinking" in e.value.message and e.value.param == "messages"
