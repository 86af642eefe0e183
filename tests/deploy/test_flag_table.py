"""The flag table (pdserve/launch/flags.py) against everything that passes flags to pdserve processes.

Every flag the Kubernetes manifests under deploy/k8s (container command lines and the PDSERVE_*_ARGS
values of their ConfigMaps) and the launchers' generated command lines pass must be one the receiving
role takes, by its exact name: argparse would accept an abbreviation, so a renamed flag could otherwise
drift unnoticed. Every role, the gateway's included, is checked against the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pdserve.launch.flag import (
    DECODE,
    GATEWAY,
    LAUNCH,
    LAUNCHERS,
    PREFILL,
    ROLES,
    TO_GATEWAY,
    TO_WORKERS,
    UP,
    WORKERS,
)
from pdserve.launch.flags import add_flags, flags_of, table

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# The ConfigMap variables the manifests' command lines expand, and the roles that read them.
ARGS_VARS = {
    "PDSERVE_WORKER_ARGS": (PREFILL, DECODE),
    "PDSERVE_PREFILL_ARGS": (PREFILL,),
    "PDSERVE_DECODE_ARGS": (DECODE,),
    "PDSERVE_GATEWAY_ARGS": (GATEWAY,),
}


def known_flags(role: str) -> set[str]:
    """The option strings `role` takes: its rows of the table."""
    return {name for f in flags_of(role) for name in (f.name, *f.aliases)}


def _walk(node: object) -> Iterator[object]:
    yield node
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
    for child in children:
        if isinstance(child, str) and isinstance(node, dict) and child is node.get("patch"):
            yield from _walk(yaml.safe_load(child))  # an inline patch of a kustomization
        else:
            yield from _walk(child)


def manifest_flags(k8s: Path) -> list[tuple[str, str, str]]:
    """(file, role, flag) for every flag the manifests under `k8s` pass to a pdserve role."""
    found = []
    for path in sorted(k8s.rglob("*.yaml")):
        where = str(path.relative_to(k8s))
        for doc in yaml.safe_load_all(path.read_text()):
            for node in _walk(doc):
                if isinstance(node, dict) and isinstance(node.get("containers"), list):
                    for c in node["containers"]:
                        line = " ".join(c.get("command", []) + c.get("args", []))
                        m = re.search(r"\bpdserve (\w+)", line)
                        if m:
                            found += [(where, m.group(1), f) for f in FLAG.findall(line)]
                if isinstance(node, dict) and isinstance(node.get("literals"), list):
                    for literal in node["literals"]:
                        var, _, value = literal.partition("=")
                        for role in ARGS_VARS.get(var, ()):
                            found += [(where, role, f) for f in FLAG.findall(value)]
    return found


def unknown(uses: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    known = {role: known_flags(role) for role in {r for _, r, _ in uses}}
    return [u for u in uses if u[1] not in known or u[2] not in known[u[1]]]


def test_the_manifests_pass_only_flags_of_the_table():
    uses = manifest_flags(K8S)
    roles = {role for _, role, _ in uses}
    assert roles == {PREFILL, DECODE, GATEWAY}, roles
    flags = {f for _, _, f in uses}
    assert {"--drain-timeout", "--cluster-secret-file", "--max-total-tokens", "--control-port"} <= flags
    assert unknown(uses) == []


@pytest.mark.parametrize(
    "path, old, new, bad",
    [
        # A renamed worker flag in a StatefulSet's command line.
        ("base/prefill.yaml", "--drain-timeout", "--drain-timeout-s", (PREFILL, "--drain-timeout-s")),
        # An abbreviation in an overlay's worker flags: argparse takes it, the table does not.
        (
            "overlays/cpu-demo/kustomization.yaml",
            "--num-threads 2",
            "--num-thread 2",
            (PREFILL, "--num-thread"),
        ),
        # A prefill-only flag given to decode workers.
        (
            "base/decode.yaml",
            "$PDSERVE_WORKER_ARGS",
            "--disaggregation-bootstrap-port 8998 $PDSERVE_WORKER_ARGS",
            (DECODE, "--disaggregation-bootstrap-port"),
        ),
        # A misspelled gateway flag.
        ("base/gateway.yaml", "--control-port 30001", "--control-prot 30001", (GATEWAY, "--control-prot")),
    ],
)
def test_a_manifest_with_an_unknown_flag_fails(tmp_path, path, old, new, bad):
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s)
    text = (k8s / path).read_text()
    assert old in text
    (k8s / path).write_text(text.replace(old, new, 1))
    found = [(role, flag) for _, role, flag in unknown(manifest_flags(k8s))]
    assert bad in found and all(flag == bad[1] for _, flag in found), found
    if bad == (PREFILL, "--num-thread"):  # what the check guards against: the parser alone lets it in
        p = argparse.ArgumentParser()
        add_flags(p, PREFILL)
        assert p.parse_args(["--num-thread", "2"]).num_threads == 2


@pytest.fixture(scope="module")
def launch():
    spec = importlib.util.spec_from_file_location(
        "pdserve_deploy_launch_flags", REPO / "deploy" / "launch.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        del sys.modules[spec.name]


def command_flags(name: str, argv: list[str]) -> list[tuple[str, str, str]]:
    """(child, role, flag) for every flag of a child's command line (`... -m pdserve.cli <role> ...`)."""
    role, *rest = argv[argv.index("pdserve.cli") + 1 :]
    return [(name, role, a) for a in rest if FLAG.fullmatch(a)]


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefill-gpus", "0,1", "--decode-gpus", "2", "--health-port-base", "8080", "--model-path", "m"],
        ["--device", "cpu", "--num-prefill", "2", "--num-decode", "1", "--cluster-secret-file", "/s"],
        ["--no-gateway", "--gateway", "10.0.0.1:30001", "--host", "10.0.0.2", "--prefill-gpus", "4"],
        ["--gateway-only", "--log-level", "debug"],
    ],
)
def test_deploy_launch_passes_only_flags_of_the_table(launch, monkeypatch, argv):
    for var in ("PDSERVE_PREFILL_GPUS", "PDSERVE_DECODE_GPUS", "PDSERVE_GATEWAY", "PDSERVE_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    uses = [u for c in launch.plan(launch.parse_args(argv)) for u in command_flags(c.name, c.argv)]
    assert uses and unknown(uses) == []


def test_pdserve_up_passes_only_flags_of_the_table():
    from pdserve.launch.up import add_cli_args, worker_commands

    p = argparse.ArgumentParser()
    add_cli_args(p)
    args = p.parse_args(
        [
            "--cluster-secret-file",
            "/s",
            "--served-model-name",
            "x",
            "--max-request-bytes",
            "9",
            "--enable-trace",
        ]
    )
    uses = [u for name, argv in worker_commands(args, lock_path="/l") for u in command_flags(name, argv)]
    assert {role for _, role, _ in uses} == {GATEWAY, PREFILL, DECODE}
    assert unknown(uses) == []


def test_the_table_hangs_together():
    for role in ROLES:
        names = [n for f in flags_of(role) for n in (f.name, *f.aliases)]
        assert len(names) == len(set(names)), f"{role} declares a flag twice"
        p = argparse.ArgumentParser()
        add_flags(p, role)  # argparse refuses a clash of names or a bad row
    for f in table():
        assert f.roles and f.roles <= ROLES, f.name
        assert f.passed_to <= TO_WORKERS | TO_GATEWAY, f.name
        assert not f.passed_to or f.roles & LAUNCHERS, f"{f.name} is passed on by no launcher"
        # What a launcher hands on, the receiving role takes.
        if f.passed_to & TO_WORKERS:
            assert all(f.name in known_flags(w) for w in WORKERS), f.name
        if f.passed_to & TO_GATEWAY:
            assert f.name in known_flags(GATEWAY), f.name
    # The launchers' own command-line building reads these rows.
    assert {f.name for f in flags_of(UP) if f.passed_to & TO_WORKERS} >= {"--model-path", "--page-size"}
    assert {f.name for f in flags_of(LAUNCH) if f.passed_to & TO_WORKERS} >= {"--device", "--host"}


def test_pdserve_up_hands_the_api_keys_to_the_gateway_by_environment_only():
    from pdserve.launch.up import add_cli_args, key_env, worker_commands

    p = argparse.ArgumentParser()
    add_cli_args(p)
    args = p.parse_args(["--api-key", "k-inference", "--admin-api-key", "k-admin"])
    assert key_env(args) == {"PDSERVE_API_KEY": "k-inference", "PDSERVE_ADMIN_API_KEY": "k-admin"}
    for _, argv in worker_commands(args, lock_path="/l"):
        assert not any("k-inference" in a or "k-admin" in a for a in argv), argv
    assert key_env(p.parse_args([])) == {}


def _gateway_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, GATEWAY)
    return p


