"""deploy/launch.py's plan: which processes it would start on GPUs, with which pins, ports and flags.

The GPU topology cannot run here; its command lines are checked against pdserve's own parsers.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.launch.supervisor import pdserve_command

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def launch():
    spec = importlib.util.spec_from_file_location("pdserve_deploy_launch", REPO / "deploy" / "launch.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        del sys.modules[spec.name]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    # The launcher's defaults come from these; the tests spell everything out.
    for var in (
        "PDSERVE_PREFILL_GPUS",
        "PDSERVE_DECODE_GPUS",
        "PDSERVE_GATEWAY",
        "PDSERVE_DEVICE",
        "PDSERVE_HOST",
    ):
        monkeypatch.delenv(var, raising=False)


def _role_args(argv: list[str]) -> list[str]:
    """`argv` from the pdserve command on: its role, then the role's flags."""
    return argv[argv.index("pdserve.cli") + 1 :]


def _parse_worker(argv: list[str]):
    from pdserve.config import worker_config_from_args
    from pdserve.launch.flags import add_flags

    role, *flags = _role_args(argv)
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, role)
    args, unknown = p.parse_known_args(flags)
    return worker_config_from_args(args, role), unknown


def test_gpu_lists_pin_one_worker_per_gpu(launch):
    args = launch.parse_args(
        [
            "--prefill-gpus",
            "0,1",
            "--decode-gpus",
            "2,3",
            "--worker-id-prefix",
            "h-",
            "--",
            "--page-size",
            "32",
        ]
    )
    children = launch.plan(args)
    assert [c.name for c in children] == ["gateway", "prefill-0", "prefill-1", "decode-0", "decode-1"]
    pins = {c.name: c.env.get("CUDA_VISIBLE_DEVICES") for c in children[1:]}
    assert pins == {"prefill-0": "0", "prefill-1": "1", "decode-0": "2", "decode-1": "3"}
    for c in children[1:]:
        cfg, unknown = _parse_worker(c.argv)
        assert unknown == [] and cfg.runtime.device == "cuda" and cfg.runtime.page_size == 32
        assert cfg.gateway_addr == "127.0.0.1:30001" and cfg.worker_id == "h-" + c.name
        if cfg.role == "prefill":
            assert cfg.bootstrap_port == 8998 + int(c.name[-1])
        assert "--num-threads" not in c.argv  # GPU workers keep torch's default


def test_tp_workers_take_consecutive_gpus(launch):
    args = launch.parse_args(
        ["--prefill-gpus", "0,1,2,3", "--decode-gpus", "4,5,6,7", "--prefill-tp", "2", "--decode-tp", "4"]
    )
    children = launch.plan(args)
    assert [c.name for c in children] == ["gateway", "prefill-0", "prefill-1", "decode-0"]
    pins = {c.name: c.env.get("CUDA_VISIBLE_DEVICES") for c in children[1:]}
    assert pins == {"prefill-0": "0,1", "prefill-1": "2,3", "decode-0": "4,5,6,7"}
    sizes = {c.name: _parse_worker(c.argv)[0].runtime.tp_size for c in children[1:]}
    assert sizes == {"prefill-0": 2, "prefill-1": 2, "decode-0": 4}
    with pytest.raises(SystemExit):  # 3 GPUs do not make TP-2 workers
        launch.parse_args(["--prefill-gpus", "0,1,2", "--decode-gpus", "3", "--prefill-tp", "2"])


def test_up_gives_each_role_its_tp_size():
    from pdserve.launch.up import add_cli_args, worker_commands

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    cmds = dict(worker_commands(parser.parse_args(["--prefill-tp", "3"])))
    assert _parse_worker(cmds["prefill-0"])[0].runtime.tp_size == 3
    assert _parse_worker(cmds["decode-0"])[0].runtime.tp_size == 1


