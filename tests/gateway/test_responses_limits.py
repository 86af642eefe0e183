"""What one key can put in the /v1/responses store, through the gateway: another key's responses
survive its flood, `metadata` has OpenAI's caps (responses and chat completions), and the request
fields a response repeats are refused (400) when they hold anything but their shape."""

from __future__ import annotations

import pytest

A = {"Authorization": "Bearer admin-key"}
B = {"Authorization": "Bearer user-key"}
# Under the 4 MiB body limit, in a field the response repeats and the prompt never holds.
BIG_USER = "u" * ((4 << 20) - 100_000)


@pytest.fixture
def keyed(wire_cluster):
    return wire_cluster(api_key="user-key", admin_api_key="admin-key")


def _create(c, headers: dict, **fields) -> dict:
    r = c.client.post(
        "/v1/responses", json={"input": "hi", "max_output_tokens": 4, **fields}, headers=headers
    )
    assert r.status_code == 200, r.text[:300]
    return r.json()


def test_one_key_storing_big_responses_does_not_evict_anothers(keyed):
    """18 responses of 3.9 MiB from one key: the old store (one FIFO of 64 MiB for all keys) dropped
    the other key's response at the 17th. Now the flooding key drops its own oldest."""
    kept = _create(keyed, A)["id"]
    ids = [_create(keyed, B, user=BIG_USER)["id"] for _ in range(18)]
    r = keyed.client.get(f"/v1/responses/{kept}", headers=A)
    assert r.status_code == 200 and r.json()["id"] == kept
    last = keyed.client.get(f"/v1/responses/{ids[-1]}", headers=B)
    assert last.status_code == 200 and last.json()["user"] == BIG_USER
    assert keyed.client.get(f"/v1/responses/{ids[0]}", headers=B).status_code == 404
    # A follow-up continues the surviving response as ever.
    follow = _create(keyed, A, previous_response_id=kept)
    assert follow["previous_response_id"] == kept


META_OK = {f"k{i:02d}" + "x" * 61: "v" * 512 for i in range(16)}  # 16 keys of 64, values of 512


@pytest.mark.parametrize(
    "metadata, says",
    [
        ({f"k{i}": "v" for i in range(17)}, "too many keys"),
        ({f"k{i}": "v" for i in range(250_000)}, "too many keys"),
        ({"k" * 65: "v"}, "at most 64 characters"),
        ({"k": "v" * 513}, "at most 512 characters"),
        ({"k": 1}, "valid string"),
        ({"k": {"nested": [[], []]}}, "valid string"),
    ],
)
def test_metadata_has_openais_caps(keyed, metadata, says):
    for path, body in (
        ("/v1/responses", {"input": "hi", "max_output_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ):
        r = keyed.client.post(path, json={**body, "metadata": metadata}, headers=B)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"].startswith("metadata"), (path, r.text[:300])
        assert says in err["message"] and err["type"] == "invalid_request_error", err
    assert len(keyed.client.app.state.gw.responses) == 0


def test_metadata_within_the_caps_is_served_and_kept(keyed):
    rid = _create(keyed, B, metadata=META_OK)["id"]
    assert keyed.client.get(f"/v1/responses/{rid}", headers=B).json()["metadata"] == META_OK
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "metadata": META_OK}
    assert keyed.client.post("/v1/chat/completions", json=chat, headers=B).status_code == 200


LISTS = [[] for _ in range(200_000)]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"text": {"format": {"type": "text"}, "junk": LISTS}}, "text.junk"),
        ({"text": {"format": {"type": "text", "junk": LISTS}}}, "text.format.junk"),
        ({"text": LISTS}, "text"),
        ({"text": {"format": {"type": "json_object"}, "verbosity": LISTS}}, "text.verbosity"),
        ({"tools": [{"type": "function", "name": "f", "junk": LISTS}]}, "tools.0.junk"),
        ({"tool_choice": {"type": "function", "name": "f", "junk": LISTS}}, "tool_choice"),
        ({"reasoning": {"effort": "low", "junk": LISTS}}, "reasoning.junk"),
    ],
)
def test_what_a_response_repeats_holds_only_its_shape(keyed, fields, param):
    """The old model took `text`, `tool_choice` and a tool's unknown keys as any JSON and the response
    repeated them: 12 responses whose `text` held 1.3M empty lists grew the gateway by 1.09 GiB."""
    r = keyed.client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4, **fields}, headers=B)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
    assert len(keyed.client.app.state.gw.responses) == 0


def test_the_shapes_a_response_repeats_are_echoed(keyed):
    text = {"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True}}
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    out = _create(keyed, B, text=text, tools=[tool], tool_choice="none", reasoning={"effort": "low"})
    stored = keyed.client.get(f"/v1/responses/{out['id']}", headers=B).json()
    assert stored == out
    assert out["text"] == text and out["tools"] == [tool] and out["tool_choice"] == "none"
    assert out["reasoning"] == {"effort": "low", "summary": None}
