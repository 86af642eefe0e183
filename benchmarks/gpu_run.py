"""The GPU check's harness: the output folder, the time budget, each stage's result and each command's log."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Run from a checkout's root (the tests, the lists and the sources are read from there); pdserve itself
# may be installed elsewhere, as on the GPU machine.
ROOT = Path.cwd()


@dataclass
class StageResult:
    name: str
    status: str  # ok | failed | skipped
    seconds: float
    detail: str = ""
    numbers: dict = field(default_factory=dict)


class Run:
    """The output folder, the clock and the stages' results."""

    def __init__(self, out: Path, dry_run: bool, budget_s: float) -> None:
        self.out, self.dry_run, self.budget_s = out, dry_run, budget_s
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.results: list[StageResult] = []
        self.cuda = _cuda_available()

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def cmd(self, name: str, argv: list[str], timeout_s: float, env: dict | None = None) -> tuple[int, str]:
        """Run `argv` (cwd: the repo) with its output in logs/<name>.log; (exit status, output tail)."""
        log = self.logs / f"{name}.log"
        timeout_s = max(10.0, min(timeout_s, self.left_s()))
        with open(log, "w") as f:
            f.write(f"$ {shlex.join(argv)}\n")
            f.flush()
            try:
                p = subprocess.run(
                    argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                    env={**os.environ, **(env or {})},
                )  # fmt: skip
                rc = p.returncode
            except subprocess.TimeoutExpired:
                f.write(f"\n[timed out after {timeout_s:.0f} s]\n")
                rc = 124
        return rc, log.read_text()[-2000:]

    def stage(self, name: str, fn: Callable[[Run], StageResult | None]) -> None:
        t = time.monotonic()
        if self.left_s() <= 0:
            result = StageResult(name, "skipped", 0.0, "the time budget was spent")
        else:
            try:
                result = fn(self) or StageResult(name, "ok", 0.0)
            except Exception as e:  # noqa: BLE001 - a broken stage is reported, the next one runs
                result = StageResult(name, "failed", 0.0, f"{type(e).__name__}: {e}")
        result.name, result.seconds = name, round(time.monotonic() - t, 2)
        self.results.append(result)
        print(f"[{result.seconds:7.1f} s] {name:<16} {result.status:<7} {result.detail}", flush=True)


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def cli_args(argv: list[str]) -> list[str]:
    """A pdserve command line from `pdserve.cli` on: what follows the interpreter and its options."""
    return argv[argv.index("pdserve.cli") + 1 :]
