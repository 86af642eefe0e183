"""A pdserve process started from the checkout's root imports installed packages, not the checkout's folders.

The checkout's top-level `kernels/` is installed as `pdserve.kernels`, but from the root it is also a
package named `kernels`, the import name of the `kernels` distribution that transformers (5.25 on)
imports. `python -m` puts the working folder first on sys.path, so a child started as
`python -m pdserve.cli` from the root (the launchers and the tests did so) found the checkout's
`kernels` and failed in transformers' import: `ImportError: cannot import name 'CUDAProperties'
from 'kernels' (<checkout>/kernels/__init__.py)`. Every pdserve process now starts through
`pdserve_command`, whose `-P` keeps the working folder off sys.path; these tests start children
from the root through it and `spawn`, the function every launcher uses.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.launch.supervisor import pdserve_command, spawn

REPO = Path(__file__).resolve().parents[2]

# Where `import kernels` would come from: a file's path, the folders of a namespace package, or None.
PROBE = (
    "import importlib.util\n"
    "spec = importlib.util.find_spec('kernels')\n"
    "print(None if spec is None else spec.origin or list(spec.submodule_search_locations or []))\n"
)


def _run(argv: list[str], tmp_path: Path, timeout_s: float) -> tuple[int, str]:
    log = tmp_path / "child.log"
    p = spawn(argv, str(log))
    try:
        rc = p.wait(timeout=timeout_s)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return rc, log.read_text()


def _probe_argv(interpreter: list[str]) -> list[str]:
    """`interpreter` (an argv's part before `-m pdserve.cli`) running PROBE instead."""
    return [*interpreter, "-c", PROBE]


def _inside_checkout(found: str) -> bool:
    return str(REPO) in found and f"{os.sep}site-packages{os.sep}" not in found


def test_kernels_does_not_resolve_inside_the_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = pdserve_command()
    interpreter = argv[: argv.index("-m")]  # the interpreter and its options, as every child gets them
    rc, out = _run(_probe_argv(interpreter), tmp_path, 60)
    assert rc == 0, out
    found = out.strip().splitlines()[-1]
    assert found == "None" or not _inside_checkout(found), f"`import kernels` resolves to {found}"
    # The same probe without the options, as children were started before: the checkout's folder.
    # (This is what makes the check above mean something: from here, the root is where it would look.)
    rc, out = _run(_probe_argv([interpreter[0]]), tmp_path, 60)
    assert rc == 0, out
    assert _inside_checkout(out.strip().splitlines()[-1]), out


@pytest.mark.timeout(300)
def test_pdserve_started_from_the_root_loads_the_model(tmp_path, monkeypatch):
    """The real child: `pdserve generate` imports transformers' tokenizer and the engine, and answers.
    Started as before (`python -m pdserve.cli`, no `-P`) it fails here with transformers >= 5.25."""
    monkeypatch.chdir(REPO)
    argv = pdserve_command("generate", "The capital of France is", "--max-new-tokens", "2")
    rc, out = _run(argv + ["--temperature", "0", "--num-threads", "1"], tmp_path, 280)
    assert rc == 0, out[-3000:]
    assert "[2 tokens" in out, out[-3000:]


def test_every_pdserve_child_is_started_with_P():
    """No place builds a `python -m pdserve.cli` command line of its own (it would lack `-P`)."""
    assert pdserve_command("up")[1:] == ["-P", "-m", "pdserve.cli", "up"]
    own = {REPO / "pdserve" / "launch" / "supervisor.py", Path(__file__).resolve()}
    folders = (
        "pdserve",
        "runtime",
        "gateway",
        "prefill",
        "decode",
        "kv_transfer",
        "benchmarks",
        "deploy",
        "tests",
    )
    offenders = [
        str(path.relative_to(REPO))
        for folder in folders
        for path in (REPO / folder).rglob("*.py")
        if path not in own and '"-m", "pdserve.cli"' in path.read_text()
    ]
    assert not offenders, f"build these command lines with pdserve_command: {offenders}"
