"""What the GPU machine installs, checked: the wheel list covers what its image lacks, and pdserve builds
as a complete wheel offline."""

from __future__ import annotations

import re
import sys
import tempfile
import zipfile
from pathlib import Path

from pdserve.bench.gpu_run import ROOT, Run, StageResult

WHEELS_FILE = ROOT / "benchmarks" / "gpu_wheels.txt"
IMAGE_FILE = ROOT / "benchmarks" / "gpu_image.txt"
PACKAGES = [
    "protocol", "runtime", "runtime/models", "runtime/grammar", "kernels", "kv_transfer", "prefill", "decode",
    "gateway", "gateway/api", "gateway/autopilot", "gateway/cluster", "gateway/generation", "gateway/observe",
    "gateway/text", "gateway/text/function_call", "bench",
]  # fmt: skip


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _listed(path: Path) -> dict[str, str]:
    """name -> version ('' when not pinned) of a list file: names (`name==version`) separated by
    white space, `#` comments."""
    out = {}
    for line in path.read_text().splitlines():
        for item in line.split("#", 1)[0].split():
            name, _, version = item.partition("==")
            out[_norm(name)] = version
    return out


def missing_on_gpu() -> tuple[list[str], list[str]]:
    """(packages pdserve needs, recursively, that neither the GPU image nor the wheel list has;
    wheel-list entries whose pinned version differs from what this environment runs)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    image, wheels = _listed(IMAGE_FILE), _listed(WHEELS_FILE)
    seen: set[str] = set()
    missing, stale = [], []
    todo = [r for r in md.requires("pdserve") or [] if "extra ==" not in r]
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _norm(req.name)
        if name in seen or name in image:
            continue
        seen.add(name)
        if name not in wheels:
            missing.append(name)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        if name in wheels and wheels[name] and wheels[name] != dist.version:
            stale.append(f"{name} {wheels[name]} (here {dist.version})")
        todo += [r for r in dist.requires or [] if "extra ==" not in r]
    return sorted(missing), sorted(stale)


def stage_wheels(run: Run) -> StageResult:
    if not run.dry_run:
        wheels = sorted(p.name for p in (ROOT / ".gpu" / "wheels").glob("*.whl"))
        return StageResult("wheels", "ok", 0.0, f"{len(wheels)} wheels carried", {"wheels": wheels})
    missing, stale = missing_on_gpu()
    numbers = {"missing": missing, "stale": stale, "listed": sorted(_listed(WHEELS_FILE))}
    if missing or stale:
        why = f"not on the GPU image nor in {WHEELS_FILE.name}: {missing}; other versions: {stale}"
        return StageResult("wheels", "failed", 0.0, why, numbers)
    return StageResult(
        "wheels", "ok", 0.0, f"{len(numbers['listed'])} wheels cover what the image lacks", numbers
    )


def stage_packaging(run: Run) -> StageResult:
    """Build pdserve's wheel offline (what gpu_check.sh installs there) and look inside."""
    with tempfile.TemporaryDirectory() as tmp:
        rc, tail = run.cmd(
            "packaging",
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
             "-q", "-w", tmp, str(ROOT)],
            300,
        )  # fmt: skip
        if rc != 0:
            return StageResult("packaging", "failed", 0.0, f"pip wheel failed: {tail[-300:]}")
        (wheel,) = Path(tmp).glob("pdserve-*.whl")
        names = set(zipfile.ZipFile(wheel).namelist())
    want = ["pdserve/cli.py", "pdserve/protocol/codec.py", "pdserve/bench/gpu_check.py"]
    want += ["pdserve/gateway/api/static/dashboard.html"]
    want += [f"pdserve/{p}/__init__.py" for p in PACKAGES]
    want += [f"pdserve/kernels/{k.name}" for k in (ROOT / "kernels").glob("*.py")]
    absent = [w for w in want if w not in names]
    if absent:
        return StageResult("packaging", "failed", 0.0, f"the wheel lacks {absent}")
    return StageResult("packaging", "ok", 0.0, f"{wheel.name}: {len(names)} files", {"files": len(names)})