def test_cpu_counts_and_worker_only_hosts(launch):
    args = launch.parse_args(
        ["--device", "cpu", "--num-prefill", "2", "--num-decode", "1", "--threads-per-worker", "3"]
    )
    children = launch.plan(args)
    assert [c.name for c in children] == ["gateway", "prefill-0", "prefill-1", "decode-0"]
    assert all(c.env["CUDA_VISIBLE_DEVICES"] == "" for c in children[1:])
    cfg, _ = _parse_worker(children[1].argv)
    assert cfg.runtime.device == "cpu" and cfg.runtime.num_threads == 3

    args = launch.parse_args(
        ["--no-gateway", "--gateway", "10.0.0.1:30001", "--host", "10.0.0.2", "--prefill-gpus", "4,5"]
    )
    children = launch.plan(args)
    assert [c.name for c in children] == ["prefill-0", "prefill-1"]
    cfg, _ = _parse_worker(children[0].argv)
    assert cfg.gateway_addr == "10.0.0.1:30001" and cfg.host == "10.0.0.2"
    assert [c.name for c in launch.plan(launch.parse_args(["--gateway-only"]))] == ["gateway"]


@pytest.mark.parametrize(
    "argv",
    [
        [],  # nothing to start
        ["--prefill-gpus", "0"],  # a local cluster without a decode worker
        ["--num-prefill", "1", "--num-decode", "1"],  # counts are for CPU; GPUs are listed
        ["--no-gateway", "--prefill-gpus", "0"],  # where is the gateway?
        ["--no-gateway", "--gateway-only", "--gateway", "a:1"],
    ],
)
def test_bad_topologies_are_refused(launch, argv):
    with pytest.raises(SystemExit) as e:
        launch.parse_args(argv)
    assert e.value.code == 2


def test_cpu_workers_get_every_core_and_take_turns_when_they_share(launch, monkeypatch):
    """Default: every CPU worker may use every core, so workers share cores, and then every forward
    takes one lock file (the same path for all workers of a launcher) and prefill threads spin briefly
    (GOMP_SPINCOUNT) while decode ones keep libgomp's default, in both launchers. --cpu-sharing
    passive: no lock, prefill threads sleep at once (OMP_WAIT_POLICY=PASSIVE). An even split asked for
    with --threads-per-worker shares nothing and sets nothing. A user's own OpenMP settings win."""
    import os

    from pdserve.launch.up import add_cli_args, cpu_plan, worker_commands

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    cpu = ["--device", "cpu", "--num-prefill", "1", "--num-decode", "1", "--log-dir", "/tmp/logs-x"]
    locks = set()
    for c in launch.plan(launch.parse_args(cpu))[1:]:
        cfg, _ = _parse_worker(c.argv)
        assert cfg.runtime.num_threads == 4
        locks.add(cfg.runtime.cpu_forward_lock)
        assert "OMP_WAIT_POLICY" not in c.env
        assert c.env.get("GOMP_SPINCOUNT") == ("10000" if c.name.startswith("prefill") else None), c.name
    assert locks == {"/tmp/logs-x/cpu-forward.lock"}
    for c in launch.plan(launch.parse_args([*cpu, "--cpu-sharing", "passive"]))[1:]:
        cfg, _ = _parse_worker(c.argv)
        assert cfg.runtime.cpu_forward_lock is None and "GOMP_SPINCOUNT" not in c.env
        assert c.env.get("OMP_WAIT_POLICY") == ("PASSIVE" if c.name.startswith("prefill") else None), c.name
    for c in launch.plan(launch.parse_args([*cpu, "--threads-per-worker", "2"]))[1:]:
        cfg, _ = _parse_worker(c.argv)
        assert cfg.runtime.num_threads == 2 and cfg.runtime.cpu_forward_lock is None
        assert "OMP_WAIT_POLICY" not in c.env and "GOMP_SPINCOUNT" not in c.env

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    shared, even = parser.parse_args([]), parser.parse_args(["--threads-per-worker", "2"])
    workers = [argv for name, argv in worker_commands(shared, lock_path="/run/x.lock") if name != "gateway"]
    assert all(argv[argv.index("--num-threads") + 1] == "4" for argv in workers)
    assert all(argv[argv.index("--cpu-forward-lock") + 1] == "/run/x.lock" for argv in workers)
    assert cpu_plan(even, "/run/x.lock").flags() == ["--num-threads", "2"]
    assert cpu_plan(even).env("prefill") == {}
    assert cpu_plan(shared).env("prefill") == {"GOMP_SPINCOUNT": "10000"}
    assert cpu_plan(shared).env("decode") == {}
    passive = parser.parse_args(["--cpu-sharing", "passive"])
    assert cpu_plan(passive).env("prefill") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert "--cpu-forward-lock" not in cpu_plan(passive, "/run/x.lock").flags()
    monkeypatch.setenv("GOMP_SPINCOUNT", "500")
    assert cpu_plan(shared).env("prefill") == {}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cpu_plan(passive).env("prefill") == {}
    children = launch.plan(launch.parse_args(cpu))
    assert all("OMP_WAIT_POLICY" not in c.env and "GOMP_SPINCOUNT" not in c.env for c in children)


