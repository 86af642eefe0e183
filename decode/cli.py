"""`pdserve decode`: one decode worker."""

from __future__ import annotations

import argparse

from pdserve.config import add_worker_args


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_worker_args(parser, "decode")


def main(args: argparse.Namespace) -> int:
    from pdserve.decode.worker import DecodeWorker
    from pdserve.worker.common import run_worker

    return run_worker("decode", args, DecodeWorker)
