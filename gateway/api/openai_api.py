"""OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models (SGLang's shapes).

A request's body becomes its `Reply` (what its responses share) and its generations here; the whole
response is shaped by openai_reply.py, a stream by openai_stream.py. A chat choice's text goes through
`chat_output.ChatOutput` (reasoning parser, then tool-call parser); tools and the tool-call history
reach the prompt through function_call/prompt.py.
`model` must be the served name (or absent): another is a 404 `model_not_found`, as OpenAI answers.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pdserve.gateway.api.openai_reply import Reply, full_response
from pdserve.gateway.api.openai_stream import StreamEvent, chunk_objects, stream_chunks
from pdserve.gateway.api.serving import check_generations, serve_generation
from pdserve.gateway.api.state import GatewayState, gateway_state
from pdserve.gateway.errors import bad_request, model_not_found
from pdserve.gateway.generation.generation import GenInput, GenState
from pdserve.gateway.protocol import build_sampling, derive_seed, parse_body, with_seed
from pdserve.gateway.request_models import ChatCompletionBody, CompletionBody, NamedToolChoice
from pdserve.gateway.text.chat_output import ChatOutputSpec
from pdserve.gateway.text.function_call import tool_call_format
from pdserve.gateway.text.function_call.prompt import chat_messages
from pdserve.gateway.text.function_call.schema import tool_call_schema
from pdserve.gateway.text.reasoning import reasoning_format
from pdserve.gateway.text.tokenizer import Tokenizer
from pdserve.json_types import Json
from pdserve.sampling_params import SamplingParams

router = APIRouter()

# A parsed request: its reply, its generations, and whether it streams.
_Parsed = tuple[Reply, list[GenInput], bool]


def _model_card(gw: GatewayState) -> Json:
    limits = gw.registry.limits()
    return {
        "id": gw.model_name,
        "object": "model",
        "created": gw.started,
        "owned_by": "pdserve",
        "root": gw.model_name,
        "max_model_len": limits.context_length if limits else None,
    }


@router.get("/v1/models")
async def models(request: Request) -> Json:
    return {"object": "list", "data": [_model_card(gateway_state(request))]}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> Json:
    gw = gateway_state(request)
    if model_id != gw.model_name:
        raise model_not_found(model_id)
    return _model_card(gw)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, chat=True)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, chat=False)


async def _serve(request: Request, chat: bool) -> Response:
    gw = gateway_state(request)
    reply: Reply | None = None

    def parse(raw: dict[str, Any], received: float) -> tuple[list[GenInput], bool, str]:
        nonlocal reply
        if chat:
            reply, inputs, stream = _parse_chat(gw, raw, received)
            return inputs, stream, "messages"
        reply, inputs, stream = _parse_completion(gw, raw, received)
        return inputs, stream, "prompt"

    def full(states: list[GenState]) -> Json:
        assert reply is not None
        return full_response(gw.tokenizer, reply, states)

    def chunks(inputs: list[GenInput]) -> AsyncGenerator[bytes, None]:
        assert reply is not None
        return stream_chunks(gw.generations, gw.tokenizer, reply, inputs)

    return await serve_generation(request, gw.admission, gw.generations, parse, full, chunks)


async def serve_chat_as(
    request: Request,
    convert: Callable[[dict[str, Any]], dict[str, Any]],
    shape: Callable[[Json], Json],
    shape_stream: Callable[[AsyncGenerator[StreamEvent, None], list[GenInput]], AsyncGenerator[bytes, None]],
) -> Response:
    """Another API's request served as a chat completion: `convert` turns its body into a chat
    completions body (one choice), `shape` the chat.completion object into its answer, `shape_stream`
    the chunk objects (usage last) into its stream."""
    gw = gateway_state(request)
    reply: Reply | None = None

    def parse(raw: dict[str, Any], received: float) -> tuple[list[GenInput], bool, str]:
        nonlocal reply
        reply, inputs, stream = _parse_chat(gw, convert(raw), received)
        return inputs, stream, "messages"

    def full(states: list[GenState]) -> Json:
        assert reply is not None
        return shape(full_response(gw.tokenizer, reply, states))

    def chunks(inputs: list[GenInput]) -> AsyncGenerator[bytes, None]:
        assert reply is not None
        return shape_stream(chunk_objects(gw.generations, gw.tokenizer, reply, inputs), inputs)

    return await serve_generation(request, gw.admission, gw.generations, parse, full, chunks)


def _check_request(gw: GatewayState, body: ChatCompletionBody | CompletionBody, prompts: int) -> str:
    """The served model, the generations within the limit; the request's id."""
    if body.model is not None and body.model != gw.model_name:
        raise model_not_found(body.model)
    check_generations(prompts * body.n, gw.cfg.max_generations_per_request)
    return body.rid or uuid.uuid4().hex


