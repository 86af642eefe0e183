"""The gateway's OpenAPI document, with the request bodies the handlers validate themselves.

The handlers read raw JSON (to answer with OpenAI-style errors), so FastAPI cannot see their bodies;
this adds them from the same pydantic models, for clients and for schema-driven fuzzing.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pdserve.gateway.api.anthropic_api import MessagesBody
from pdserve.gateway.api.responses_models import ResponsesBody
from pdserve.gateway.api.tokenize_api import DetokenizeBody, TokenizeBody
from pdserve.gateway.request_models import ChatCompletionBody, CompletionBody, GenerateBody

_BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateBody,
    "/v1/chat/completions": ChatCompletionBody,
    "/v1/completions": CompletionBody,
    "/v1/messages": MessagesBody,
    "/v1/responses": ResponsesBody,
    "/tokenize": TokenizeBody,
    "/detokenize": DetokenizeBody,
}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            refs, defs = models_json_schema(
                [(m, "validation") for m in _BODIES.values()],
                ref_template="#/components/schemas/{model}",
            )
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            for path, model in _BODIES.items():
                op = doc["paths"][path]["post"]
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": refs[(model, "validation")]}},
                }
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