def test_up_forwards_disable_radix_cache_to_every_worker():
    from pdserve.launch.up import add_cli_args, worker_commands

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    for flags, disabled in (([], False), (["--disable-radix-cache"], True)):
        workers = [argv for name, argv in worker_commands(parser.parse_args(flags)) if name != "gateway"]
        assert len(workers) == 2
        for argv in workers:
            cfg, unknown = _parse_worker(argv)
            assert cfg.runtime.disable_radix_cache is disabled and unknown == []


def test_up_forwards_the_kv_transfer_backend_to_every_worker():
    from pdserve.launch.up import add_cli_args, worker_commands

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    for flags, backend in (([], "auto"), (["--kv-transfer-backend", "gloo"], "gloo")):
        workers = [argv for name, argv in worker_commands(parser.parse_args(flags)) if name != "gateway"]
        assert len(workers) == 2
        for argv in workers:
            cfg, unknown = _parse_worker(argv)
            assert cfg.kv_transfer_backend == backend and unknown == []


def test_up_passes_the_prefill_policy_to_the_gateway():
    from pdserve.gateway.config import add_cli_args as add_gateway_args
    from pdserve.gateway.config import config_from_args
    from pdserve.launch.up import add_cli_args, gateway_command

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    for policy in ("cache_aware", "round_robin"):
        argv = gateway_command(parser.parse_args(["--prefill-policy", policy]))
        gw = argparse.ArgumentParser()
        add_gateway_args(gw)
        assert config_from_args(gw.parse_args(_role_args(argv)[1:])).prefill_policy == policy
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill-policy", "random"])


def test_up_binds_internal_sockets_to_loopback_and_hands_the_secret_by_environment(monkeypatch):
    from pdserve.gateway.config import add_cli_args as add_gateway_args
    from pdserve.gateway.config import config_from_args
    from pdserve.launch.up import add_cli_args, gateway_command, secret_env, worker_commands

    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET", raising=False)
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([])
    gw = argparse.ArgumentParser()
    add_gateway_args(gw)
    assert config_from_args(gw.parse_args(_role_args(gateway_command(args))[1:])).control_host == "127.0.0.1"
    for _, argv in worker_commands(args)[1:]:
        cfg, unknown = _parse_worker(argv)
        assert cfg.host == "127.0.0.1" and cfg.gateway_addr.startswith("127.0.0.1:") and unknown == []
    # A fresh secret per cluster, in the environment only: never on a command line.
    one, two = secret_env(args), secret_env(args)
    secret = one["PDSERVE_CLUSTER_SECRET"]
    assert len(secret) >= 32 and secret != two["PDSERVE_CLUSTER_SECRET"]
    assert all(secret not in " ".join(argv) for _, argv in worker_commands(args))
    # One the user gave is used as it is.
    with_file = parser.parse_args(["--cluster-secret-file", "/run/secret"])
    assert secret_env(with_file) == {}
    assert all("/run/secret" in argv for _, argv in worker_commands(with_file))
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "x" * 32)
    assert secret_env(args) == {}


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--prefill-tp", "2"], "--prefill-tp 2: TP size 2 does not split 9 query heads and 3 KV heads"),
        (["--decode-tp", "0"], "--decode-tp must be >= 1"),
    ],
)
def test_up_refuses_a_tp_size_the_model_does_not_split_before_starting_anything(
    flags, says, tmp_path
) -> None:
    """The bundled model splits only over 3: `pdserve up` says so and exits 2, no worker started (one
    would refuse the split and be restarted in a loop)."""
    out = subprocess.run(
        pdserve_command("up", "--log-dir", str(tmp_path), *flags),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert f"pdserve up: {says}" in out.stderr
    assert not list(tmp_path.iterdir())  # no child ever wrote a log
