"""Port files: how a process that bound port 0 tells its launcher which ports it got.

The writer binds first and then writes `{"port": ..., "control_port": ...}` atomically (a rename),
so a reader never sees a half-written file, and a port it reads is already held by the writer:
no bind-then-close race, where a free port is picked, released and then taken by someone else.
"""

from __future__ import annotations

import json
import os
import subprocess
import time


def write_port_file(path: str, ports: dict[str, int]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(ports, f)
    os.replace(tmp, path)


def wait_port_file(
    path: str, proc: subprocess.Popen[bytes] | None = None, timeout_s: float = 120.0
) -> dict[str, int]:
    """The ports written to `path`; raises if `proc` (the writer) exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as f:
                ports = json.load(f)
            if isinstance(ports, dict) and all(isinstance(v, int) for v in ports.values()):
                return ports
        except (OSError, ValueError):
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before writing its ports to {path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no ports written to {path} within {timeout_s:.0f} s")
        time.sleep(0.05)
