"""The GPU check's cluster stage: `pdserve up` on the one GPU and `pdserve bench serving` against it."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import time

from pdserve.bench.gpu_run import ROOT, Run, StageResult, cli_args
from pdserve.launch.supervisor import pdserve_command


def cluster_commands(port: int, model_path: str | None, log_dir: str) -> tuple[list[str], list[str]]:
    """`pdserve up` on the one GPU and the serving benchmark against it."""
    up = pdserve_command("up", "--device", "cuda", "--port", str(port), "--log-dir", log_dir)
    up += ["--model-path", model_path] if model_path else []
    # Two processes share the device: each gets a KV pool of its own, staged hand-off through the host.
    up += ["--kv-transfer-backend", "gloo", "--mem-fraction-static", "0.3"]
    bench = pdserve_command(
        "bench", "serving", "--base-url", f"http://127.0.0.1:{port}", "--max-concurrency", "64"
    )
    bench += ["--num-prompts", "256", "--dataset", "random", "--random-input-len", "512"]
    # The random prompts are made with the served model's tokenizer (a random-weight checkpoint has one).
    bench += ["--tokenizer", model_path] if model_path else []
    bench += [
        "--random-output-len",
        "128",
        "--ignore-eos",
        "--output-json",
        os.path.join(log_dir, "serving.json"),
    ]
    return up, bench


def stage_cluster(run: Run, model_path: str | None) -> StageResult:
    up, bench = cluster_commands(31900, model_path, str(run.logs / "cluster"))
    if not run.cuda:
        _parse_only(up, bench)
        return StageResult(
            "cluster", "skipped", 0.0, "needs CUDA (command lines parsed): " + shlex.join(cli_args(up))
        )
    import httpx

    (run.logs / "cluster").mkdir(exist_ok=True)
    log = open(run.logs / "cluster_up.log", "w")
    server = subprocess.Popen(up, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + min(240.0, run.left_s())
        while time.monotonic() < deadline:
            if server.poll() is not None:
                return StageResult("cluster", "failed", 0.0, f"pdserve up exited with {server.returncode}")
            try:
                if httpx.get("http://127.0.0.1:31900/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            return StageResult("cluster", "failed", 0.0, "not healthy within 240 s")
        rc, tail = run.cmd("cluster_bench", bench, 300)
        numbers: dict = {"kv_path": "gloo, staged through pinned host memory"}
        try:
            metrics = json.loads((run.logs / "cluster" / "serving.json").read_text())["runs"][0]["metrics"]
            numbers.update({k: metrics[k] for k in ("completed", "failed", "output_throughput")})
        except (OSError, ValueError, KeyError, IndexError):
            pass
        detail = f"kv path: {numbers['kv_path']}; {numbers.get('completed', '?')} completed, "
        detail += (
            f"{numbers.get('failed', '?')} failed, {numbers.get('output_throughput', 0):.0f} output tok/s"
        )
        return StageResult("cluster", "ok" if rc == 0 else "failed", 0.0, detail, numbers)
    finally:
        _stop(server)
        log.close()


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to `pdserve up`'s process group, SIGKILL after 30 s; nothing when it has exited already."""
    try:
        os.killpg(server.pid, 15)
        server.wait(30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, 9)


def _parse_only(up: list[str], bench: list[str]) -> None:
    """The command lines are accepted by pdserve's own parsers (flags renamed elsewhere fail here)."""
    from pdserve.bench import bench_serving
    from pdserve.launch import up as launcher

    parser = argparse.ArgumentParser(exit_on_error=False)
    launcher.add_cli_args(parser)
    _, rest = parser.parse_known_args(cli_args(up)[1:])  # after "up"
    if rest:
        raise ValueError(f"pdserve up does not take {rest}")
    bench_serving.parse_args(cli_args(bench)[2:])  # after "bench serving"