def _include_usage(body: ChatCompletionBody | CompletionBody) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _parse_chat(gw: GatewayState, raw: dict[str, Any], received: float) -> _Parsed:
    body = parse_body(ChatCompletionBody, raw)
    rid = _check_request(gw, body, 1)
    prompt = chat_prompt_ids(gw.tokenizer, gw.cfg.tool_call_parser, body, gw.registry.context_length())
    max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    spec = _output_spec(gw, body)
    # The tool-call parser must see the format's marker token when that is a special token.
    marker_special = spec.tools is not None and gw.tokenizer.is_special(spec.tools.start)
    forced: str | NamedToolChoice | None = None
    if body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice):
        forced = body.tool_choice
    reply = Reply(
        rid,
        int(received),
        gw.model_name,
        True,
        body.n,
        body.logprobs,
        _include_usage(body),
        spec,
        forced,
        body.stream_reasoning,
        strict_metadata=gw.cfg.strict_openai_metadata,
    )
    sampling = build_sampling(
        body, max_new, body.logprobs, body.top_logprobs or 0, vocab_size=gw.tokenizer.vocab_size
    )
    sampling = gw.constraints.apply(sampling, body.response_format)  # structured output
    if forced is not None and sampling.constraint is None and gw.constraints.backend_name != "none":
        # tool_choice "required" or a named function: the reply is constrained to a call
        # (function_call/schema.py), so that even a small model answers with a valid one.
        schema = json.dumps(tool_call_schema(body.tools or [], forced, body.parallel_tool_calls))
        sampling = gw.constraints.apply(sampling.model_copy(update={"json_schema": schema}), prefix="tools")
    skip_special = body.skip_special_tokens and not marker_special
    inputs = _gen_inputs(reply, [prompt], sampling, max_new is not None, received, skip_special)
    return reply, inputs, body.stream


def _parse_completion(gw: GatewayState, raw: dict[str, Any], received: float) -> _Parsed:
    body = parse_body(CompletionBody, raw)
    single = isinstance(body.prompt, str) or _is_ids(body.prompt)
    rid = _check_request(gw, body, 1 if single else len(body.prompt))
    prompts = _completion_prompts(gw.tokenizer, body.prompt, gw.registry.context_length())
    logprobs = body.logprobs is not None
    echo = tuple(tuple(p) for p in prompts) if body.echo else ()
    reply = Reply(
        rid,
        int(received),
        gw.model_name,
        False,
        body.n,
        logprobs,
        _include_usage(body),
        echo=echo,
        strict_metadata=gw.cfg.strict_openai_metadata,
    )
    sampling = build_sampling(
        body, body.max_tokens, logprobs, body.logprobs or 0, vocab_size=gw.tokenizer.vocab_size
    )
    if reply.echo and logprobs:  # the prompt's own logprobs too (what lm-eval's loglikelihood reads)
        sampling = sampling.model_copy(update={"logprob_start_len": 0})
    sampling = gw.constraints.apply(sampling, body.response_format)  # structured output
    given = body.max_tokens is not None
    inputs = _gen_inputs(reply, prompts, sampling, given, received, body.skip_special_tokens)
    return reply, inputs, body.stream


def _gen_inputs(
    reply: Reply, prompts: list[list[int]], sp: SamplingParams, given: bool, received: float, skip: bool
) -> list[GenInput]:
    """`n` generations per prompt; with a seed, distinct but reproducible samples."""
    return [
        GenInput(
            f"{reply.id}-{i * reply.n + j}",
            list(p),
            with_seed(sp, derive_seed(sp.seed, j)),
            given,
            received,
            skip,
        )
        for i, p in enumerate(prompts)
        for j in range(reply.n)
    ]


# Arguments of apply_chat_template itself: a template variable must not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "add_generation_prompt", "tokenize", "chat_template"}
)


def _template_kwargs(body: ChatCompletionBody) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    bad = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(bad)}", "chat_template_kwargs")
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return kwargs


def chat_prompt_ids(
    tok: Tokenizer,
    parser: str | None,
    body: ChatCompletionBody,
    max_tokens: int | None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """A chat request's prompt: its messages and tools through the chat template, as token ids."""
    msgs, tools = chat_messages(body, tool_call_format(parser), tok.template_supports_tools)
    kwargs = _template_kwargs(body)
    try:
        text = tok.chat_prompt(msgs, tools, kwargs, add_generation_prompt)
    except Exception as e:  # jinja errors from the model's template (e.g. role order)
        raise bad_request(f"the chat template refused the messages: {e}", "messages") from None
    tok.check_chars(text, max_tokens, "messages")
    return tok.encode_rendered(text)


def _output_spec(gw: GatewayState, body: ChatCompletionBody) -> ChatOutputSpec:
    reasoning = None
    if body.separate_reasoning:
        reasoning = reasoning_format(gw.cfg.reasoning_parser, body.chat_template_kwargs)
    if not body.tools or body.tool_choice == "none":
        return ChatOutputSpec(reasoning=reasoning)
    names = [t.function.name for t in body.tools]
    if isinstance(body.tool_choice, NamedToolChoice):
        names = [body.tool_choice.function.name]
    return ChatOutputSpec(
        reasoning=reasoning,
        tools=tool_call_format(gw.cfg.tool_call_parser),
        tool_names=frozenset(names),
        parallel_tool_calls=body.parallel_tool_calls,
    )


def _is_ids(prompt: list[Any] | str) -> bool:
    """A completions prompt that is one list of token ids (not a batch)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)


def _completion_prompts(
    tok: Tokenizer, prompt: str | list[str] | list[int] | list[list[int]], max_tokens: int | None
) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt, max_tokens)] if prompt else [[]]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    if isinstance(prompt[0], str):
        return [tok.encode(p, max_tokens) if p else [] for p in prompt if isinstance(p, str)]
    if isinstance(prompt[0], int):
        return [[t for t in prompt if isinstance(t, int)]]
    return [list(p) for p in prompt if isinstance(p, list)]
