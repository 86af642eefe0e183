"""Tensor parallelism is an object the runner holds (runtime/tensor_parallel.py: `SingleProcess` does
nothing, `RankGroup` talks to the other ranks), so the runner and the workers' loops call it instead of
asking whether TP is on. This keeps them from growing the branches back."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NO_TP_BRANCHES = [
    "runtime/runner.py",
    "runtime/engine.py",
    "prefill/worker.py",
    "decode/worker.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pdserve/worker").glob("*.py")),
]
# `tp is None`, `tp_size > 1`, `if self.tp:`, `... if runner.tp else ...`
BRANCH = re.compile(
    r"\btp(_size|_group)?\s*(is\b|==|!=|>=?|<=?)|\bif\s+(not\s+)?[\w.]*\btp\b(?![\w.(])|"
    r"\bif\s+[\w.]*\btp\.size\b"
)


def tp_branches(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if BRANCH.search(line)]


def test_the_runner_and_the_workers_do_not_branch_on_tp() -> None:
    found = {f: tp_branches((ROOT / f).read_text()) for f in NO_TP_BRANCHES}
    assert not {f: lines for f, lines in found.items() if lines}


def test_the_check_sees_a_branch() -> None:
    assert tp_branches("if self.tp is not None:\n    x = 1") == ["if self.tp is not None:"]
    assert tp_branches("if runner.tp_size > 1:") == ["if runner.tp_size > 1:"]
    assert tp_branches("why = 'a' if self.tp else 'b'") == ["why = 'a' if self.tp else 'b'"]
    assert tp_branches("if self.runner.tp.size > 1:") == ["if self.runner.tp.size > 1:"]
    assert not tp_branches("self.tp.forward(cmd)\ntp_size=runner.cfg.tp_size,")
