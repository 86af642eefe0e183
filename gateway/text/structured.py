"""Structured output at the gateway: every way a request can ask for it becomes one constraint on
`SamplingParams` (json_schema / regex / ebnf), compiled here once before any worker sees it.

- OpenAI `response_format`, chat and completions: `{"type": "text"}` (none), `{"type": "json_object"}`
  (any JSON object: the schema `{"type": "object"}`), `{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}`. The schema is always enforced, whatever `strict` says.
- SGLang's native `sampling_params.json_schema` (the schema's JSON text), `regex`, `ebnf`; the OpenAI
  endpoints take `regex` and `ebnf` at the top level as SGLang does.

The constraint is compiled with the workers' compiler (runtime/grammar/) over the gateway's tokenizer,
so an invalid schema, regex or grammar is an HTTP 400 naming the field and the compiler's complaint
instead of a failure on a worker. Verdicts are cached by text, so a repeated schema is a lookup.

`apply` blocks its caller while a grammar compiles, so it runs off the event loop: a body that names a
constraint is always parsed on a thread (request_body.py `parse_inline`). The compile runs in a child
process (runtime/grammar/checker.py, two at most), killed at --grammar-compile-timeout: the request is
then a 400 naming the flag, and nothing of that compile goes on (in a thread it ran on for minutes,
holding a core and hundreds of MB). The checker is built at the first constrained request (the
tokenizer's vocabulary for xgrammar, a few hundred ms; each child starts in about a second, once).
"""

from __future__ import annotations

import json
import threading
from typing import Any

from pdserve.config import GRAMMAR_COMPILE_TIMEOUT_S
from pdserve.gateway.errors import bad_request
from pdserve.gateway.text.tokenizer import Tokenizer
from pdserve.sampling_params import SamplingParams

ANY_JSON_OBJECT = '{"type": "object"}'


def response_format_schema(rf: dict[str, Any] | None) -> str | None:
    """The JSON schema text `response_format` asks for; None for text. Raises a 400 ApiError."""
    if rf is None:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind != "json_schema":
        raise bad_request(
            f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
            "response_format.type",
        )
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format json_schema needs a 'json_schema' object", "response_format")
    schema = spec.get("schema", spec.get("schema_"))
    if schema is None:
        return ANY_JSON_OBJECT
    if not isinstance(schema, dict):
        raise bad_request("the schema must be a JSON object", "response_format.json_schema.schema")
    return json.dumps(schema)


class Constraints:
    """Validates constraints by compiling them (--grammar-backend); built once per gateway."""

    def __init__(
        self, backend: str, tokenizer: Tokenizer, compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S
    ):
        if compile_timeout_s <= 0:
            raise ValueError("--grammar-compile-timeout must be > 0")
        self.backend_name = backend
        self.tokenizer = tokenizer
        self.compile_timeout_s = compile_timeout_s
        self._checker: Any = None  # runtime.grammar.checker.GrammarChecker, built at first use
        self._lock = threading.Lock()

    def checker(self) -> Any:
        with self._lock:
            if self._checker is None:
                from pdserve.runtime.grammar.backend import tokenizer_info
                from pdserve.runtime.grammar.checker import GrammarChecker

                tok = self.tokenizer
                info = tokenizer_info(tok.hf, tok.vocab_size, [tok.eos_token_id or 0])
                self._checker = GrammarChecker(info.serialize_json(), self.compile_timeout_s)
            return self._checker

    def close(self) -> None:
        """Stop the checker's children."""
        with self._lock:
            if self._checker is not None:
                self._checker.close()

    def apply(
        self, sp: SamplingParams, response_format: dict[str, Any] | None = None, prefix: str = ""
    ) -> SamplingParams:
        """`sp` with the response_format's schema set, after checking that its constraint compiles."""
        schema = response_format_schema(response_format)
        if schema is not None:
            if sp.constraint is not None:
                raise bad_request(
                    f"response_format cannot be combined with {sp.constraint[0]}", "response_format"
                )
            sp = sp.model_copy(update={"json_schema": schema})
        constraint = sp.constraint
        if constraint is None:
            return sp
        kind, text = constraint
        param = "response_format" if schema is not None else f"{prefix}.{kind}" if prefix else kind
        if self.backend_name == "none":
            raise bad_request("structured output is off on this server (--grammar-backend none)", param)
        from pdserve.runtime.grammar.backend import InvalidGrammar

        try:
            self.checker().check(kind, text)  # waits at most --grammar-compile-timeout
        except InvalidGrammar as e:  # CompileTimeout included: its message names the flag
            raise bad_request(str(e), param) from None
        return sp
