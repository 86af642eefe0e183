"""The house's size rules, kept by a test rather than by review: no source file over 400 lines, no
function over 80, and each doc within its budget (a doc is a map of what is true now; git keeps the
history). The rules are for the code pdserve ships and runs (benchmarks/ and the planner included), not
for tests."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
# Lines per doc; a doc not named here gets DEFAULT_DOC_LINES.
DOC_BUDGETS = {"README.md": 150, "docs/architecture.md": 400, "docs/benchmarks.md": 500}
DEFAULT_DOC_LINES = 600
SKIPPED = {".venv", "build", ".git", "node_modules"}


def _sources() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if not SKIPPED.intersection(p.relative_to(ROOT).parts[:-1]))


def _is_test(path: Path) -> bool:
    return path.relative_to(ROOT).parts[0] == "tests"


def _long_functions(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_source_file_passes_400_lines():
    sources = [p for p in _sources() if not _is_test(p)]
    assert len(sources) > 100  # the walk found the tree
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_passes_80_lines():
    long = [f for p in _sources() if not _is_test(p) for f in _long_functions(p)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_docs_fit_their_budgets():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    over = {}
    for doc in docs:
        name = str(doc.relative_to(ROOT))
        lines = len(doc.read_text().splitlines())
        if lines > DOC_BUDGETS.get(name, DEFAULT_DOC_LINES):
            over[name] = lines
    assert not over, f"docs over their budgets {DOC_BUDGETS} (others {DEFAULT_DOC_LINES}): {over}"


def test_the_rules_catch_a_long_function(tmp_path):
    """The checker itself: a function of 81 lines is reported, one of 80 is not."""
    body = "\n".join("    x = 1" for _ in range(79))
    probe = tmp_path / "probe.py"
    probe.write_text(f"def fits():\n{body}\n\n\ndef too_long():\n{body}\n    x = 2\n")
    assert [f.split()[1] for f in _long_functions(probe, tmp_path)] == ["too_long:"]
