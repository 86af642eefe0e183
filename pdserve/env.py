"""Every environment variable pdserve reads, in one place; nothing else calls os.environ.get.

Variables only supply defaults: the matching command-line flag, where there is one, wins. They are
read when a process starts (argument parsing) or when a path is first needed, never in a loop.

  PDSERVE_MODEL_PATH      --model-path: HF folder or .gguf file (unset: the bundled SmolLM2-135M)
  PDSERVE_GATEWAY         --gateway: host:port of the gateway's control socket (workers)
  PDSERVE_WORKER_ID       --worker-id: this worker's id (Kubernetes: the pod name)
  PDSERVE_HOST            --host: the address peers reach this worker at (Kubernetes: the pod IP)
  PDSERVE_BOOTSTRAP_PORT  --disaggregation-bootstrap-port: the prefill's KV bootstrap port (8998)
  PDSERVE_HEALTH_PORT     --health-port: /livez, /readyz and /metrics of a worker (0: off)
  PDSERVE_LOG_LEVEL       --log-level of a worker (info)
  PDSERVE_CLUSTER_SECRET  the cluster secret (pdserve/cluster_auth.py) when --cluster-secret-file is
                          not given: gateway and workers (`pdserve up` sets it for its children)
  PDSERVE_API_KEY         --api-key of the gateway (HTTP inference endpoints; gateway/api/auth.py)
  PDSERVE_ADMIN_API_KEY   --admin-api-key of the gateway (its operational endpoints)
  PDSERVE_CACHE_DIR       cache folder: dequantized GGUF weights, saved tokenizers
                          (unset: $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve)
  PDSERVE_CPU_ISA         caps the CPU instructions pdserve and torch use: native (default), avx512,
                          avx2 (kernels/cpu_isa.py; the CLI then sets ATEN_CPU_CAPABILITY,
                          ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS for torch where unset)
  GLOO_SOCKET_IFNAME      network interface of the KV pair groups when TransferConfig.socket_ifname
                          is unset (gloo's own variable)
  OMP_WAIT_POLICY         read by the launchers only to leave a user's choice alone (OpenMP's own)
  GOMP_SPINCOUNT          the same (libgomp's own; pdserve/launch/cpu_share.py)

deploy/launch.sh reads defaults for its flags of the same meaning (`launch_default`):
  PDSERVE_DEVICE, PDSERVE_PREFILL_GPUS, PDSERVE_DECODE_GPUS, PDSERVE_MODEL_PATH, PDSERVE_PORT,
  PDSERVE_GATEWAY, PDSERVE_HOST, PDSERVE_WORKER_ID_PREFIX, PDSERVE_LOG_DIR

Test hooks are not read from the environment: they are hidden worker flags (pdserve/launch/worker_flags.py).
"""

from __future__ import annotations

import os


def _get(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def model_path() -> str | None:
    return _get("PDSERVE_MODEL_PATH")


def gateway_addr() -> str:
    return _get("PDSERVE_GATEWAY", "127.0.0.1:30001")  # type: ignore[return-value]


def worker_id() -> str:
    return _get("PDSERVE_WORKER_ID", "")  # type: ignore[return-value]


def host() -> str:
    return _get("PDSERVE_HOST", "127.0.0.1")  # type: ignore[return-value]


def _int(name: str, default: int) -> int:
    value = _get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def bootstrap_port() -> int:
    return _int("PDSERVE_BOOTSTRAP_PORT", 8998)


def health_port() -> int:
    return _int("PDSERVE_HEALTH_PORT", 0)


def log_level() -> str:
    return _get("PDSERVE_LOG_LEVEL", "info")  # type: ignore[return-value]


def cluster_secret() -> str | None:
    return _get("PDSERVE_CLUSTER_SECRET")


CLUSTER_SECRET_VAR = "PDSERVE_CLUSTER_SECRET"


def api_key() -> str | None:
    return _get("PDSERVE_API_KEY")


def admin_api_key() -> str | None:
    return _get("PDSERVE_ADMIN_API_KEY")


def cpu_isa_cap() -> str | None:
    return _get("PDSERVE_CPU_ISA")


def quant_cache_enabled() -> bool:
    """PDSERVE_QUANT_CACHE=0: quantize at every start, never read or write runtime/quant_cache.py's files."""
    return _get("PDSERVE_QUANT_CACHE", "1") != "0"


def tp_shm_allreduce() -> bool:
    """PDSERVE_TP_ALLREDUCE=gloo: a CPU TP worker's ranks all-reduce over gloo, not shared memory
    (runtime/tp_shm.py; `pdserve bench tp` compares the two)."""
    return _get("PDSERVE_TP_ALLREDUCE", "shm") != "gloo"


def cache_dir() -> str:
    """The root of pdserve's caches (one variable for every process: gateway and workers)."""
    base = _get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return _get("PDSERVE_CACHE_DIR") or os.path.join(base, "pdserve")


def gloo_socket_ifname() -> str | None:
    return _get("GLOO_SOCKET_IFNAME")


def omp_wait_policy_set() -> bool:
    return "OMP_WAIT_POLICY" in os.environ


def gomp_spincount_set() -> bool:
    return "GOMP_SPINCOUNT" in os.environ


LAUNCH_VARS = (
    "PDSERVE_DEVICE",
    "PDSERVE_PREFILL_GPUS",
    "PDSERVE_DECODE_GPUS",
    "PDSERVE_MODEL_PATH",
    "PDSERVE_PORT",
    "PDSERVE_GATEWAY",
    "PDSERVE_HOST",
    "PDSERVE_WORKER_ID_PREFIX",
    "PDSERVE_LOG_DIR",
)


def launch_default(name: str, default: str | None = None) -> str | None:
    """The default deploy/launch.sh takes for a flag from one of LAUNCH_VARS."""
    if name not in LAUNCH_VARS:
        raise KeyError(f"{name} is not a launcher variable")
    return _get(name, default)
