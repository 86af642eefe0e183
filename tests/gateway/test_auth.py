"""HTTP API keys: inference and admin endpoints, open health and metrics, OpenAI-shaped 401s."""

from __future__ import annotations

import pytest

from .conftest import gateway_client

INFERENCE = [("POST", "/generate"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/docs")]
ADMIN = [("GET", "/workers"), ("POST", "/flush_cache"), ("POST", "/abort_request"), ("GET", "/dashboard"),
         ("GET", "/dashboard/data")]  # fmt: skip


def _call(c, method: str, path: str, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = (
        {"text": "hi"} if path == "/generate" else {"abort_all": True} if path == "/abort_request" else None
    )
    if path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "hi"}]}
    return c.request(method, path, headers=headers, json=body)


def _refused(r) -> None:
    assert r.status_code == 401, (r.status_code, r.text)
    err = r.json()["error"]
    assert (
        err["code"] == "invalid_api_key"
        and err["type"] == "invalid_request_error"
        and "Bearer" in err["message"]
    )
    assert "inference-key" not in r.text and "admin-key" not in r.text  # the keys are never echoed


@pytest.fixture(scope="module")
def keyed(tokenizer):
    with gateway_client(tokenizer, api_key="inference-key", admin_api_key="admin-key") as c:
        yield c


@pytest.mark.parametrize("method,path", INFERENCE + ADMIN)
def test_no_key_or_a_wrong_one_is_refused(keyed, method, path):
    _refused(_call(keyed, method, path))
    _refused(_call(keyed, method, path, "wrong"))
    _refused(keyed.request(method, path, headers={"Authorization": "Basic inference-key"}))


@pytest.mark.parametrize("method,path", INFERENCE)
def test_inference_key_opens_inference_endpoints(keyed, method, path):
    # Past the key check: 200, or the 503 of a gateway without workers.
    assert _call(keyed, method, path, "inference-key").status_code in (200, 503)
    assert _call(keyed, method, path, "admin-key").status_code in (200, 503)  # the admin key too


@pytest.mark.parametrize("method,path", ADMIN)
def test_only_the_admin_key_opens_admin_endpoints(keyed, method, path):
    _refused(_call(keyed, method, path, "inference-key"))
    assert _call(keyed, method, path, "admin-key").status_code != 401


def test_dashboard_takes_the_admin_key_as_basic_password(keyed):
    """A browser opening the page is asked for the key (HTTP Basic), and its own requests carry it."""
    import base64

    r = keyed.get("/dashboard")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
    assert keyed.get("/workers").headers["www-authenticate"] == "Bearer"
    basic = lambda pw: {"Authorization": "Basic " + base64.b64encode(f"ops:{pw}".encode()).decode()}
    for path in ("/dashboard", "/dashboard/data"):
        assert keyed.get(path, headers=basic("admin-key")).status_code == 200
        _refused(keyed.get(path, headers=basic("inference-key")))
    page = keyed.get("/dashboard", headers=basic("admin-key")).text
    assert "<script>" in page and "http://" not in page and "https://" not in page  # nothing from elsewhere
    # Basic is the dashboard's only: other admin endpoints still want a bearer token.
    _refused(keyed.get("/workers", headers=basic("admin-key")))
    data = keyed.get("/dashboard/data", headers={"Authorization": "Bearer admin-key"}).json()
    assert data["workers"] == [] and data["requests"] == [] and "decode" in data["phases"]


def test_health_and_metrics_are_open_unless_protected(keyed, tokenizer):
    assert keyed.get("/health").status_code in (200, 503)
    assert keyed.get("/metrics").status_code == 200
    with gateway_client(tokenizer, api_key="k", protect_health=True, protect_metrics=True) as c:
        for path in ("/health", "/metrics"):
            _refused(c.get(path))
            assert c.get(path, headers={"Authorization": "Bearer k"}).status_code in (200, 503)
        # No admin key: the API key opens the admin endpoints.
        assert c.get("/workers", headers={"Authorization": "Bearer k"}).status_code == 200


def test_without_keys_everything_stays_open(client):
    assert client.get("/workers").status_code == 200
    assert client.get("/v1/models").status_code in (200, 503)


def test_keys_are_not_in_the_config_repr():
    from pdserve.gateway.config import GatewayConfig

    assert "secret-value" not in repr(GatewayConfig(api_key="secret-value", admin_api_key="secret-value"))
