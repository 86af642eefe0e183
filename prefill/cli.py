"""`pdserve prefill`: one prefill worker."""

from __future__ import annotations

import argparse

from pdserve.config import add_worker_args


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_worker_args(parser, "prefill")


def main(args: argparse.Namespace) -> int:
    from pdserve.prefill.worker import PrefillWorker
    from pdserve.worker.common import run_worker

    return run_worker("prefill", args, PrefillWorker)
