"""One row of the flag table (pdserve/launch/flags.py): a flag, the programs that take it, how argparse
reads it, and the children a launcher hands its value to."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve import env

# The programs that take flags: the two workers, the offline engine (`pdserve generate`), the gateway,
# `pdserve up` and deploy/launch.py.
PREFILL, DECODE, GENERATE, UP, LAUNCH = "prefill", "decode", "generate", "up", "launch"
GATEWAY = "gateway"
ROLES = frozenset({PREFILL, DECODE, GENERATE, GATEWAY, UP, LAUNCH})
WORKERS = frozenset({PREFILL, DECODE})
# The model runtime's flags: every worker and the offline engine; `pdserve up` takes and forwards them.
RUNTIME = WORKERS | {GENERATE, UP}
LAUNCHERS = frozenset({UP, LAUNCH})

# The children a launcher starts, for `Flag.passed_to`.
GATEWAY_CHILD, WORKER_CHILD = "gateway", "workers"
TO_WORKERS = frozenset({WORKER_CHILD})
TO_GATEWAY = frozenset({GATEWAY_CHILD})
TO_BOTH = TO_WORKERS | TO_GATEWAY


@dataclass(frozen=True)
class Flag:
    """One flag. `default` may be a function, called when a parser is built (a default read from the
    environment); `role_default` overrides it for some roles. `switch`: a store_true flag; `negatable`:
    a boolean flag with its `--no-` form (on by default when `default` is). `passed_to`: a launcher that
    takes it hands its value to these children (unless None, a switch left off, or the child's own
    default)."""

    name: str
    roles: frozenset[str]
    help: str | None = None
    type: Callable[[str], Any] | None = None
    default: Any = None
    role_default: Mapping[str, Any] = field(default_factory=dict)
    choices: tuple[str, ...] | None = None
    dest: str | None = None
    aliases: tuple[str, ...] = ()
    switch: bool = False
    negatable: bool = False
    # the value of the flag given bare (`--deterministic` = `--deterministic on`); None: a value is required
    const: str | None = None
    hidden: bool = False  # a test hook: no deployment sets it by accident
    metavar: str | None = None
    passed_to: frozenset[str] = frozenset()

    @property
    def attr(self) -> str:
        """Its attribute on the parsed namespace."""
        return self.dest or self.name[2:].replace("-", "_")

    def default_for(self, role: str) -> Any:
        """Its default in `role`'s parser (a switch: off)."""
        value = self.role_default.get(role, self.default)
        if self.switch or self.negatable:
            return bool(value)
        return value() if callable(value) else value


def launch_env(name: str, default: str | None = None) -> Callable[[], str | None]:
    """A default read from one of deploy/launch.sh's variables (env.LAUNCH_VARS) when a parser is built."""
    return lambda: env.launch_default(name, default)
