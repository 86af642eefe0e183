"""A prefill or decode KV-transfer endpoint in its own process, driven by JSON lines on stdin.

Used by the kv_transfer tests (and runnable inside a network namespace). Every command line gets one
JSON reply line on stdout. The pool is random from --seed; `dump` saves it for the test to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from pdserve.kv_transfer import FingerprintMismatch, KVReceiver, KVSender, TransferConfig, TransferState
from pdserve.kv_transfer.shm import shared_pool
from pdserve.protocol.kv_trailer import FirstToken


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _result_dict(result) -> dict:
    return {
        "state": result.state.name,
        "error": result.error,
        "metadata": None if result.metadata is None else result.metadata.model_dump(exclude_defaults=True),
        "num_bytes": result.num_bytes,
        "seconds": result.seconds,
        "prefix_mismatch": result.prefix_mismatch,
        "direct": result.direct,
        "shm": result.shm,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--chunk-bytes", type=int, default=64 << 10)
    parser.add_argument("--direct-min-bytes", type=int, default=1 << 20)
    parser.add_argument("--bootstrap-timeout", type=float, default=10.0)
    parser.add_argument("--waiting-timeout", type=float, default=20.0)
    parser.add_argument("--transfer-timeout", type=float, default=5.0)
    parser.add_argument("--max-pairs", type=int, default=4)
    # dist here (not the workers' auto): the tests that do not name a transport exercise the pair group.
    parser.add_argument("--transport", default="dist", choices=["auto", "shm", "dist"])
    args = parser.parse_args()

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.pages, args.layers, 2, args.page_size, args.heads, args.head_dim)
    kv = torch.randn(shape, generator=gen).to(getattr(torch, args.dtype))  # [pages, L, 2, P, H, D]
    fingerprint = {
        "architecture": "TestLM",
        "num_layers": args.layers,
        "kv_heads": args.heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "page_size": args.page_size,
        "weights_hash": "abc123",
    }
    config = TransferConfig(
        backend="gloo",
        bootstrap_timeout_s=args.bootstrap_timeout,
        waiting_timeout_s=args.waiting_timeout,
        transfer_timeout_s=args.transfer_timeout,
        max_pairs=args.max_pairs,
        chunk_bytes=args.chunk_bytes,
        direct_min_bytes=args.direct_min_bytes,
        transport=args.transport,
    )
    if args.role == "prefill":
        segment = None
        if args.transport != "dist":
            segment, kv = shared_pool(kv)  # the prefill's pool lives in shared memory, as in the worker
        engine = KVSender(kv, fingerprint, args.host, args.port, config, segment=segment)
    else:
        engine = KVReceiver(kv, fingerprint, config)
    engine.start()
    _reply({"event": "ready", "addr": getattr(engine, "addr", None), "pid": os.getpid()})
    done: dict[str, dict] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "send":
            engine.send(
                cmd["room"],
                cmd["pages"],
                cmd["num_tokens"],
                FirstToken.model_validate(cmd["metadata"]),
                cmd.get("block_hashes"),
            )
            _reply({"ok": True})
        elif op == "request":
            done.pop(cmd["room"], None)  # a room requested again (after a prefix mismatch): a new result
            engine.request(
                cmd["room"],
                cmd["addr"],
                cmd["pages"],
                cmd["num_tokens"],
                cmd.get("skip_pages", 0),
                cmd.get("prefix_hash"),
            )
            _reply({"ok": True})
        elif op == "connect":
            try:
                engine.connect(cmd["addr"])
                _reply({"ok": True})
            except (FingerprintMismatch, ConnectionError, TimeoutError) as exc:
                _reply({"ok": False, "type": type(exc).__name__, "error": str(exc)})
        elif op == "abort":
            engine.abort(cmd["room"])
            _reply({"ok": True})
        elif op == "wait":
            # Poll until every listed room has a result (or the timeout); the loop a worker would run.
            deadline = time.monotonic() + cmd["timeout"]
            while time.monotonic() < deadline and not all(r in done for r in cmd["rooms"]):
                for result in engine.poll():
                    done[result.room] = _result_dict(result)
                time.sleep(0.002)
            _reply({"results": {r: done[r] for r in cmd["rooms"] if r in done}})
        elif op == "wait_state":
            deadline = time.monotonic() + cmd["timeout"]
            want = TransferState[cmd["state"]]
            while time.monotonic() < deadline and engine.state(cmd["room"]) != want:
                time.sleep(0.001)
            _reply({"ok": engine.state(cmd["room"]) == want})
        elif op == "dump":
            torch.save(kv, cmd["path"])
            _reply({"ok": True})
        elif op == "errors":
            _reply({"errors": engine.handshake_errors()})
        elif op == "exit":
            break
    engine.close()
    _reply({"event": "closed"})


if __name__ == "__main__":
    main()
