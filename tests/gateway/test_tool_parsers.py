"""Tool-call and reasoning parsers on recorded model outputs: whole, and streamed in many chunks.

The outputs are what the model families write (Qwen 2.5 / Hermes, Llama 3.1, Mistral, DeepSeek-R1, Qwen3).
A streamed parse must give the same content and calls as the whole parse, however the text is cut.
"""

from __future__ import annotations

import json
import random

import pytest

from pdserve.gateway.request_models import ChatCompletionBody, NamedToolChoice, Tool
from pdserve.gateway.text.chat_output import ChatOutput, ChatOutputSpec
from pdserve.gateway.text.function_call import PARSER_NAMES, tool_call_format
from pdserve.gateway.text.function_call.prompt import chat_messages, tool_system_prompt
from pdserve.gateway.text.function_call.schema import calls_from_constrained, tool_call_schema
from pdserve.gateway.text.function_call.stream import ToolCallStream, parse_tool_calls
from pdserve.gateway.text.reasoning import REASONING_PARSERS, ReasoningStream, reasoning_format

NAMES = {"get_weather", "get_time"}

# (parser, recorded output, expected content, expected [(name, arguments)])
RECORDED = [
    (
        "qwen25",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        "</tool_call>",
        "Let me check.\n",
        [("get_weather", {"city": "Paris", "unit": "c"})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Tōkyō"}), ("get_time", {"tz": "Asia/Tokyo"})],
    ),
    # The model stopped (EOS) before writing the closing tag: the whole JSON still counts at the end.
    ("qwen", '<tool_call>\n{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {"tz": "CET"}}',
        "",
        [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
        '{"name": "get_time", "arguments": {"tz": "CET"}}]',
        "",
        [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "CET"})],
    ),
    # No call at all: everything is content (a JSON-looking answer without a marker too, for hermes).
    ("hermes", 'The weather is fine. {"not": "a call"}', 'The weather is fine. {"not": "a call"}', []),
    ("llama3", "Paris is the capital of France.", "Paris is the capital of France.", []),
    # A broken call is not a call: the text comes back as content.
    ("hermes", "Sure <tool_call> {not json", "Sure <tool_call> {not json", []),
    ("mistral", "[TOOL_CALLS] [{", "[TOOL_CALLS] [{", []),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(parser: str, text: str, cuts: list[int]) -> tuple[str, list]:
    s = ToolCallStream(tool_call_format(parser), NAMES)
    content, calls, last = "", [], 0
    for cut in [*cuts, len(text)]:
        c, k = s.feed(text[last:cut])
        content, calls, last = content + c, calls + k, cut
    c, k = s.finish()
    return content + c, calls + k


@pytest.mark.parametrize("parser,text,content,calls", RECORDED)
def test_whole_output(parser, text, content, calls):
    got_content, got_calls = parse_tool_calls(tool_call_format(parser), text, NAMES)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert all(c.id.startswith("call_") for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("parser,text,content,calls", RECORDED)
def test_streamed_char_by_char_and_random_chunks(parser, text, content, calls):
    got_content, got_calls = _streamed(parser, text, list(range(1, len(text))))
    assert (got_content, _calls(got_calls)) == (content, calls)
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        got_content, got_calls = _streamed(parser, text, cuts)
        assert (got_content, _calls(got_calls)) == (content, calls), cuts


def test_no_marker_text_streams_without_waiting_for_the_end():
    s = ToolCallStream(tool_call_format("hermes"), NAMES)
    assert s.feed("Hello there, ") == ("Hello there, ", [])
    # A tail that may open a call is held back until it is known not to.
    assert s.feed("<tool") == ("", [])
    assert s.feed("box>") == ("<toolbox>", [])


def test_a_call_is_released_as_soon_as_it_is_complete():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_wea'
    s = ToolCallStream(tool_call_format("hermes"), NAMES)
    content, calls = s.feed(text)
    assert content == "" and _calls(calls) == [("get_time", {})]


def test_unknown_function_and_parallel_off():
    text = (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "X"}}</tool_call>'
    )
    _, calls = parse_tool_calls(tool_call_format("hermes"), text, NAMES)
    assert _calls(calls) == [("get_time", {}), ("get_weather", {"city": "X"})]
    _, calls = parse_tool_calls(tool_call_format("hermes"), text, NAMES, parallel=False)
    assert _calls(calls) == [("get_time", {})]


def test_arguments_written_as_a_json_string_are_read():
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    _, calls = parse_tool_calls(tool_call_format("hermes"), text, NAMES)
    assert _calls(calls) == [("get_time", {"tz": "UTC"})]


@pytest.mark.parametrize("parser", PARSER_NAMES)
def test_rendered_calls_parse_back(parser):
    fmt = tool_call_format(parser)
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    _, parsed = parse_tool_calls(fmt, fmt.render_calls(calls), NAMES)
    assert _calls(parsed) == calls


# ---- reasoning ------------------------------------------------------------------------------------

