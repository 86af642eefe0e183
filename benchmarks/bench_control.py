"""The control plane's cost per request at concurrency 1, with and without the cluster secret (CurveZMQ).

The real `ControlPlane` (the gateway's ROUTER, on an asyncio loop) and two real `WorkerLink`s (a
prefill and a decode stand-in, no model) in one process, over loopback TCP. Each request is what the
gateway and workers exchange for a disaggregated request: a GenerateRequest to both legs, PrefillDone
back from the prefill, and one TokenBatch per output token from the decode. The time runs from
opening the room to the last token and PrefillDone both being in the gateway's room. Unkeyed and
keyed rounds alternate, so drift on a shared machine hits both alike.

    python -P -m pdserve.bench.bench_control [--requests 300] [--tokens 16] [--prompt 512] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import threading
import time

from pdserve.cluster_auth import ClusterKeys
from pdserve.gateway.cluster.control import ControlPlane
from pdserve.gateway.cluster.rooms import TokensArrived
from pdserve.gateway.cluster.workers import WorkerRegistry
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.observe.metrics import GatewayMetrics
from pdserve.protocol import gateway as m
from pdserve.sampling_params import SamplingParams
from pdserve.worker.link import WorkerLink

FINGERPRINT = {"architecture": "bench", "page_size": 16}


def _register(worker_id: str, role: str) -> m.Register:
    return m.Register(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        bootstrap_addr="127.0.0.1:9" if role == "prefill" else None,
        fingerprint=FINGERPRINT,
        model_name="bench",
        max_total_tokens=1 << 20,
        max_running_requests=64,
        context_length=1 << 16,
        vocab_size=49152,
        t_send=time.time(),
    )


class _StandIn:
    """A worker stand-in: answers each GenerateRequest at once."""

    def __init__(self, addr: str, worker_id: str, role: str, keys: ClusterKeys | None, tokens: int):
        self.link = WorkerLink(addr, lambda: _register(worker_id, role), time.time, keys=keys)
        self.role, self.tokens, self.worker_id = role, tokens, worker_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.link.start()
        self.link.wait_registered(10)
        self._thread.start()

    def _run(self) -> None:
        events = {"queue_entry": 0.0, "forward_entry": 0.0, "prefill_finished": 0.0}
        while not self._stop.is_set():
            for msg in self.link.recv(0.05):
                if not isinstance(msg, m.GenerateRequest):
                    continue
                if self.role == "prefill":
                    self.link.send(m.PrefillDone(room=msg.room, events=events))
                    continue
                for i in range(self.tokens):
                    out = m.TokenOutput(room=msg.room, token_ids=[i], finished=i == self.tokens - 1)
                    self.link.send(m.TokenBatch(worker_id=self.worker_id, outputs=[out]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.link.close()


async def _one(cp: ControlPlane, n: int, prompt: list[int], tokens: int) -> float:
    reg = cp.registry
    prefill, decode = reg.get("p0"), reg.get("d0")
    assert prefill is not None and decode is not None
    t0 = time.perf_counter()
    room = cp.open_room(f"r{n}", prefill, decode, len(prompt))
    req = m.GenerateRequest(
        room=room.room,
        input_ids=prompt,
        sampling=SamplingParams(max_new_tokens=tokens, temperature=0.0),
        prefill_worker="p0",
        prefill_bootstrap_addr=prefill.bootstrap_addr,
        decode_worker="d0",
    )
    cp.send(prefill, req)
    cp.send(decode, req)
    got = 0
    while got < tokens:
        ev = await room.inbox.get()
        assert isinstance(ev, TokensArrived), ev
        got += len(ev.output.token_ids)
    await room.prefill_event.wait()
    elapsed = time.perf_counter() - t0
    cp.close_room(room)
    return elapsed


def _round(keys: ClusterKeys | None, requests: int, prompt_len: int, tokens: int) -> list[float]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = GatewayConfig(control_host="127.0.0.1", control_port=0, heartbeat_interval_s=1.0)
    cp = ControlPlane(cfg, WorkerRegistry(), GatewayMetrics(), keys=keys)
    asyncio.run_coroutine_threadsafe(cp.start(), loop).result(5)
    addr = f"127.0.0.1:{cp.bound_port}"
    workers = [_StandIn(addr, "p0", "prefill", keys, tokens), _StandIn(addr, "d0", "decode", keys, tokens)]
    try:
        for w in workers:
            w.start()
        prompt = list(range(1000, 1000 + prompt_len))
        times = []
        for n in range(requests + 10):  # the first 10 warm up
            t = asyncio.run_coroutine_threadsafe(_one(cp, n, prompt, tokens), loop).result(10)
            if n >= 10:
                times.append(t)
        return times
    finally:
        for w in workers:
            w.stop()
        asyncio.run_coroutine_threadsafe(cp.stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench control", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=300, help="requests per round")
    p.add_argument("--tokens", type=int, default=16, help="output tokens per request (one TokenBatch each)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (GenerateRequest size)")
    p.add_argument("--rounds", type=int, default=4, help="rounds of each mode, alternating")
    args = p.parse_args(argv)
    keys = ClusterKeys.from_secret(secrets.token_bytes(32))
    runs: dict[str, list[float]] = {"plain": [], "curve": []}
    for _ in range(args.rounds):
        runs["plain"] += _round(None, args.requests, args.prompt, args.tokens)
        runs["curve"] += _round(keys, args.requests, args.prompt, args.tokens)
    print(
        f"per request: 2 GenerateRequests ({args.prompt} prompt tokens), PrefillDone, {args.tokens} TokenBatches"
    )
    print(f"{'mode':<6} {'requests':>8} {'median ms':>10} {'mean ms':>8} {'p90 ms':>7}")
    for mode, times in runs.items():
        ms = sorted(t * 1000 for t in times)
        print(
            f"{mode:<6} {len(ms):>8} {statistics.median(ms):>10.3f} {statistics.fmean(ms):>8.3f} "
            f"{ms[int(0.9 * len(ms))]:>7.3f}"
        )
    diff = statistics.median(runs["curve"]) - statistics.median(runs["plain"])
    print(f"Curve cost per request (median difference): {diff * 1000:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
