"""The flag table: every command-line flag of the workers, the offline engine, the gateway and the two
launchers.

Each row (pdserve/launch/flag.py) names a flag, the programs that take it, how argparse reads it, and the
children a launcher hands its value to. The rows: worker_flags.py (the model runtime and the workers,
and the flags the gateway shares with them), launcher_flags.py (`pdserve up` and deploy/launch.py), and
the gateway's own, declared on the fields of its config (gateway/config.py `GATEWAY_FLAGS`). Every
program builds its parser with `add_flags(parser, role)`; the launchers build their children's command
lines with `passed_on`. A new worker flag is one row: with UP in its roles and TO_WORKERS in its
`passed_to`, `pdserve up` takes it and hands it to every worker it starts; a new gateway flag is one
field of GatewayConfig, `up=True` for the same. tests/deploy/test_flag_table.py checks the Kubernetes
manifests and the launchers' command lines against this table.
"""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.launch.flag import GATEWAY, GATEWAY_CHILD, ROLES, UP, Flag
from pdserve.launch.launcher_flags import LAUNCHER_FLAGS
from pdserve.launch.worker_flags import RUNTIME_FLAGS, WORKER_FLAGS

# The rows of every program but the gateway's own.
_BASE: list[Flag] = RUNTIME_FLAGS + WORKER_FLAGS + LAUNCHER_FLAGS


def table(role: str | None = None) -> list[Flag]:
    """The table's rows, for `role` (None: all of them). The gateway's own rows are read only for a role
    that takes them: they live on the gateway's config, whose modules (FastAPI, about a second to import)
    no worker should load."""
    if role is not None and role not in (GATEWAY, UP):
        return _BASE
    from pdserve.gateway.config import GATEWAY_FLAGS

    return _BASE + GATEWAY_FLAGS


def flags_of(role: str) -> list[Flag]:
    """The rows `role` (one of flag.ROLES) takes, in table order."""
    if role not in ROLES:
        raise ValueError(f"{role!r} is not one of {sorted(ROLES)}")
    return [f for f in table(role) if role in f.roles]


def add_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """Declare every flag `role` takes on `parser`; defaults read from the environment are read now."""
    for f in flags_of(role):
        kw: dict[str, Any] = {"default": f.default_for(role)}
        kw["help"] = argparse.SUPPRESS if f.hidden else f.help
        if f.dest:
            kw["dest"] = f.dest
        if f.switch:
            kw["action"] = "store_true"
        elif f.negatable:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update({k: v for k, v in (("type", f.type), ("metavar", f.metavar)) if v is not None})
            if f.choices is not None:
                kw["choices"] = list(f.choices)
            if f.const is not None:
                kw.update(nargs="?", const=f.const)
        parser.add_argument(f.name, *f.aliases, **kw)


def passed_on(args: argparse.Namespace, launcher: str, child: str) -> list[str]:
    """The flags `launcher` hands to its `child` (GATEWAY_CHILD or WORKER_CHILD): every row it takes that goes
    there, with its parsed value; one that is None, a switch left off, or the gateway's own default (the
    gateway would take it anyway: its command line stays short) is left out."""
    out: list[str] = []
    for f in flags_of(launcher):
        if child not in f.passed_to:
            continue
        value = getattr(args, f.attr)
        if child == GATEWAY_CHILD and GATEWAY in f.roles and value == f.default_for(GATEWAY):
            continue
        if value is True and f.switch:
            out.append(f.name)
        elif value is not None and value is not False:
            out += [f.name, str(value)]
    return out
