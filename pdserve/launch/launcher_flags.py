"""The flags of the two launchers, `pdserve up` (pdserve/launch/up.py) and deploy/launch.py: rows of the
flag table (pdserve/launch/flags.py). The worker flags they take are rows of worker_flags.py, the
gateway flags `pdserve up` takes rows of the gateway's config (gateway/config.py)."""

from __future__ import annotations

import socket
import sys

from pdserve import env
from pdserve.launch.cpu_share import CPU_SHARING
from pdserve.launch.flag import LAUNCH, LAUNCHERS, UP, Flag, launch_env
from pdserve.launch.supervisor import RestartPolicy

_UP = frozenset({UP})
_LAUNCH = frozenset({LAUNCH})
_RESTART = RestartPolicy()


def _launch_port() -> int:
    return int(env.launch_default("PDSERVE_PORT", "30000") or 30000)


def _launch_worker_id_prefix() -> str | None:
    return env.launch_default("PDSERVE_WORKER_ID_PREFIX", socket.gethostname() + "-")


# Both launchers: the gateway's ports, the workers, CPU sharing, logs and timeouts.
_SHARED = [
    Flag(
        "--port",
        LAUNCHERS,
        "gateway HTTP port (0: any free port; deploy/launch.sh: env PDSERVE_PORT)",
        type=int,
        default=30000,
        role_default={LAUNCH: _launch_port},
    ),
    Flag("--control-port", LAUNCHERS, "gateway control socket (default port+1; 0: any free port)", type=int),
    Flag(
        "--port-file",
        LAUNCHERS,
        'the gateway writes {"port": ..., "control_port": ...} here once bound (deploy/launch.sh: '
        "default <log-dir>/gateway.ports)",
    ),
    Flag(
        "--num-prefill",
        LAUNCHERS,
        "prefill workers (deploy/launch.sh: on CPU; on GPUs, --prefill-gpus lists them)",
        type=int,
        default=1,
        role_default={LAUNCH: None},
    ),
    Flag(
        "--num-decode",
        LAUNCHERS,
        "decode workers (deploy/launch.sh: on CPU; on GPUs, --decode-gpus lists them)",
        type=int,
        default=1,
        role_default={LAUNCH: None},
    ),
    Flag(
        "--prefill-tp",
        LAUNCHERS,
        "tensor-parallel size of each prefill worker (its --tp-size; deploy/launch.sh: each takes that "
        "many consecutive GPUs of --prefill-gpus)",
        type=int,
        default=1,
    ),
    Flag(
        "--decode-tp",
        LAUNCHERS,
        "tensor-parallel size of each decode worker (its --tp-size; deploy/launch.sh: each takes that "
        "many consecutive GPUs of --decode-gpus)",
        type=int,
        default=1,
    ),
    Flag(
        "--threads-per-worker",
        LAUNCHERS,
        "CPU: torch threads per worker (default: every core; co-located workers share the cores, "
        "see --cpu-sharing)",
        type=int,
    ),
    Flag(
        "--cpu-sharing",
        LAUNCHERS,
        "when the workers' threads outnumber the cores: turns (one forward at a time, threads spin "
        "briefly) or passive (forwards overlap, idle prefill threads sleep at once); see "
        "pdserve/launch/cpu_share.py",
        default="turns",
        choices=CPU_SHARING,
    ),
    Flag(
        "--log-dir",
        LAUNCHERS,
        "write each child's output to <dir>/<name>.log (deploy/launch.sh: env PDSERVE_LOG_DIR)",
        role_default={LAUNCH: launch_env("PDSERVE_LOG_DIR", "pdserve-logs")},
    ),
    Flag("--startup-timeout", LAUNCHERS, "seconds to wait for health", type=float, default=600.0),
    Flag(
        "--stop-timeout",
        LAUNCHERS,
        "seconds to let workers drain on stop",
        type=float,
        default=15.0,
        role_default={LAUNCH: 60.0},
    ),
]

# `pdserve up`: its internal bind address and restarts. The gateway's flags it takes and forwards are
# the gateway's own rows (gateway/config.py: `up=True`).
_UP_ONLY = [
    Flag(
        "--internal-host",
        _UP,
        "bind address of the gateway's control socket and of every worker socket (KV bootstrap, "
        "gloo, health); 0.0.0.0 only if other hosts must reach them",
        default="127.0.0.1",
    ),
    Flag(
        "--max-restarts",
        _UP,
        f"restarts of a crashing child within {_RESTART.window_s:.0f} s after which it is crash-looping: "
        f"retried every {_RESTART.backoff_max_s:.0f} s (never given up on; the launcher goes on)",
        type=int,
        default=_RESTART.max_restarts,
    ),
    Flag(
        "--restart-backoff",
        _UP,
        f"seconds before the first restart of a crashed child; doubles each time, up to "
        f"{_RESTART.backoff_max_s:.0f} s",
        type=float,
        default=_RESTART.backoff_initial_s,
    ),
]

# deploy/launch.py: GPU pins, multi-host topologies, fixed ports.
_LAUNCH_ONLY = [
    Flag(
        "--prefill-gpus",
        _LAUNCH,
        "e.g. 0,1: one prefill per GPU (env PDSERVE_PREFILL_GPUS)",
        default=launch_env("PDSERVE_PREFILL_GPUS"),
    ),
    Flag(
        "--decode-gpus",
        _LAUNCH,
        "e.g. 2,3: one decode per GPU (env PDSERVE_DECODE_GPUS)",
        default=launch_env("PDSERVE_DECODE_GPUS"),
    ),
    Flag("--no-gateway", _LAUNCH, "start workers only; they join --gateway on another host", switch=True),
    Flag(
        "--gateway-only",
        _LAUNCH,
        "start the gateway only (the head of a multi-host setup)",
        switch=True,
    ),
    Flag("--gateway-host", _LAUNCH, "bind address of the gateway (HTTP and control)", default="0.0.0.0"),
    Flag(
        "--gateway-url",
        _LAUNCH,
        "gateway HTTP URL to wait on (default: the local one; with --no-gateway: "
        "wait until this host's workers are listed on <url>/workers, or not at all if unset)",
    ),
    Flag(
        "--bootstrap-port-base",
        _LAUNCH,
        "prefill i listens on base+i (0: any free port)",
        type=int,
        default=8998,
    ),
    Flag(
        "--health-port-base",
        _LAUNCH,
        "worker k (prefill first, then decode) serves /livez, /readyz, /metrics on base+k (0: off)",
        type=int,
        default=0,
    ),
    Flag(
        "--worker-id-prefix",
        _LAUNCH,
        "worker ids are <prefix>prefill-<i>; must differ between hosts (env PDSERVE_WORKER_ID_PREFIX)",
        default=_launch_worker_id_prefix,
    ),
    Flag("--python", _LAUNCH, "interpreter that has pdserve installed", default=sys.executable),
]

LAUNCHER_FLAGS = _SHARED + _UP_ONLY + _LAUNCH_ONLY
