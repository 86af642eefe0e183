"""Commands sent to workers whose answers the gateway awaits: FlushCacheDone by flush_id, WeightsReply by
op_id. Each wait knows whom it asked: an answer counts only from that worker, and a worker that is lost or
registers again will not answer, so its wait ends then."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdserve.gateway.cluster.workers import WorkerInfo, WorkerRegistry
from pdserve.protocol.gateway import FlushCache, FlushCacheDone, WeightsCommand, WeightsReply

Answer = FlushCacheDone | WeightsReply | str  # str: why no answer came


class Answers:
    def __init__(
        self, registry: WorkerRegistry, send: Callable[[WorkerInfo, FlushCache | WeightsCommand], None]
    ) -> None:
        self.registry, self._send = registry, send
        self._waits: dict[str, asyncio.Future[Answer]] = {}
        self._asked: dict[str, WorkerInfo] = {}

    async def ask(
        self, sends: dict[str, tuple[WorkerInfo, FlushCache | WeightsCommand]], timeout_s: float
    ) -> dict[str, Answer]:
        """Send each worker (keyed by worker id) its command and wait, at most `timeout_s` in all, for
        every answer (matched by the command's flush_id / op_id); for a worker that gave none, why:
        silent until the timeout, or lost or registered again meanwhile (its wait ends then)."""
        loop = asyncio.get_running_loop()
        futs: dict[str, asyncio.Future[Answer]] = {}
        for wid, (w, cmd) in sends.items():
            key = cmd.op_id if isinstance(cmd, WeightsCommand) else cmd.flush_id
            futs[wid] = self._waits[key] = loop.create_future()
            self._asked[key] = w
            if self.registry.get(w.worker_id) is not w:  # lost or replaced before we asked
                futs[wid].set_result("is no longer registered")
            else:
                self._send(w, cmd)
        try:
            if futs:
                await asyncio.wait(futs.values(), timeout=timeout_s)
            return {
                wid: f.result() if f.done() and not f.cancelled() else f"no answer within {timeout_s:g} s"
                for wid, f in futs.items()
            }
        finally:
            for f in futs.values():
                f.cancel()
            self._waits = {k: f for k, f in self._waits.items() if not f.done()}
            self._asked = {k: w for k, w in self._asked.items() if k in self._waits}

    def answered(self, worker: WorkerInfo, msg: FlushCacheDone | WeightsReply) -> None:
        key = msg.op_id if isinstance(msg, WeightsReply) else msg.flush_id
        fut = self._waits.get(key)
        if fut is not None and not fut.done() and self._asked.get(key) is worker:
            fut.set_result(msg)

    def end_waits_on(self, w: WorkerInfo, why: str) -> None:
        """`w` will not answer what it was asked (it is lost, or a new process took its id)."""
        for key, asked in self._asked.items():
            fut = self._waits.get(key)
            if asked is w and fut is not None and not fut.done():
                fut.set_result(why)