def test_every_gateway_field_is_set_by_one_flag_of_its_type(monkeypatch):
    """The gateway's flags are rows of the table declared on its config's fields: with no flags given,
    the config is the dataclass's defaults; every field but one internal grace is some flag's."""
    from dataclasses import fields

    from pdserve.gateway.config import GatewayConfig, config_from_args

    for var in ("PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    assert config_from_args(_gateway_parser().parse_args([])) == GatewayConfig()
    rows = {f.attr: f for f in flags_of(GATEWAY)}
    unset = {f.name for f in fields(GatewayConfig)} - set(rows)
    assert unset == {"prefill_done_grace_s"}, unset
    for f in fields(GatewayConfig):
        default = getattr(GatewayConfig(), f.name)
        if f.name in rows and type(default) in (int, float):
            assert rows[f.name].type is type(default), f"{rows[f.name].name} does not read a {type(default)}"


def _other_value(f, default):
    """A value of row `f` other than its default, as a command line gives it."""
    if f.choices:
        return next(c for c in f.choices if c != default)
    if f.type in (int, float):
        return str(f.type((default or 0) + 3))
    return "/other"


def test_pdserve_up_hands_every_gateway_flag_it_takes_to_the_gateway(monkeypatch):
    """Each gateway flag `pdserve up` takes reaches the gateway's own parser with the value given; the
    ones left at the gateway's default stay off its command line."""
    from pdserve.gateway.config import config_from_args
    from pdserve.launch.up import add_cli_args, gateway_command

    for var in ("PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY", "PDSERVE_MODEL_PATH", "PDSERVE_LOG_LEVEL"):
        monkeypatch.delenv(var, raising=False)
    up = argparse.ArgumentParser()
    add_cli_args(up)
    plain = gateway_command(up.parse_args([]))
    given = [a for a in plain[plain.index("pdserve.cli") + 2 :] if FLAG.fullmatch(a)]
    assert given == ["--port", "--control-host", "--control-port", "--host"], given
    rows = [f for f in flags_of(UP) if f.passed_to & TO_GATEWAY]
    assert {"--served-model-name", "--max-request-bytes", "--enable-trace", "--elastic-confirm"} <= {
        f.name for f in rows
    }
    for f in rows:
        flags = [f.name] if f.switch else [f.name, _other_value(f, f.default_for(GATEWAY))]
        args = up.parse_args(flags)
        argv = gateway_command(args)
        gw = _gateway_parser().parse_args(argv[argv.index("pdserve.cli") + 2 :])
        assert getattr(gw, f.attr) == getattr(args, f.attr) != f.default_for(GATEWAY), f.name
    cfg = config_from_args(_gateway_parser().parse_args(["--elastic", "--elastic-confirm", "5"]))
    assert cfg.elastic is not None and cfg.elastic.confirm == 5
