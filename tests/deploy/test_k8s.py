"""deploy/k8s: each overlay builds, validates against the Kubernetes schemas, and hangs together.

Cross-references checked on the built objects: Service and PDB selectors match pod labels, probe
and Service ports exist in the containers, the environment the workers read is set, the worker
command lines parse with pdserve's own argument parsers, GPU requests equal limits, /dev/shm is
memory-backed, the grace period outlasts the drain, scrape annotations name a real port, every pod
reads the cluster secret from the Secret the manifests make, and the NetworkPolicies let only the
cluster's own pods reach the control and KV ports.
"""

from __future__ import annotations

import argparse
import copy
import re
import secrets
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ["gpu", "gpu-tp", "cpu-demo"]
K8S_VERSION = "1.32"
WORKERS = ("prefill", "decode")
POD_IP, POD_NAME = "10.1.2.3", "pdserve-x-0"


@pytest.fixture(scope="module", params=OVERLAYS)
def built(request, tmp_path_factory, require_tool) -> tuple[str, list[dict]]:
    kubectl = require_tool("kubectl", hint="the test extra installs it: pip install -e '.[test]'")
    # A copy with the cluster secret file a deployment makes first (it is never committed).
    k8s = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, k8s)
    (k8s / "base" / "cluster-secret").write_text(secrets.token_hex(32))
    out = subprocess.run(
        [kubectl, "kustomize", str(k8s / "overlays" / request.param)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return request.param, [d for d in yaml.safe_load_all(out.stdout) if d]


def objs(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in objs(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def workloads(docs: list[dict]) -> list[dict]:
    return objs(docs, "Deployment") + objs(docs, "StatefulSet")


def component(w: dict) -> str:
    return w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def container(w: dict) -> dict:
    cs = w["spec"]["template"]["spec"]["containers"]
    assert len(cs) == 1
    return cs[0]


def config(docs: list[dict], c: dict) -> dict[str, str]:
    """Every env var the container gets: its ConfigMaps, then its own env (fieldRefs filled in)."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(one(docs, "ConfigMap", src["configMapRef"]["name"])["data"])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = {"status.podIP": POD_IP, "metadata.name": POD_NAME}[field]
    return env


def container_port(c: dict, port: int | str) -> int:
    for p in c.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    raise AssertionError(f"port {port!r} is not a port of container {c['name']}")


def argv_of(c: dict, env: dict[str, str]) -> list[str]:
    """The argv the container's shell line execs, expanded by a real shell with the pod's env."""
    assert c["command"] == ["/bin/sh", "-c"]
    line = c["args"][0]
    assert line.startswith("exec pdserve "), line
    script = "printf '%s\\0' " + line.removeprefix("exec pdserve ")
    out = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split("\0")[:-1]


def test_every_object_validates(built):
    _, docs = built
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "StatefulSet",
    ]
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_validation_rejects_a_broken_object(built):
    # The schema check above can fail: a misspelled field and a wrong type are caught.
    _, docs = built
    bad = copy.deepcopy(one(docs, "StatefulSet", "pdserve-decode"))
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(one(docs, "Service", "pdserve-gateway"))
    bad["spec"]["ports"][0]["port"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_selectors_and_ports_match(built):
    _, docs = built
    assert sorted(component(w) for w in workloads(docs)) == ["decode", "gateway", "prefill"]
    for w in workloads(docs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for svc in objs(docs, "Service"):
        sel = svc["spec"]["selector"]
        matched = [
            w for w in workloads(docs) if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matched) == 1, f"Service {svc['metadata']['name']} selects {len(matched)} workloads"
        for p in svc["spec"]["ports"]:
            container_port(container(matched[0]), p.get("targetPort", p["port"]))
    for sts in objs(docs, "StatefulSet"):
        svc = one(docs, "Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None", "a StatefulSet's service must be headless"
    pdbs = {component_of_selector(p["spec"]["selector"]) for p in objs(docs, "PodDisruptionBudget")}
    assert pdbs == {"prefill", "decode"}
    for p in objs(docs, "PodDisruptionBudget"):
        assert p["spec"].get("maxUnavailable", 0) >= 1 or "minAvailable" in p["spec"]


def component_of_selector(sel: dict) -> str:
    return sel["matchLabels"]["app.kubernetes.io/component"]


def test_probes_and_scrape_ports_exist(built):
    _, docs = built
    for w in workloads(docs):
        c = container(w)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in c, f"{component(w)} has no {probe}"
            container_port(c, c[probe]["httpGet"]["port"])
        ann = w["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        container_port(c, int(ann["prometheus.io/port"]))
        assert ann["prometheus.io/path"] == "/metrics"


def test_workers_get_what_they_read_and_drain_in_time(built, monkeypatch, tmp_path):
    overlay, docs = built
    gateway = one(docs, "Deployment", "pdserve-gateway")
    for role in WORKERS:
        sts = one(docs, "StatefulSet", f"pdserve-{role}")
        spec, c = sts["spec"]["template"]["spec"], container(sts)
        env = config(docs, c)
        # The gateway through its control Service, published before the gateway is ready.
        host, port = env["PDSERVE_GATEWAY"].rsplit(":", 1)
        svc = one(docs, "Service", host)
        assert svc["spec"]["publishNotReadyAddresses"] is True
        (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
        assert container_port(container(gateway), sp["targetPort"]) == int(port)
        # The pod IP and name through the downward API.
        assert env["PDSERVE_HOST"] == POD_IP and env["PDSERVE_WORKER_ID"] == POD_NAME
        # Probes hit the worker's health port.
        assert container_port(c, c["livenessProbe"]["httpGet"]["port"]) == int(env["PDSERVE_HEALTH_PORT"])
        if role == "prefill":
            assert container_port(c, "bootstrap") == int(env["PDSERVE_BOOTSTRAP_PORT"])
        # Start-up covers weight loading; readiness answers fast so a draining pod leaves at once.
        start = c["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 600
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["readinessProbe"]["periodSeconds"] * c["readinessProbe"]["failureThreshold"] <= 10
        assert "kill -TERM 1" in " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
        assert spec["terminationGracePeriodSeconds"] > float(env["PDSERVE_DRAIN_TIMEOUT"])
        # A memory-backed /dev/shm.
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert vol["emptyDir"]["medium"] == "Memory"
        # The command line, expanded as the container's shell does, parses with pdserve's parser.
        # Flag defaults come from the environment when the parser is built, as in the pod.
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        cfg = _worker_config(role, argv_of(c, env), tmp_path)
        assert cfg.keys is not None
        assert cfg.gateway_addr == env["PDSERVE_GATEWAY"] and cfg.host == POD_IP
        assert cfg.worker_id == POD_NAME and cfg.drain_timeout_s == float(env["PDSERVE_DRAIN_TIMEOUT"])
        assert cfg.runtime.device == {"gpu": "cuda", "gpu-tp": "cuda", "cpu-demo": "cpu"}[overlay]
        if overlay.startswith("gpu"):  # a TP worker's pod has a GPU for each of its ranks
            assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == cfg.runtime.tp_size
        if overlay == "gpu-tp":
            assert cfg.runtime.tp_size == {"prefill": 2, "decode": 1}[role]
        if role == "prefill":
            assert cfg.bootstrap_port == container_port(c, "bootstrap")
        if hasattr(cfg, "health_port"):
            assert cfg.health_port == container_port(c, "health")


def _worker_config(role: str, argv: list[str], tmp_path):
    from pdserve.config import worker_config_from_args
    from pdserve.launch.flags import add_flags

    assert argv[0] == role
    # The secret file is the kubelet's to write (checked in the cluster secret test): one like it here.
    at = argv.index("--cluster-secret-file") + 1
    secret = tmp_path / "cluster-secret"
    secret.write_text(secrets.token_hex(32))
    argv = argv[:at] + [str(secret)] + argv[at + 1 :]
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, role)
    return worker_config_from_args(p.parse_args(argv[1:]), role)


def test_gateway_command_parses(built):
    from pdserve.gateway.config import add_cli_args, config_from_args

    _, docs = built
    c = container(one(docs, "Deployment", "pdserve-gateway"))
    argv = argv_of(c, config(docs, c))
    assert argv[0] == "gateway"
    p = argparse.ArgumentParser(exit_on_error=False)
    add_cli_args(p)
    cfg = config_from_args(p.parse_args(argv[1:]))
    assert cfg.port == container_port(c, "http") and cfg.control_port == container_port(c, "control")
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    strategy = one(docs, "Deployment", "pdserve-gateway")["spec"]
    assert strategy["replicas"] == 1 and strategy["strategy"]["type"] == "Recreate"


def test_gpu_requests_equal_limits(built):
    overlay, docs = built
    for w in workloads(docs):
        res = container(w).get("resources", {})
        req, lim = res.get("requests", {}), res.get("limits", {})
        assert req.get("nvidia.com/gpu") == lim.get("nvidia.com/gpu")
        if overlay.startswith("gpu") and component(w) in WORKERS:
            assert int(lim["nvidia.com/gpu"]) >= 1
        else:
            assert "nvidia.com/gpu" not in lim
    if overlay.startswith("gpu"):
        assert all(w["spec"]["replicas"] == 2 for w in objs(docs, "StatefulSet"))


def test_shell_lines_only_use_defined_variables(built):
    _, docs = built
    for w in workloads(docs):
        c = container(w)
        env = config(docs, c)
        used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", c["args"][0]))
        assert used <= env.keys(), used - env.keys()


def test_every_pod_reads_the_cluster_secret_the_manifests_make(built, tmp_path, monkeypatch):
    import base64

    from pdserve.cluster_auth import load_keys

    _, docs = built
    (secret,) = objs(docs, "Secret")
    keys = []
    for w in workloads(docs):
        spec, c = w["spec"]["template"]["spec"], container(w)
        (vol,) = [
            v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == secret["metadata"]["name"]
        ]
        assert vol["secret"]["defaultMode"] == 0o400
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
        assert mount["readOnly"] is True
        argv = argv_of(c, config(docs, c))
        path = argv[argv.index("--cluster-secret-file") + 1]
        assert path.startswith(mount["mountPath"] + "/")
        # The file the kubelet writes there, read as the pod's process reads it.
        local = tmp_path / path.rsplit("/", 1)[1]
        local.write_bytes(base64.b64decode(secret["data"][local.name]))
        monkeypatch.delenv("PDSERVE_CLUSTER_SECRET", raising=False)
        keys.append(load_keys(str(local)))
    assert keys[0] is not None and all(k == keys[0] for k in keys)  # one secret for every pod


def _selects(selector: dict, labels: dict[str, str] | None) -> bool:
    if labels is None:  # not a pod of this namespace: outside traffic
        return False
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In"
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def _admits(docs: list[dict], target: str, source: str | None, port: int) -> bool:
    """Whether the NetworkPolicies let a pod of component `source` (None: anything outside the
    cluster's pods) reach `port` on a pod of component `target`."""
    labels = {c: w["spec"]["template"]["metadata"]["labels"] for w in workloads(docs) for c in [component(w)]}
    policies = [p for p in objs(docs, "NetworkPolicy") if _selects(p["spec"]["podSelector"], labels[target])]
    assert policies, f"no NetworkPolicy selects the {target} pods"
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            ports = [x["port"] for x in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            peers = rule.get("from")
            if not peers or any(_selects(f["podSelector"], labels.get(source or "")) for f in peers):
                return True
    return False


def test_network_policies_fence_the_control_and_kv_ports(built):
    _, docs = built
    for p in objs(docs, "NetworkPolicy"):
        assert p["spec"]["policyTypes"] == ["Ingress"]
    gateway = container(one(docs, "Deployment", "pdserve-gateway"))
    http, control = container_port(gateway, "http"), container_port(gateway, "control")
    prefill = container(one(docs, "StatefulSet", "pdserve-prefill"))
    bootstrap, health = container_port(prefill, "bootstrap"), container_port(prefill, "health")
    store = 41234  # gloo binds free ports: the policy must fence every port
    assert _admits(docs, "gateway", None, http)
    assert not _admits(docs, "gateway", None, control)
    assert _admits(docs, "gateway", "prefill", control) and _admits(docs, "gateway", "decode", control)
    for port in (bootstrap, store):
        assert not _admits(docs, "prefill", None, port) and _admits(docs, "prefill", "decode", port)
        assert not _admits(docs, "prefill", "gateway", port)
    assert not _admits(docs, "decode", None, store) and _admits(docs, "decode", "prefill", store)
    for role in WORKERS:  # probes and Prometheus
        assert _admits(docs, role, None, health)
