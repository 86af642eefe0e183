"""Live weight updates on a real cluster (gateway, prefill, decode as processes; the bundled model).

The second checkpoint is the bundled model with its final norm scaled unevenly per channel: every layer's
KV is unchanged (the norm comes after the last layer) while the logits, and so the greedy tokens, change.
So the tokens after an update's boundary must equal what the offline engine on the new weights produces
greedily from the prompt plus the tokens before it, whatever KV the cluster computed before the update.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from cluster.weights_ckpts import NORM, PROMPTS, greedy_via_cluster, tokenize
from harness import start_roles

# A cluster of its own and streams of 128 tokens: about 4 minutes on two shared cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ADMIN = "weights-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
MAX_NEW = 128
# Which weights each version label the tests set holds: True for checkpoint B.
IS_B = {"default": False, "B": True, "C": False, "E": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_roles(
        tmp_path_factory.mktemp("wcluster"), [("prefill", {}), ("decode", {})], ["--admin-api-key", ADMIN]
    )
    try:
        c.wait_healthy()  # /health: a prefill and a decode in rotation (/workers needs the admin key)
        yield c
    finally:
        c.stop()


def admin(c, path: str, body: dict | None = None, timeout: float = 300) -> httpx.Response:
    return httpx.post(c.url + path, json=body or {}, headers=AUTH, timeout=timeout)


def version(c) -> str:
    return httpx.get(c.url + "/get_weight_version", headers=AUTH, timeout=10).json()["weight_version"]


class Stream(threading.Thread):
    """One streamed greedy /generate: token arrival times and the final chunk."""

    def __init__(self, url: str, ids: list[int], max_new: int = MAX_NEW) -> None:
        super().__init__(daemon=True)
        self.url, self.ids, self.max_new = url, ids, max_new
        self.arrivals: list[tuple[float, int]] = []  # (time, tokens so far)
        self.final: dict | None = None
        self.error: str | None = None

    def run(self) -> None:
        body = {
            "input_ids": self.ids,
            "stream": True,
            "sampling_params": {"max_new_tokens": self.max_new, "temperature": 0, "ignore_eos": True},
        }
        try:
            with httpx.stream("POST", self.url + "/generate", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        self.arrivals.append((time.monotonic(), len(chunk.get("output_ids", []))))
                        self.final = chunk
        except httpx.HTTPError as e:
            self.error = repr(e)

    @property
    def tokens(self) -> int:
        return self.arrivals[-1][1] if self.arrivals else 0


def start_streams(c, prompts: list[list[int]], at_least: int = 4) -> list[Stream]:
    streams = [Stream(c.url, p) for p in prompts]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 120
    while any(s.tokens < at_least for s in streams):
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.02)
    return streams


def check_straddled(
    streams: list[Stream], ref_engine, prompts, old: str, new: str, old_b: bool, new_b: bool
) -> float:
    """Each stream finished with two segments [old, new] split at k; tokens before k are the old weights'
    greedy output, after k the new weights' from that prefix. Returns the longest gap between chunks."""
    gap = 0.0
    outs, ks = [], []
    for s in streams:
        s.join(300)
        assert s.error is None and s.final is not None, s.error
        out = s.final["output_ids"]
        segs = s.final["meta_info"]["weight_versions"]
        assert len(out) == MAX_NEW
        assert [g["version"] for g in segs] == [old, new], segs
        k = segs[0]["end"]
        assert segs == [{"version": old, "start": 0, "end": k}, {"version": new, "start": k, "end": MAX_NEW}]
        assert 0 < k < MAX_NEW
        assert s.final["meta_info"]["weight_version"] == new
        outs.append(out)
        ks.append(k)
        gap = max(gap, max(b[0] - a[0] for a, b in zip(s.arrivals, s.arrivals[1:])))
    before = ref_engine.greedy_many([(p, k) for p, k in zip(prompts, ks)], old_b)
    after = ref_engine.greedy_many([(p + o[:k], MAX_NEW - k) for p, o, k in zip(prompts, outs, ks)], new_b)
    for o, k, b, a in zip(outs, ks, before, after):
        assert o[:k] == b
        assert o[k:] == a
    return gap


def test_the_second_checkpoint_changes_greedy_output(ref_engine):
    [p] = tokenize([PROMPTS[0]])
    assert ref_engine.greedy(p, 24, False) != ref_engine.greedy(p, 24, True)


