"""deploy/Dockerfile: the build context it sees (after its .dockerignore) installs a complete pdserve.

No container runtime is needed: the context is copied the way the ignore file filters it, and the
Dockerfile's `pip install /src` step is run as a wheel build on that copy.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def ignore_patterns() -> list[str]:
    lines = (REPO / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    for pat in patterns:
        pat = pat.removeprefix("**/")
        # A pattern names a path or any of its parents; "**/x" a name at any depth.
        if any(fnmatch.fnmatch("/".join(parts[: i + 1]), pat) for i in range(len(parts))):
            return True
        if any(fnmatch.fnmatch(p, pat) for p in parts):
            return True
    return False


def test_both_variants_and_the_entrypoint():
    text = DOCKERFILE.read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, re.M))
    assert {"base-cuda", "base-cpu"} <= stages
    assert re.search(r"^ARG VARIANT=cuda$", text, re.M) and "FROM base-${VARIANT}" in text
    assert 'ENTRYPOINT ["/usr/bin/tini", "--", "pdserve"]' in text


@pytest.mark.timeout(180)
def test_context_builds_a_complete_package(tmp_path):
    patterns = ignore_patterns()
    src = tmp_path / "src"
    for root, dirs, files in os.walk(REPO):
        base = Path(root).relative_to(REPO).as_posix().removeprefix(".")
        dirs[:] = [d for d in dirs if not ignored(f"{base}/{d}".lstrip("/"), patterns)]
        for f in files:
            rel = f"{base}/{f}".lstrip("/")
            # Only regular files (a dangling link would not reach the image either).
            if not ignored(rel, patterns) and (REPO / rel).is_file():
                (src / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / rel, src / rel)
    assert not (src / ".venv").exists() and not (src / "tests").exists()
    # The image's `pip install /src`, minus the dependencies (they come from the registry there).
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = tmp_path.glob("pdserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dirs.items():
        for module in (REPO / folder).glob("*.py"):
            assert f"{package.replace('.', '/')}/{module.name}" in names, (
                f"{module} is missing from the image"
            )
    # C++ sources are built at first use on the host: they ship as files.
    for source in [*(REPO / "kernels").glob("*.cpp"), *(REPO / "kernels").glob("*.h")]:
        assert f"pdserve/kernels/{source.name}" in names, f"{source} is missing from the image"
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pdserve = pdserve.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
