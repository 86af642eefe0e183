"""Tools and tool-call history into the chat template's messages.

A template with tool support (it reads `tools`, as Qwen 2.5, Llama 3.1 and Mistral's do) gets the tools
and the history as transformers' `apply_chat_template(tools=...)` expects them: assistant messages with
`tool_calls` (arguments as objects) and `tool` messages with `tool_call_id`.

A template without (the bundled SmolLM2's) gets the documented fallback instead, in the format of the
server's tool-call parser so that the parser reads what the model was shown:
- the tools go into the system message (appended to the client's, or as a new first message):
  "# Tools", each function's JSON signature on one line, then how to call: an example call in the
  format (e.g. `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) and, for `tool_choice`
  "required" or a named function, that a call is mandatory;
- an assistant message's calls are written into its content in the same format;
- a tool result becomes a user message `<tool_response>\\n{content}\\n</tool_response>`.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.gateway.request_models import ChatCompletionBody, ChatMessage, NamedToolChoice, Tool
from pdserve.gateway.text.function_call.base import ToolCallFormat


def _arguments(raw: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return {"arguments": raw}  # kept visible rather than dropped
    return value if isinstance(value, dict) else {"arguments": value}


def tool_system_prompt(tools: list[Tool], fmt: ToolCallFormat, tool_choice: object) -> str:
    lines = [
        "# Tools",
        "",
        "You may call one or more functions to help with the user's request. The functions:",
    ]
    lines += [json.dumps(t.function.model_dump(exclude_none=True), ensure_ascii=False) for t in tools]
    lines += [
        "",
        "To call a function, reply with the call in this format, one per call:",
        fmt.render_call("function_name", {"argument_name": "value"}),
    ]
    if isinstance(tool_choice, NamedToolChoice):
        lines.append(f"You must call the function {tool_choice.function.name!r}.")
    elif tool_choice == "required":
        lines.append("You must call at least one function.")
    return "\n".join(lines)


def _message(m: ChatMessage, fmt: ToolCallFormat, template_tools: bool) -> dict[str, Any]:
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        d["name"] = m.name
    if m.role == "assistant" and m.tool_calls:
        calls = [(c.function.name, _arguments(c.function.arguments)) for c in m.tool_calls]
        if template_tools:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": n, "arguments": a}}
                for c, (n, a) in zip(m.tool_calls, calls)
            ]
        else:
            d["content"] = "\n".join(s for s in (d["content"], fmt.render_calls(calls)) if s)
    elif m.role in ("tool", "function"):
        if not template_tools:
            return {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
        d["role"] = "tool"
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
    return d


def chat_messages(
    body: ChatCompletionBody, fmt: ToolCallFormat, template_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template; tools is None when there are none to pass it."""
    msgs = [_message(m, fmt, template_tools) for m in body.messages]
    tools = body.tools if body.tools and body.tool_choice != "none" else None
    if tools is None:
        return msgs, None
    if template_tools:
        return msgs, [t.model_dump(exclude_none=True) for t in tools]
    text = tool_system_prompt(tools, fmt, body.tool_choice)
    if msgs and msgs[0]["role"] == "system":
        msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{text}"}
    else:
        msgs.insert(0, {"role": "system", "content": text})
    return msgs, None
