"""`pdserve prefill`: one prefill worker."""

from __future__ import annotations

import argparse

from pdserve.launch.flag import PREFILL
from pdserve.launch.flags import add_flags


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, PREFILL)


def main(args: argparse.Namespace) -> int:
    from pdserve.worker.common import run_worker

    return run_worker("prefill", args)
