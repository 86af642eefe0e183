"""A request that makes a worker's step raise (RequestFailed code `internal`): a 500 naming the worker,
not run again on another pair, and refused before dispatch (422) once it did so twice."""

from __future__ import annotations

import pytest

from pdserve.gateway.generation.failed_requests import FailedRequests, request_fingerprint
from pdserve.protocol.vocabulary import FailCode
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)


def test_the_record_counts_per_fingerprint_and_forgets_the_oldest() -> None:
    f = FailedRequests(refuse_after=2, capacity=3)
    a = request_fingerprint([1, 2], SamplingParams())
    assert a == request_fingerprint([1, 2], SamplingParams())
    assert a != request_fingerprint([1, 2], SamplingParams(seed=1))
    assert a != request_fingerprint([12], SamplingParams())
    assert f.record(a) == 1 and not f.refused(a)
    assert f.record(a) == 2 and f.refused(a)
    for i in range(3):
        f.record(str(i))
    assert len(f) == 3 and not f.refused(a)  # the least recently failed went first


def test_an_internal_failure_is_a_500_then_the_request_is_refused_everywhere(cluster) -> None:
    cluster.prefill.fail_code = FailCode.INTERNAL
    cluster.add("p1", "prefill", fail_code=FailCode.INTERNAL)
    # The stand-in decode does not wait for KV: hold its first step until the prefill's failure is in, as a
    # real decode node would (else, on a slow machine, its whole reply can beat the RequestFailed).
    cluster.decode.kv_wait_s = 30.0
    body = {"text": "poison", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    tried = []
    for _ in range(2):
        r = cluster.client.post("/generate", json=body)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "internal_server_error" and "[internal]" in err["message"], err
        tried.append(sum(len(w.requests()) for w in cluster.workers if w.role == "prefill"))
    assert tried == [1, 2]  # one attempt each: no retry on the other prefill
    cluster.prefill.fail_code = None
    cluster.decode.kv_wait_s = 0.0
    for w in cluster.workers:
        w.fail_code = None
    r = cluster.client.post("/generate", json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "request_failed_workers" and "failed a worker's step 2 times" in err["message"]
    assert sum(len(w.requests()) for w in cluster.workers if w.role == "prefill") == 2  # never sent
    # Another request (other sampling parameters) is served.
    other = {"text": "poison", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "seed": 3}}
    assert cluster.client.post("/generate", json=other).status_code == 200
    assert (
        'pdserve_rejected_requests_total{reason="failed_workers"} 1.0' in cluster.client.get("/metrics").text
    )
