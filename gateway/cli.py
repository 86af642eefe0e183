"""`pdserve gateway`: flags and entry point (the root CLI calls `add_cli_args` then `main`)."""

from __future__ import annotations

import argparse
import sys

from pdserve.gateway.config import add_cli_args as _add_cli_args
from pdserve.gateway.config import config_from_args


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    _add_cli_args(parser)


def main(args: argparse.Namespace) -> int:
    from pdserve.gateway.server import run

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"pdserve gateway: {e}", file=sys.stderr)
        return 2
    run(cfg)
    return 0
