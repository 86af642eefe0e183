"""Random sampling parameters against a live 1 prefill + 1 decode cluster (`pdserve up`): every
answer is a 2xx or a 4xx, no worker restarts, and a normal request succeeds afterwards.

The values include what JSON (as Python writes it) can carry past a careless check: ints past int64
(2**63, 2**64, -2**63), huge and tiny floats, NaN and infinities, empty and long lists, ids past the
vocabulary. The issue's three bodies (top_k 2**63; seed 2**63 - 1 with n 2; stop_token_ids [2**63]
with min_new_tokens 1) once ended the prefill worker, and six of them the cluster.
"""

from __future__ import annotations

import json

import httpx
import pytest
from harness import start_up
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(900)

ISSUE_BODIES = [
    {"text": "Hello there", "sampling_params": {"top_k": 2**63, "max_new_tokens": 4}},
    {"text": "Hello there", "sampling_params": {"seed": 2**63 - 1, "n": 2, "max_new_tokens": 4}},
    {
        "text": "Hello there",
        "sampling_params": {"stop_token_ids": [2**63], "min_new_tokens": 1, "max_new_tokens": 4},
    },
]
NORMAL = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_up(tmp_path_factory.mktemp("fuzz"))
    try:
        c.wait_healthy(workers=2)
        yield c
    finally:
        c.stop()


def _workers(c) -> dict[str, tuple[int, float]]:
    """worker id -> (restarts, registered_at), the lost ones included."""
    got = httpx.get(c.url + "/workers", params={"all": "1"}, timeout=10).json()["workers"]
    return {w["worker_id"]: (w["restarts"], w["registered_at"]) for w in got}


def _assert_alive(c, before: dict[str, tuple[int, float]]) -> None:
    assert _workers(c) == before, "a worker restarted or re-registered"
    for p in c.procs:
        assert p.poll() is None, f"pdserve up exited with {p.returncode}"
    r = httpx.post(c.url + "/generate", json=NORMAL, timeout=120)
    assert r.status_code == 200, r.text


def _post(c, body: dict) -> httpx.Response:
    # json.dumps writes NaN and Infinity (httpx's json= refuses them); the gateway's parser reads them.
    data = json.dumps(body)
    r = httpx.post(
        c.url + "/generate", content=data, headers={"content-type": "application/json"}, timeout=120
    )
    assert r.status_code < 500, (body, r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert isinstance(r.json()["error"]["message"], str), r.text
    return r


def test_the_issue_bodies_leave_every_worker_alive(cluster) -> None:
    before = _workers(cluster)
    assert len(before) == 2
    for _ in range(3):  # six of them ended the cluster
        for body in ISSUE_BODIES:
            _post(cluster, body)
    _assert_alive(cluster, before)


_EXTREME_INTS = [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1, -(2**64), 10**30]
_INTS = st.one_of(st.integers(-3, 50), st.integers(49_000, 49_300), st.sampled_from(_EXTREME_INTS))
_FLOATS = st.one_of(
    st.floats(-3.0, 3.0),
    st.sampled_from([0.0, -0.0, 1e-38, 5e-324, 1e-6, 1e300, -1e300, 1.7976931348623157e308]),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
)
_KEYS = {
    "temperature": _FLOATS,
    "top_p": _FLOATS,
    "top_k": _INTS,
    "min_p": _FLOATS,
    "repetition_penalty": _FLOATS,
    "frequency_penalty": _FLOATS,
    "presence_penalty": _FLOATS,
    "seed": _INTS,
    "sampling_seed": _INTS,
    "min_new_tokens": st.one_of(st.integers(0, 4), _INTS),
    "stop_token_ids": st.lists(_INTS, max_size=80),
    "logit_bias": st.dictionaries(_INTS.map(str), _FLOATS, max_size=40),
    "stop": st.one_of(st.lists(st.text(max_size=8), max_size=20), st.text(max_size=8)),
    "ignore_eos": st.booleans(),
    "no_stop_trim": st.booleans(),
    "max_new_tokens": st.one_of(st.integers(0, 6), st.sampled_from([-1, 2**63, 10**9])),
}


@st.composite
def _bodies(draw: st.DrawFn) -> dict:
    keys = draw(st.lists(st.sampled_from(sorted(_KEYS)), unique=True, max_size=8))
    params = {k: draw(_KEYS[k]) for k in keys}
    params.setdefault("max_new_tokens", draw(st.integers(1, 4)))
    params["n"] = draw(st.integers(1, 3))
    body: dict = {
        "text": draw(st.sampled_from(["Hi", "Tell me a story", "1 2 3 4"])),
        "sampling_params": params,
    }
    if draw(st.booleans()):
        body["return_logprob"] = True
        body["top_logprobs_num"] = draw(st.one_of(st.integers(0, 5), _INTS))
        body["logprob_start_len"] = draw(st.one_of(st.integers(-1, 3), _INTS))
    return body


@pytest.mark.slow
def test_random_sampling_params_answer_2xx_or_4xx_and_no_worker_restarts(cluster) -> None:
    before = _workers(cluster)
    statuses: dict[int, int] = {}

    @given(body=_bodies())
    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def fuzz(body: dict) -> None:
        r = _post(cluster, body)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

    fuzz()
    print("statuses", sorted(statuses.items()))
    assert 200 in statuses and any(400 <= s < 500 for s in statuses), statuses
    _assert_alive(cluster, before)
