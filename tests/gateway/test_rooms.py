"""The gateway's rooms import only downwards. `gateway/` is split into rooms (sub-packages) and a few top-level
modules; each is a unit with a place in `LAYERS`, and a unit may import only units of lower layers (and
itself). Every import counts: those under `if TYPE_CHECKING:` and inside functions too, since each is a
dependency a reader (and mypy) must follow. A new room or top-level module must be given its place here.
"""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parent.parent.parent / "gateway"
PACKAGE = "pdserve.gateway"

# Lowest first. Units of one layer are siblings: neither imports the other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "request_models"),  # refusals and request bodies, shared by every room
    ("protocol",),  # a body's parsing into what a generation runs
    ("observe", "text"),  # metrics and timelines; tokenizer, detokenizer, tool calls, reasoning
    ("config",),  # the gateway's flags: names the text formats it may pick
    ("cluster",),  # control plane: workers, registration, liveness, rooms, role switches, weights
    ("generation",),  # a request's legs: routing, reading its room, retries, its trace
    ("autopilot",),  # canaries and the elastic controller: they run generations and read traces
    ("api",),  # HTTP routes and replies, admission, auth, the app state
    ("server",),  # builds the app from every room
    ("cli",),  # `pdserve gateway`
)
LEVEL = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def unit_of(relpath: str) -> str:
    """The unit a module under gateway/ belongs to: its room (first folder) or its own name."""
    first = relpath.split("/")[0]
    return first.removesuffix(".py")


def imported_units(relpath: str, source: str) -> set[str]:
    """The gateway units that `source` (the module at gateway/`relpath`) imports."""
    here = [PACKAGE, *relpath.removesuffix(".py").split("/")]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here[: len(here) - node.level]
                base = ".".join(parent + ([base] if base else []))
            # `from pdserve.gateway import x`: x is the unit itself.
            targets = [f"{base}.{a.name}" for a in node.names] if base == PACKAGE else [base]
        for t in targets:
            if t.startswith(PACKAGE + "."):
                found.add(t[len(PACKAGE) + 1 :].split(".")[0])
    return found


def upward_imports(sources: dict[str, str]) -> list[str]:
    """Each import of a unit at the importer's level or above, as `module -> unit`."""
    bad = []
    for relpath, source in sorted(sources.items()):
        unit = unit_of(relpath)
        for target in sorted(imported_units(relpath, source) - {unit}):
            if LEVEL.get(target, len(LAYERS)) >= LEVEL.get(unit, -1):
                bad.append(f"gateway/{relpath} ({unit}) -> {target}")
    return bad


def _gateway_sources() -> dict[str, str]:
    return {p.relative_to(GATEWAY).as_posix(): p.read_text() for p in sorted(GATEWAY.rglob("*.py"))}


def test_every_unit_has_a_layer() -> None:
    units = {unit_of(rel) for rel in _gateway_sources()} - {"__init__"}
    assert units - set(LEVEL) == set(), "give each new room or top-level module its place in LAYERS"
    assert set(LEVEL) - units == set(), "LAYERS names a unit that no longer exists"


def test_no_import_runs_back_up() -> None:
    assert upward_imports(_gateway_sources()) == []


def test_rooms_are_documented_and_reexport_nothing() -> None:
    for init in sorted(GATEWAY.glob("*/__init__.py")):
        if init.parent.name in LEVEL:
            tree = ast.parse(init.read_text())
            assert ast.get_docstring(tree), f"{init.parent.name}/__init__.py says what lives in the room"
            assert len(tree.body) == 1, f"{init.parent.name}/__init__.py holds only its docstring"


def test_an_upward_import_is_caught() -> None:
    """The check itself: one import from a higher room, in any form, is reported."""
    cases = {
        "text/tokenizer.py": "from pdserve.gateway.api.state import gateway_state\n",
        "cluster/workers.py": "if TYPE_CHECKING:\n    from pdserve.gateway.generation import generation\n",
        "observe/metrics.py": "def f() -> None:\n    import pdserve.gateway.text.tokenizer\n",
        "generation/routing.py": "from ..autopilot import canary\n",
        "errors.py": "from pdserve.gateway import request_models\n",
    }
    assert upward_imports(cases) == [
        "gateway/cluster/workers.py (cluster) -> generation",
        "gateway/errors.py (errors) -> request_models",
        "gateway/generation/routing.py (generation) -> autopilot",
        "gateway/observe/metrics.py (observe) -> text",
        "gateway/text/tokenizer.py (text) -> api",
    ]
    assert upward_imports({"api/state.py": "from pdserve.gateway.cluster.workers import X\n"}) == []