REASONING = [
    ("qwen3", "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "\nThe user wants 2+2.\n", "It is 4."),
    ("qwen3", "It is 4.", "", "It is 4."),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    # DeepSeek-R1's template opens the block: the output starts inside it.
    ("deepseek-r1", "Let me add.</think>\n\nIt is 4.", "Let me add.", "It is 4."),
    ("deepseek-r1", "<think>Let me add.</think>It is 4.", "Let me add.", "It is 4."),
    # Out of tokens while thinking: all reasoning.
    ("deepseek-r1", "Still thinking about", "Still thinking about", ""),
    ("qwen3", "<think>Still thinking", "Still thinking", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING)
def test_reasoning_whole_and_streamed(name, text, reasoning, content):
    fmt = REASONING_PARSERS[name]
    assert fmt.split(text) == (reasoning, content)
    for step in (1, 2, 3, 5):
        s = ReasoningStream(fmt)
        r, c = "", ""
        for i in range(0, len(text), step):
            dr, dc = s.feed(text[i : i + step])
            r, c = r + dr, c + dc
        dr, dc = s.finish()
        assert (r + dr, c + dc) == (reasoning, content), step


def test_enable_thinking_false_turns_the_parser_off():
    assert reasoning_format("qwen3", {"enable_thinking": False}) is None
    assert reasoning_format("qwen3", {"enable_thinking": True}) is REASONING_PARSERS["qwen3"]
    assert reasoning_format(None, None) is None


def test_reasoning_then_tool_call_streamed():
    text = '<think>I need the weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    spec = ChatOutputSpec(REASONING_PARSERS["qwen3"], tool_call_format("qwen25"), frozenset(NAMES))
    whole = ChatOutput(spec).whole(text)
    assert whole.reasoning == "I need the weather." and whole.content == ""
    assert _calls(whole.calls) == [("get_weather", {"city": "Oslo"})]
    out = ChatOutput(spec)
    deltas = [out.feed(ch) for ch in text] + [out.finish()]
    assert "".join(d.reasoning for d in deltas) == whole.reasoning
    assert "".join(d.content for d in deltas) == ""
    assert _calls([c for d in deltas for c in d.calls]) == _calls(whole.calls)


# ---- prompts and the constraint schema ----------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_history_for_a_template_with_tool_support():
    body = ChatCompletionBody.model_validate({"messages": HISTORY, "tools": TOOLS})
    msgs, tools = chat_messages(body, tool_call_format("hermes"), template_tools=True)
    assert tools == [Tool.model_validate(t).model_dump(exclude_none=True) for t in TOOLS]
    assert msgs[2]["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
    ]
    assert msgs[3] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}


def test_history_fallback_for_a_template_without_tools():
    body = ChatCompletionBody.model_validate({"messages": HISTORY, "tools": TOOLS, "tool_choice": "required"})
    fmt = tool_call_format("hermes")
    msgs, tools = chat_messages(body, fmt, template_tools=False)
    assert tools is None
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.\n\n# Tools")
    assert "You must call at least one function." in msgs[0]["content"]
    assert '"name": "get_weather"' in msgs[0]["content"]
    _, calls = parse_tool_calls(fmt, msgs[2]["content"], NAMES)
    assert _calls(calls) == [("get_weather", {"city": "Paris"})]
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    # tool_choice none: the tools stay out of the prompt.
    body = ChatCompletionBody.model_validate({"messages": HISTORY[:2], "tools": TOOLS, "tool_choice": "none"})
    msgs, tools = chat_messages(body, fmt, template_tools=False)
    assert tools is None and "# Tools" not in msgs[0]["content"]


def test_named_choice_prompt_and_schema():
    tools = [Tool.model_validate(t) for t in TOOLS]
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    assert "You must call the function 'get_weather'." in tool_system_prompt(
        tools, tool_call_format(None), named
    )
    assert tool_call_schema(tools, named) == TOOLS[0]["function"]["parameters"]
    schema = tool_call_schema(tools, "required")
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]] == [
        ["get_weather"],
        ["get_time"],
    ]
    with pytest.raises(ValueError):
        tool_call_schema(tools, "auto")
    # Replies that follow the schema read back as calls.
    assert _calls(calls_from_constrained('{"city": "Lyon"}', named)) == [("get_weather", {"city": "Lyon"})]
    reply = '[{"name": "get_time", "parameters": {}}]'
    assert _calls(calls_from_constrained(reply, "required")) == [("get_time", {})]
    assert calls_from_constrained("not json", "required") == []


def test_parallel_tool_calls_false_bounds_the_forced_array_to_one_call():
    tools = [Tool.model_validate(t) for t in TOOLS]
    assert "maxItems" not in tool_call_schema(tools, "required")
    assert tool_call_schema(tools, "required", parallel=False)["maxItems"] == 1
    two = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "A"}}]'
    assert _calls(calls_from_constrained(two, "required", parallel=False)) == [("get_time", {})]


def test_a_forced_array_cut_short_keeps_its_complete_calls():
    cut = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Pa'
    assert _calls(calls_from_constrained(cut, "required")) == [("get_time", {})]
    two = '[{"name": "get_time", "parameters": {}} , {"name": "get_time", "parameters": {}},'
    assert len(calls_from_constrained(two, "required")) == 2
    assert calls_from_constrained('[{"name": "get_ti', "required") == []
    assert calls_from_constrained('x [{"name": "get_time", "parameters": {}}', "required") == []