def test_admin_key_and_bad_bodies(cluster, ckpts):
    _, b, _ = ckpts
    r = httpx.post(cluster.url + "/update_weights_from_disk", json={"model_path": b}, timeout=10)
    assert r.status_code == 401
    assert httpx.get(cluster.url + "/get_weight_version", timeout=10).status_code == 401
    r = admin(cluster, "/update_weights_from_disk", {"model_path": b, "load_format": "pt"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_format"
    r = admin(cluster, "/update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": [[1]]})
    assert r.status_code == 400
    assert version(cluster) == "default"


def test_update_from_disk_while_four_requests_stream(cluster, ckpts, ref_engine):
    _, b, _ = ckpts
    prompts = tokenize(PROMPTS)
    streams = start_streams(cluster, prompts)
    r = admin(cluster, "/update_weights_from_disk", {"model_path": b, "weight_version": "B"})
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["success"] and res["weight_version"] == "B"
    assert sorted(res["updated_workers"]) == ["decode-1", "prefill-0"]
    gap = check_straddled(streams, ref_engine, prompts, "default", "B", False, True)
    print(
        f"\nupdate from disk: {res['seconds']:.2f} s (prepare {res['prepare_seconds']:.2f} s, "
        f"commit {res['commit_seconds']:.3f} s); longest inter-token gap {gap:.3f} s"
    )
    assert version(cluster) == "B"
    info = httpx.get(cluster.url + "/get_model_info", timeout=10).json()
    assert info["weight_version"] == "B"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_update_from_distributed_while_four_requests_stream(cluster, ckpts, ref_engine):
    """Back to the bundled weights, broadcast by a trainer process: its norm, and one fused shard (k_proj)."""
    base, _, _ = ckpts
    assert version(cluster) == "B"  # after the update from disk
    names = [NORM, "model.layers.0.self_attn.k_proj.weight"]
    shapes = tensor_shapes(base, names)
    port = free_port()
    here = os.path.dirname(__file__)
    trainer = subprocess.Popen(
        [sys.executable, os.path.join(here, "weights_trainer.py"), str(port), base, *names],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        body = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 3,
            "group_name": "wg",
            "backend": "gloo",
        }
        r = admin(cluster, "/init_weights_update_group", body)
        assert r.status_code == 200, r.text
        assert sorted(r.json()["ranks"].values()) == [1, 2]
        assert trainer.stdout is not None and trainer.stdin is not None
        assert trainer.stdout.readline().strip() == "joined"
        prompts = tokenize(PROMPTS)
        streams = start_streams(cluster, prompts)
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        body = {
            "names": names,
            "dtypes": ["float32"] * 2,
            "shapes": shapes,
            "group_name": "wg",
            "weight_version": "C",
        }
        r = admin(cluster, "/update_weights_from_distributed", body)
        assert r.status_code == 200, r.text
        assert trainer.stdout.readline().strip() == "done"
        res = r.json()
        gap = check_straddled(streams, ref_engine, prompts, "B", "C", True, False)
        print(
            f"\nupdate from distributed: {res['seconds']:.2f} s (commit {res['commit_seconds']:.3f} s); "
            f"longest inter-token gap {gap:.3f} s"
        )
        r = admin(cluster, "/destroy_weights_update_group", {"group_name": "wg"})
        assert r.status_code == 200
        r = admin(cluster, "/update_weights_from_distributed", {**body, "weight_version": "D"})
        assert r.status_code == 400 and "init" in r.json()["error"]["message"]
    finally:
        try:
            trainer.wait(10)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.wait()
    assert version(cluster) == "C"


def tensor_shapes(folder: str, names: list[str]) -> list[list[int]]:
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        return [list(f.get_slice(n).get_shape()) for n in names]


def test_refused_updates_change_nothing(cluster, ckpts, ref_engine, tmp_path):
    """A shape mismatch, a missing path, another architecture: 400 naming it; an update during another: 409.
    The cluster keeps serving the weights it had."""
    base, b, bad = ckpts
    before = version(cluster)
    [p] = tokenize([PROMPTS[1]])
    cases = {
        "shape": {"model_path": bad},
        "missing": {"model_path": str(tmp_path / "nowhere")},
    }
    other = tmp_path / "other"
    shutil.copytree(base, other, ignore=shutil.ignore_patterns("*.safetensors", "*.lock"))
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (other / "config.json").write_text(json.dumps(cfg))
    shutil.copy(os.path.join(base, "model.safetensors"), other / "model.safetensors")
    cases["arch"] = {"model_path": str(other)}
    for what, body in cases.items():
        r = admin(cluster, "/update_weights_from_disk", {**body, "weight_version": f"bad-{what}"})
        assert r.status_code == 400, (what, r.text)
        msg = r.json()["error"]["message"]
        assert "nothing changed" in msg, msg
        assert {"shape": "shape", "missing": "does not exist", "arch": "num_layers"}[what] in msg, msg
        assert version(cluster) == before
    assert greedy_via_cluster(cluster, p)["output_ids"] == ref_engine.greedy(p, 24, IS_B[before])
    # One update at a time: two sent together, one is refused with 409. A tiny checkpoint's update can
    # end before the second arrives (then both succeed, in turn): try again, up to 5 times.
    for _ in range(5):
        first: dict = {}
        t = threading.Thread(
            target=lambda into=first: into.update(
                r=admin(cluster, "/update_weights_from_disk", {"model_path": b, "weight_version": "E"})
            )
        )
        t.start()
        time.sleep(0.05)
        r = admin(cluster, "/update_weights_from_disk", {"model_path": base, "weight_version": "F"})
        t.join(300)
        codes = sorted([first["r"].status_code, r.status_code])
        assert codes in ([200, 409], [200, 200]), (first["r"].text, r.text)
        if version(cluster) != "E":  # F ran last: back to E before the next try or the checks below
            back = admin(cluster, "/update_weights_from_disk", {"model_path": b, "weight_version": "E"})
            assert back.status_code == 200, back.text
        if codes == [200, 409]:
            refused = r if r.status_code == 409 else first["r"]
            assert refused.json()["error"]["code"] == "conflict", refused.text
            break
    else:
        pytest.fail("two updates sent together never overlapped in 5 tries")
    assert version(cluster) == "E"
    workers = httpx.get(cluster.url + "/workers", headers=AUTH, timeout=10).json()["workers"]
    assert {w["weight_version"] for w in workers} == {"E"} and {w["state"] for w in workers} == {"healthy"}
    assert greedy_via_cluster(cluster, p)["output_ids"] == ref_engine.greedy(p, 24, True)


def test_a_prompt_cached_under_one_version_is_recomputed_under_the_next(cluster, ckpts, ref_engine):
    base, b, _ = ckpts
    # A long prompt: several whole pages to cache.
    [p] = tokenize([" ".join(PROMPTS) * 3])
    cur_b = IS_B[version(cluster)]
    greedy_via_cluster(cluster, p)
    again = greedy_via_cluster(cluster, p)
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == ref_engine.greedy(p, 24, cur_b)
    r = admin(
        cluster, "/update_weights_from_disk", {"model_path": base if cur_b else b, "weight_version": "G"}
    )
    assert r.status_code == 200, r.text
    IS_B["G"] = not cur_b
    after = greedy_via_cluster(cluster, p)
    assert after["meta_info"]["cached_tokens"] == 0
    assert after["meta_info"]["weight_versions"] == [{"version": "G", "start": 0, "end": 24}]
    assert after["output_ids"] == ref_engine.greedy(p, 24, not cur_b)
    assert greedy_via_cluster(cluster, p)["meta_info"]["cached_tokens"] > 0  # cached again, under G


def test_pause_and_continue_generation(cluster, ref_engine):
    [p] = tokenize([PROMPTS[2]])
    s = Stream(cluster.url, p, max_new=40)
    s.start()
    while s.tokens < 4:
        assert s.is_alive() or s.tokens, s.error
        time.sleep(0.02)
    r = admin(cluster, "/pause_generation", {"mode": "in_place"})
    assert r.status_code == 200, r.text
    time.sleep(0.3)
    held = s.tokens
    time.sleep(1.0)
    assert s.tokens == held < 40  # nothing moves while paused
    assert admin(cluster, "/continue_generation").status_code == 200
    s.join(300)
    assert s.final is not None and len(s.final["output_ids"]) == 40
    assert s.final["output_ids"] == ref_engine.greedy(p, 40, IS_B[version(cluster)])
