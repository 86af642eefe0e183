"""Live weight updates on a `pdserve up` cluster (1 prefill + 1 decode, the bundled model): how long an
update takes from disk and from a trainer's torch.distributed group (gloo), and the pause streaming
requests see.

Each round streams `--streams` greedy requests; once every stream has its first tokens, the update is
sent (or, for the baseline, nothing). The longest inter-token gap of the streams in an update round
is set beside that of a baseline round without one, measured in the same run. `commit s` is the gateway's
wait for every worker's commit (each applies it after the step it is in); `in worker s` the swap itself. From disk alternates
between the bundled weights and a copy with the final norm rescaled (made in a temporary folder);
from distributed, this process is the trainer (rank 0) and broadcasts every tensor of the model.

    python -P -m pdserve.bench.bench_weights [--rounds 3] [--streams 4] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time

import httpx
import torch
from safetensors.torch import load_file, save_file

from pdserve.launch.supervisor import pdserve_command, signal_group, spawn
from pdserve.model_source import resolve_model_source
from pdserve.port_file import wait_port_file
from pdserve.runtime.loader import model_folder
from pdserve.runtime.weights_group import WeightsGroup

PROMPTS = [
    "The history of the printing press",
    "Write a short story about a lighthouse keeper",
    "List the planets of the solar system and",
    "Explain how a bicycle stays upright",
]


def make_second_checkpoint(base: str, dest: str) -> None:
    state = load_file(os.path.join(base, "model.safetensors"))
    w = state["model.norm.weight"]
    state["model.norm.weight"] = (w * (1.0 + 0.6 * torch.sin(torch.arange(w.numel())))).contiguous()
    shutil.copytree(base, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.lock"))
    save_file(state, os.path.join(dest, "model.safetensors"))


class Stream(threading.Thread):
    def __init__(self, url: str, text: str, max_new: int) -> None:
        super().__init__(daemon=True)
        self.url, self.text, self.max_new = url, text, max_new
        self.arrivals: list[float] = []

    def run(self) -> None:
        body = {
            "text": self.text,
            "stream": True,
            "sampling_params": {"max_new_tokens": self.max_new, "temperature": 0, "ignore_eos": True},
        }
        with httpx.stream("POST", self.url + "/generate", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.arrivals.append(time.monotonic())

    def longest_gap(self) -> float:
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:])), default=0.0)


def stream_round(url: str, n: int, max_new: int, update) -> tuple[dict | None, float]:
    """`n` streams; `update()` once each has 4 chunks. Returns (its answer, longest gap of any stream)."""
    streams = [Stream(url, PROMPTS[i % len(PROMPTS)], max_new) for i in range(n)]
    for s in streams:
        s.start()
    while any(len(s.arrivals) < 4 and s.is_alive() for s in streams):
        time.sleep(0.01)
    res = update() if update is not None else None
    for s in streams:
        s.join()
    return res, max(s.longest_gap() for s in streams)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Row = tuple[float, float, float, float]  # (total s, commit s, longest inter-token gap s, in worker s)


def spawn_cluster(tmp: str) -> subprocess.Popen[bytes]:
    """`pdserve up` on a free port (written to tmp/ports), its logs in `tmp`."""
    argv_up = pdserve_command("up", "--port", "0", "--port-file", os.path.join(tmp, "ports"))
    argv_up += ["--max-total-tokens", "8192", "--log-dir", tmp]
    return spawn(argv_up, os.path.join(tmp, "up.log"))


def wait_healthy(proc: subprocess.Popen[bytes], tmp: str) -> str:
    """The URL of the cluster `spawn_cluster(tmp)` started, once it is healthy."""
    url = f"http://127.0.0.1:{wait_port_file(os.path.join(tmp, 'ports'), proc, 300)['port']}"
    deadline = time.monotonic() + 300
    while httpx.get(url + "/health", timeout=5).status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"cluster not healthy; logs in {tmp}")
        time.sleep(0.5)
    return url


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: {r.status_code} {r.text}")
    return dict(r.json())


def join_as_trainer(url: str) -> WeightsGroup:
    """This process as rank 0 of a gloo group "bench" with every worker of the cluster."""
    n_workers = len(httpx.get(url + "/workers", timeout=5).json()["workers"])
    mport = free_port()
    joined: dict = {}
    group = {
        "master_address": "127.0.0.1",
        "master_port": mport,
        "world_size": 1 + n_workers,
        "group_name": "bench",
        "backend": "gloo",
    }
    t = threading.Thread(target=lambda: joined.update(g=WeightsGroup(rank=0, **group)))
    t.start()
    post(url, "/init_weights_update_group", {**group, "rank_offset": 1})
    t.join()
    trainer: WeightsGroup = joined["g"]
    return trainer


def _row(res: dict | None, gap: float) -> Row:
    assert res is not None
    return res["seconds"], res["commit_seconds"], gap, max(res["worker_commit_seconds"].values())


def measure(
    url: str, args: argparse.Namespace, checkpoints: tuple[str, str], group: WeightsGroup, tensors: dict
) -> dict[str, list[Row]]:
    """Per round: a baseline, an update from disk (alternating between `checkpoints`) and one broadcast."""
    base, second = checkpoints
    rows: dict[str, list[Row]] = {"none": [], "disk": [], "distributed": []}
    k = 0
    for r in range(args.rounds):
        _, gap = stream_round(url, args.streams, args.max_new_tokens, None)
        rows["none"].append((0.0, 0.0, gap, 0.0))
        k += 1
        path = second if k % 2 else base
        res, gap = stream_round(
            url,
            args.streams,
            args.max_new_tokens,
            lambda path=path, k=k: post(
                url, "/update_weights_from_disk", {"model_path": path, "weight_version": f"disk-{k}"}
            ),
        )
        rows["disk"].append(_row(res, gap))

        def distributed(r: int = r) -> dict:
            sender = threading.Thread(target=lambda: [group.broadcast(v) for v in tensors.values()])
            sender.start()
            out = post(
                url,
                "/update_weights_from_distributed",
                {
                    "names": list(tensors),
                    "dtypes": ["float32"] * len(tensors),
                    "shapes": [list(v.shape) for v in tensors.values()],
                    "group_name": "bench",
                    "weight_version": f"dist-{r}",
                },
            )
            sender.join()
            return out

        res, gap = stream_round(url, args.streams, args.max_new_tokens, distributed)
        rows["distributed"].append(_row(res, gap))
    return rows


def report(rows: dict[str, list[Row]], tensors: dict, args: argparse.Namespace) -> None:
    nbytes = sum(v.numel() * 4 for v in tensors.values())
    print(
        f"bundled model, {len(tensors)} tensors, {nbytes / 2**20:.0f} MiB float32; {args.streams} streams "
        f"x {args.max_new_tokens} tokens; median of {args.rounds} rounds"
    )
    print(
        f"{'update':<12} {'total s':>8} {'commit s':>9} {'in worker s':>12} {'longest inter-token gap s':>26}"
    )
    for name, xs in rows.items():
        tot, com, gap, wk = (statistics.median(x[i] for x in xs) for i in range(4))
        label = "(none)" if name == "none" else name
        print(f"{label:<12} {tot:>8.2f} {com:>9.3f} {wk:>12.3f} {gap:>26.3f}")
    print(json.dumps({k: [list(x) for x in v] for k, v in rows.items()}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    base = model_folder(resolve_model_source(None))
    tmp = tempfile.mkdtemp(prefix="pdserve-bench-weights-")
    second = os.path.join(tmp, "rescaled")
    make_second_checkpoint(base, second)
    proc = spawn_cluster(tmp)
    try:
        url = wait_healthy(proc, tmp)
        stream_round(url, 1, 8, None)  # warm-up
        group = join_as_trainer(url)
        tensors = {
            k: v.float().contiguous() for k, v in load_file(os.path.join(base, "model.safetensors")).items()
        }
        rows = measure(url, args, (base, second), group, tensors)
        post(url, "/destroy_weights_update_group", {"group_name": "bench"})
        report(rows, tensors, args)
    finally:
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(30)
        except Exception:
            signal_group(proc, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
