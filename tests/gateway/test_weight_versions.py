"""weight_versions from the workers' tags: segments cover every output token once, in order."""

from __future__ import annotations

from pdserve.gateway.api.openai_reply import version_fields, weight_segments
from pdserve.gateway.cluster.workers import WorkerRegistry
from pdserve.gateway.generation.collector import count_version
from pdserve.gateway.generation.generation import GenState
from pdserve.protocol import gateway as m


def segments(tags: list[tuple[str, int]]) -> list[dict]:
    segs: list[dict] = []
    n = 0
    for version, count in tags:
        for _ in range(count):
            n += 1
            count_version(segs, version, n)
    return segs


def test_runs_of_one_version_are_one_segment():
    assert segments([("a", 1), ("a", 3)]) == [{"version": "a", "start": 0, "end": 4}]
    # First token from an updated prefill node, steps from a decode node not yet updated, then updated.
    assert segments([("b", 1), ("a", 2), ("b", 2)]) == [
        {"version": "b", "start": 0, "end": 1},
        {"version": "a", "start": 1, "end": 3},
        {"version": "b", "start": 3, "end": 5},
    ]
    assert segments([]) == []


def test_openai_metadata_concatenates_the_choices():
    s1 = GenState("r-0", 3, output_ids=[1, 2, 3], weight_versions=segments([("a", 2), ("b", 1)]))
    s2 = GenState("r-1", 3, output_ids=[4, 5], weight_versions=segments([("b", 2)]))
    segs = weight_segments([s1, s2])
    assert segs == [{"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 2, "end": 5}]
    assert version_fields(segs, strict=True) == {"metadata": {"weight_version": "b"}, "weight_versions": segs}
    assert version_fields(segs, strict=False) == {
        "metadata": {"weight_version": "b", "weight_versions": segs}
    }


def _reg(version: str) -> m.Register:
    return m.Register(
        worker_id="d0",
        role="decode",
        fingerprint={"architecture": "x"},
        model_name="x",
        max_total_tokens=1024,
        max_running_requests=8,
        context_length=1024,
        vocab_size=100,
        t_send=0.0,
        weight_version=version,
    )


def test_a_worker_on_other_weights_than_the_clusters_is_out_of_rotation():
    reg = WorkerRegistry()
    reg.weight_version = "step-7"
    w = reg.add(_reg("default"), b"d0/x", 0.0)  # restarted on the old checkpoint
    assert w.state == "stale_weights" and reg.in_rotation("decode") == []
    w = reg.add(_reg("step-7"), b"d0/y", 0.0)
    assert w.state == "healthy" and reg.in_rotation("decode") == [w]
