"""`pdserve bench abuse`, the /v1/responses store: what one key's stored responses can do to another
key's, and to the gateway's memory (gateway/api/responses_store.py)."""

from __future__ import annotations

import httpx

from pdserve.bench.abuse_target import Target, status

# Just under the 4 MiB body limit. "é" is two bytes of the body and one of memory; the store before
# per-key quotas counted each as six (its JSON escaped them), so 6 such responses evicted another
# key's; now each is counted as the 3.9 MiB it holds, against its key's own quota.
BIG_USER = "é" * (((4 << 20) - 100_000) // 2)


def _responses(t: Target, body: bytes | dict, headers: dict[str, str]) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(t.url + "/v1/responses", json=body, timeout=120, headers=headers)
    h = {"content-type": "application/json", **headers}
    return httpx.post(t.url + "/v1/responses", content=body, timeout=120, headers=h)


def one_key_fills_the_store(t: Target) -> tuple[str, bool]:
    """The admin key (an inference key too, another owner) stores one response; the inference key then
    stores 13 of 3.9 MiB (in `user`, which the response repeats and the prompt never holds). The admin
    key's response is still there; the inference key keeps what its quota holds, its oldest dropped."""
    if not (t.api_key and t.admin_key):
        return "needs two keys (--api-key and --admin-api-key): one owner only", False
    a, b = {"Authorization": f"Bearer {t.admin_key}"}, t.headers()
    first = _responses(t, {"input": "hi", "max_output_tokens": 1}, a)
    if first.status_code != 200:
        return status(first, 200)
    big = {"input": "hi", "max_output_tokens": 1, "user": BIG_USER}
    sent = [_responses(t, big, b) for _ in range(13)]
    ids = [r.json()["id"] for r in sent if r.status_code == 200]
    kept = sum(httpx.get(f"{t.url}/v1/responses/{i}", headers=b, timeout=60).status_code == 200 for i in ids)
    other = httpx.get(f"{t.url}/v1/responses/{first.json()['id']}", headers=a, timeout=60).status_code
    answer = f"{len(ids)}/13 stored, {kept} kept; the other key's: {other}"
    return answer, len(ids) == 13 and 0 < kept < 13 and other == 200


def text_of_empty_lists(t: Target) -> tuple[str, bool]:
    """12 responses whose `text` holds 1.3M empty lists (3.9 MiB): once stored as parsed, 1.09 GiB of
    the gateway's memory for an hour; now `text` has its shape and anything else in it is a 400."""
    n = 1_300_000
    body = (
        b'{"input": "hi", "max_output_tokens": 1, "text": {"format": {"type": "text"}, "x": ['
        + b"[]," * (n - 1)
        + b"[]]}}"
    )
    answers = [_responses(t, body, t.headers()) for _ in range(12)]
    codes = [r.status_code for r in answers]
    if codes != [400] * 12:
        return f"{', '.join(map(str, codes))}", False
    return f"12 x {status(answers[0], 400)[0]}", True


def metadata_of_many_keys(t: Target) -> tuple[str, bool]:
    """`metadata` of 250k keys (3 MiB), to /v1/responses and /v1/chat/completions: OpenAI's caps (16
    keys of 64 characters, values of 512) refuse it before its keys are read."""
    meta = b"{" + b",".join(b'"k%d":""' % i for i in range(250_000)) + b"}"
    h = {"content-type": "application/json", **t.headers()}
    bodies = {
        "/v1/responses": b'{"input": "hi", "max_output_tokens": 1, "metadata": ' + meta + b"}",
        "/v1/chat/completions": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
        b'"metadata": ' + meta + b"}",
    }
    answers = [httpx.post(t.url + p, content=b, timeout=60, headers=h) for p, b in bodies.items()]
    named = all(r.status_code == 400 and r.json()["error"]["param"] == "metadata" for r in answers)
    answer, _ = status(answers[0], 400)
    return f"{answer} (responses and chat)" if named else ", ".join(status(r, 400)[0] for r in answers), named
