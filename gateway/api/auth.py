"""HTTP API keys, as SGLang and vLLM take them: `Authorization: Bearer <key>`.

Three kinds of path:
- inference (every path not listed below: `/generate`, `/v1/*`, SGLang's info endpoints, the docs):
  the API key (`--api-key`, else PDSERVE_API_KEY) or the admin key;
- operational (`ADMIN_PATHS`: `/workers` and what is under it (`POST /workers/{id}/role`), `/flush_cache`, `/abort_request`, the weight endpoints of
  gateway/api/weights_api.py, and the timeline page `/dashboard` with its `/dashboard/data`): the admin key
  (`--admin-api-key`, else PDSERVE_ADMIN_API_KEY); with no admin key, the API key. A browser cannot send
  a bearer token when it opens a page, so the dashboard's paths also take the key as HTTP Basic's
  password (any user name): their 401 asks for it (`WWW-Authenticate: Basic`), and the page's own
  requests then carry it;
- `/health` and `/metrics`: open, unless `--protect-health` / `--protect-metrics` put them under the
  API key (Kubernetes probes and Prometheus scrapers usually carry none).
Anthropic's clients send the key as `x-api-key: <key>`: taken wherever a bearer token is.
No key configured: that kind of path is open. A refusal is a 401 with OpenAI's body (`invalid_api_key`),
or Anthropic's (`authentication_error`) on its Messages paths (errors.error_body_for);
keys are compared in constant time (hmac.compare_digest) and never logged. A plain ASGI middleware, so
streamed responses pass through untouched.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
from dataclasses import dataclass
from typing import Any

from pdserve.gateway.errors import error_body_for, is_anthropic_path

DASHBOARD_PATHS = frozenset({"/dashboard", "/dashboard/data"})
ADMIN_PATHS = (
    frozenset(
        {
            "/workers",
            "/flush_cache",
            "/abort_request",
            "/update_weights_from_disk",
            "/init_weights_update_group",
            "/update_weights_from_distributed",
            "/destroy_weights_update_group",
            "/get_weight_version",
            "/pause_generation",
            "/continue_generation",
        }
    )
    | DASHBOARD_PATHS
)
OPEN_PATHS = frozenset({"/health", "/metrics"})


@dataclass(frozen=True)
class ApiKeys:
    api_key: str | None = None
    admin_api_key: str | None = None
    protect_health: bool = False
    protect_metrics: bool = False

    def required(self, path: str) -> tuple[str, ...]:
        """The keys any one of which opens `path` (empty: open)."""
        if path in OPEN_PATHS:
            protected = self.protect_health if path == "/health" else self.protect_metrics
            if not protected:
                return ()
        if is_admin_path(path):
            key = self.admin_api_key or self.api_key
            return (key,) if key else ()
        return tuple(k for k in (self.api_key, self.admin_api_key) if k) if self.api_key else ()


def is_admin_path(path: str) -> bool:
    """An operational path: one of ADMIN_PATHS, or under /workers/ (a worker's own: its role)."""
    return path in ADMIN_PATHS or path.startswith("/workers/")


def bearer_token(headers: list[tuple[bytes, bytes]], basic: bool = False) -> bytes | None:
    """The bearer token (the scheme in any case, blanks around the token ignored: `bearer k`,
    `BEARER  k` and `Bearer k` give one token); with `basic`, also HTTP Basic's password."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                return token.strip()
            if basic and scheme.lower() == b"basic":
                try:
                    return base64.b64decode(token.strip(), validate=True).partition(b":")[2]
                except (binascii.Error, ValueError):
                    return None
            return None
    return None


def request_key(headers: list[tuple[bytes, bytes]], basic: bool = False) -> bytes | None:
    """The key a request carries: its bearer token (`bearer_token`), else Anthropic's `x-api-key`."""
    token = bearer_token(headers, basic)
    if token is not None:
        return token
    for name, value in headers:
        if name.lower() == b"x-api-key":
            return value.strip()
    return None


class ApiKeyMiddleware:
    def __init__(self, app: Any, keys: ApiKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        wanted = self.keys.required(scope["path"])
        if wanted:
            dashboard = scope["path"] in DASHBOARD_PATHS
            given = request_key(scope.get("headers", []), basic=dashboard)
            # Every key is compared, whatever matched: the time does not tell which one was close.
            ok = False
            for key in wanted:
                ok |= given is not None and hmac.compare_digest(given, key.encode())
            if not ok:
                what = (
                    "the admin API key"
                    if is_admin_path(scope["path"]) and self.keys.admin_api_key
                    else "an API key"
                )
                how = (
                    "x-api-key: <key>" if is_anthropic_path(scope["path"]) else "Authorization: Bearer <key>"
                )
                body = error_body_for(
                    scope["path"], 401, f"this endpoint needs {what}: {how}", None, "invalid_api_key"
                )
                payload = json.dumps(body).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()),
                            (
                                b"www-authenticate",
                                b'Basic realm="pdserve dashboard"' if dashboard else b"Bearer",
                            ),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": payload})
                return
        await self.app(scope, receive, send)
