"""OpenAI-style error bodies and the handlers that turn every failure into one.

Every error the gateway answers has the shape
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}` (OpenAI's): `param` names the offending
field (dotted path) or is null; `code` is a short string such as "model_not_found" or null.
On the paths of Anthropic's Messages API (`is_anthropic_path`) every error, whoever raised it (a handler,
the key check in auth.py, the body and per-client limits, an unknown route), has Anthropic's shape
instead, `{"type": "error", "error": {"type": ..., "message": ...}}`: `error_body_for` picks the shape
by path, the one place that does.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pdserve.protocol.vocabulary import FailCode

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    413: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}

# The HTTP status a client gets for a generation that failed with each code.
FAIL_STATUS: dict[FailCode, int] = {
    FailCode.BAD_REQUEST: 400,
    FailCode.DEADLINE: 504,
    FailCode.DRAINING: 503,
    FailCode.TRANSFER: 503,
    FailCode.KV_CORRUPT: 503,
    FailCode.OOM: 503,
    # The worker's step raised for this request (it goes on): not run again elsewhere, and refused
    # before dispatch after two (`FailedRequests`).
    FailCode.INTERNAL: 500,
    FailCode.WORKER_LOST: 503,
    FailCode.SHUTDOWN: 503,
    FailCode.CLIENT_ABORT: 400,
    FailCode.ABORTED: 500,
}


class ApiError(Exception):
    """Raised anywhere in request handling; becomes an HTTP error with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model '{model}' does not exist", "model", code="model_not_found")


# Anthropic's error types by status (its clients pick their exception class by status; the type names
# the kind of error to a reader). 503 (the gateway at its limit, no worker left) is its "overloaded".
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    """A path of Anthropic's Messages API: `/v1/messages` and whatever is under it."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error shape; the offending field, which it has no slot for, leads the message."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_for(
    path: str, status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The error body of a request to `path`: Anthropic's shape on its paths, else OpenAI's."""
    if is_anthropic_path(path):
        return anthropic_error_body(status, message, param)
    return error_body(status, message, param, code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error"),
            "param": param,
            "code": code,
        }
    }


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "is-instance"}


def _loc_to_param(loc: tuple[int | str, ...]) -> str | None:
    # ("body", "text", "list[str]", 0) -> "text.0": union member tags are not field names.
    parts = [
        str(p)
        for p in loc
        if p != "body"
        # Union member tags: type names, generics, validators and model classes (capitalized).
        and not (
            isinstance(p, str)
            and (p in _TYPE_TAGS or "[" in p or p.startswith("function-") or p[:1].isupper())
        )
    ]
    return ".".join(parts) or None


def validation_error_to_api(err: ValidationError | RequestValidationError, prefix: str = "") -> ApiError:
    """The first pydantic error, named by its field path."""
    errors = err.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    param = _loc_to_param(tuple(first.get("loc", ())))
    if prefix:
        param = f"{prefix}.{param}" if param else prefix
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return bad_request(f"malformed JSON body: {msg}")
    if first.get("type") == "extra_forbidden":
        msg = f"unrecognized request argument supplied: {param}"
    elif param:
        msg = f"{param}: {msg}"
    # The alternatives of one union field fail together: one message is enough.
    others = [
        e
        for e in errors[1:]
        if _loc_to_param(tuple(e.get("loc", ()))) not in (_loc_to_param(tuple(first.get("loc", ()))),)
    ]
    if others:
        msg += f" (and {len(others)} more error(s))"
    return bad_request(msg, param)


# Text that cannot be UTF-8: a lone surrogate, as a JSON escape ("\udc00") or as a character (an
# undecodable byte, read with surrogateescape, becomes one).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF][0-9a-fA-F]{2}")
_SURROGATE_CHAR = re.compile("[\ud800-\udfff]")
_NOT_UTF8 = "not valid UTF-8 text (a lone surrogate or an undecodable byte)"


def _lone_surrogates(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _bad_text(body: Any) -> ApiError | None:
    """A 400 naming the first string (value or key) in `body` that is not valid UTF-8 text, by its
    dotted path (the text itself is not repeated: it cannot be encoded in the answer)."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, str):
            if _lone_surrogates(obj):
                return bad_request(f"{path}: {_NOT_UTF8}", path or None)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if _lone_surrogates(k):
                    return bad_request(f"{path or 'the body'}: a key is {_NOT_UTF8}", path or None)
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(obj, list):
            stack.extend((v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(obj))
    return None


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object whose every string is valid UTF-8 text (a
    lone surrogate or an undecodable byte is a 400 naming the field, before anything else sees it)."""
    if not raw:
        raise bad_request("request body is empty; expected a JSON object")
    text: str | None = None
    try:
        if json.detect_encoding(raw) == "utf-8":
            text = raw.decode("utf-8", "surrogateescape")  # an undecodable byte: found below, by field
            body = json.loads(text)
        else:  # UTF-16 or UTF-32, or a byte-order mark
            body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    except RecursionError:
        raise bad_request("JSON body nested too deeply") from None
    except ValueError as e:  # an integer beyond Python's digit limit
        raise bad_request(f"unreadable JSON body: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if text is None or _SURROGATE_ESCAPE.search(text) or _SURROGATE_CHAR.search(text):
        err = _bad_text(body)
        if err is not None:
            raise err
    return body


def error_response(path: str, e: ApiError) -> Response:
    """`e` as the answer to a request to `path` (its shape by path: `error_body_for`)."""
    body = error_body_for(path, e.status, e.message, e.param, e.code)
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def install_error_handlers(app: FastAPI) -> None:
    # Starlette calls each handler with the exception class it was registered for.
    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(request.url.path, exc)

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(request.url.path, validation_error_to_api(exc))

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        api = ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}) or None)
        return error_response(request.url.path, api)

    async def on_client_gone(request: Request, _: Exception) -> Response:
        # Nobody is left to read the answer; one line, not a traceback (a client may do it at will).
        client = request.client.host if request.client else "?"
        log.info(
            "%s %s: the client (%s) left before its request body was in",
            request.method,
            request.url.path,
            client,
        )
        return Response(status_code=499)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error in request handler")
        return error_response(request.url.path, ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(ClientDisconnect, on_client_gone)
    app.add_exception_handler(Exception, on_unexpected)
