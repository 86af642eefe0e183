"""Live weight updates, driven from the gateway over every registered worker (the worker side:
runtime/weight_update.py).

One update at a time (another while one runs: 409). An update is two phases:
1. prepare: every worker loads (from disk) or receives (from the trainer's broadcast) the new weights
   aside and checks them against its model; workers keep serving meanwhile. Any refusal (a missing
   path, another architecture, a shape that differs, a worker that does not answer) cancels the staged
   weights everywhere: a 400 and nothing changed.
2. commit: each worker swaps them in between two forward steps and takes the new version; its prefix
   cache is invalidated. A worker that fails the commit (or does not answer) leaves rotation
   (`stale_weights`) rather than serving old weights under the new version.
A worker lost to the heartbeat, or replaced by a new process under its id, ends the wait for its
answer at once: the update fails naming it (503, nothing changed, if it was preparing), never waiting
out the phase's timeout.

A worker that registers on other weights than the cluster's (restarted after an update, so on its
start checkpoint; or started later) is brought to them: when the cluster's weights came from disk,
the gateway sends it the same prepare and commit with the recorded path and version, and puts it in
rotation once its commit reports that version. Weights that came over a trainer's distributed group
cannot be read again: such a worker stays out of rotation (`stale_weights`) until the next update.
This catch-up holds the update lock while it runs (an update sent meanwhile: 409).
Requests in flight go on with the new weights from their next step; every output carries the version
that produced it, so `weight_versions` is exact. With `abort_all_requests` they are aborted instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve.gateway.cluster.control import ControlPlane
from pdserve.gateway.cluster.workers import WorkerInfo, WorkerRegistry
from pdserve.gateway.errors import ApiError
from pdserve.protocol.gateway import WeightsCommand, WeightsGroup, WeightsOp, WeightsReply

log = logging.getLogger(__name__)

PREPARE_TIMEOUT_S = 600.0  # a large checkpoint from a slow disk; a trainer that broadcasts late
COMMIT_TIMEOUT_S = 60.0
QUICK_TIMEOUT_S = 10.0  # pause, resume, cancel, destroy


class WeightUpdates:
    def __init__(self, control: ControlPlane, registry: WorkerRegistry) -> None:
        self.control, self.registry = control, registry
        self._lock = asyncio.Lock()
        self.groups: dict[str, list[str]] = {}  # group name -> worker ids in rank order
        # (model_path, load_format) of the cluster's weights when they came from disk; None when they
        # are the start checkpoint's ("default") or came over a distributed group.
        self.source: tuple[str, str | None] | None = None
        self._catch_ups: set[asyncio.Task[None]] = set()
        control.on_registered.append(self._registered)

    @property
    def version(self) -> str:
        return self.registry.weight_version

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        if self._lock.locked():
            raise ApiError(
                409, "another weight update is in progress; try again when it ends", code="conflict"
            )
        async with self._lock:
            yield

    def _workers(self) -> list[WorkerInfo]:
        ws = sorted(self.registry.all(), key=lambda w: w.worker_id)
        if not ws:
            raise ApiError(503, "no worker in rotation (none is registered)", headers={"Retry-After": "1"})
        return ws

    async def _ask(
        self, workers: list[WorkerInfo], make: Callable[[WorkerInfo], WeightsCommand], timeout_s: float
    ) -> dict[str, WeightsReply]:
        return await self.control.ask_weights({w.worker_id: (w, make(w)) for w in workers}, timeout_s)

    @staticmethod
    def _cmd(op: WeightsOp, op_ids: dict[str, str], **kw: object) -> Callable[[WorkerInfo], WeightsCommand]:
        def make(w: WorkerInfo) -> WeightsCommand:
            return WeightsCommand(op=op, op_id=op_ids.setdefault(w.worker_id, uuid.uuid4().hex), **kw)  # type: ignore[arg-type]

        return make

    # ---- updates ----------------------------------------------------------------------------

    async def from_disk(
        self, model_path: str, load_format: str | None, version: str | None, abort_all: bool
    ) -> dict[str, Any]:
        async with self._exclusive():
            workers = self._workers()
            ids: dict[str, str] = {}
            prepare = self._cmd("prepare_disk", ids, model_path=model_path, load_format=load_format)
            return await self._update(
                workers, ids, prepare, version, abort_all, "model_path", (model_path, load_format)
            )

    async def from_distributed(
        self,
        group_name: str,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: str | None,
        abort_all: bool,
    ) -> dict[str, Any]:
        async with self._exclusive():
            wids = self.groups.get(group_name)
            if wids is None:
                raise ApiError(
                    400,
                    f"no weights group {group_name!r}; call /init_weights_update_group first",
                    "group_name",
                )
            workers = self._workers()
            if sorted(w.worker_id for w in workers) != sorted(wids):
                raise ApiError(
                    400,
                    f"the workers changed since group {group_name!r} was made (it has {', '.join(wids)}); "
                    "destroy it and init it again",
                    "group_name",
                )
            ids: dict[str, str] = {}
            prepare = self._cmd(
                "prepare_distributed", ids, group_name=group_name, names=names, dtypes=dtypes, shapes=shapes
            )
            return await self._update(workers, ids, prepare, version, abort_all, "names", None)

    async def _update(
        self,
        workers: list[WorkerInfo],
        ids: dict[str, str],
        prepare: Callable[[WorkerInfo], WeightsCommand],
        version: str | None,
        abort_all: bool,
        param: str,
        source: tuple[str, str | None] | None,
    ) -> dict[str, Any]:
        """`source`: where the new weights can be read again (a restarted worker loads them there)."""
        t0 = time.monotonic()
        aborted = self.control.abort_rids(None) if abort_all else 0
        replies = await self._ask(workers, prepare, PREPARE_TIMEOUT_S)
        t_prepared = time.monotonic()
        refused = {wid: r.message for wid, r in replies.items() if not r.ok}
        if refused:
            await self._ask(workers, self._cmd("cancel", ids), QUICK_TIMEOUT_S)
            raise self._refusal(workers, refused, param)
        new = version or self.version
        commits = await self._ask(workers, self._cmd("commit", ids, weight_version=new), COMMIT_TIMEOUT_S)
        t_done = time.monotonic()
        self.registry.weight_version, self.source = new, source
        failed: dict[str, str] = {}
        for w in workers:
            r = commits[w.worker_id]
            w.weight_version = r.weight_version if r.ok else w.weight_version
            w.stale_weights = not r.ok or r.weight_version != new
            if w.stale_weights:
                failed[w.worker_id] = r.message or f"serves version {r.weight_version!r}"
                log.error(
                    "worker %s failed the weight update: %s; out of rotation",
                    w.worker_id,
                    failed[w.worker_id],
                )
        asked = {id(w) for w in workers}
        for w in self.registry.all():  # registered during the update: on the old weights
            if id(w) not in asked and w.weight_version != new:
                w.stale_weights = True
                log.warning(
                    "worker %s joined during the update on version %s: out of rotation until it catches up",
                    w.worker_id,
                    w.weight_version,
                )
                self._registered(w)
        self.control.workers_changed()
        log.info("weights updated to version %s in %.2f s", new, t_done - t0)
        return {
            "success": not failed,
            "message": "Succeeded to update model weights."
            if not failed
            else f"updated, but out of rotation: {'; '.join(f'{k}: {v}' for k, v in failed.items())}",
            "weight_version": new,
            "num_paused_requests": 0,
            "num_aborted_requests": aborted,
            "updated_workers": [w.worker_id for w in workers if w.worker_id not in failed],
            "failed_workers": failed,
            "prepare_seconds": round(t_prepared - t0, 4),
            "commit_seconds": round(t_done - t_prepared, 4),
            "seconds": round(t_done - t0, 4),
            "worker_commit_seconds": {wid: round(r.seconds, 4) for wid, r in commits.items()},
        }

    def _refusal(self, workers: list[WorkerInfo], refused: dict[str, str], param: str) -> ApiError:
        """The error of a failed prepare: 503 naming the workers lost meanwhile (lost to the heartbeat,
        or restarted), else 400 with every worker's reason."""
        detail = "; ".join(f"{wid}: {why}" for wid, why in sorted(refused.items()))
        lost = sorted(w.worker_id for w in workers if self.registry.get(w.worker_id) is not w)
        if lost:
            return ApiError(
                503,
                f"weights not updated, nothing changed: worker {', '.join(lost)} was lost during the "
                f"update ({detail}); try again once it is back",
                headers={"Retry-After": "5"},
            )
        return ApiError(400, f"weights not updated, nothing changed: {detail}", param)

    # ---- a worker on other weights catches up --------------------------------------------------

    def _registered(self, w: WorkerInfo) -> None:
        """A worker registered (or joined during an update) on other weights than the cluster's."""
        if not w.stale_weights:
            return
        task = asyncio.get_running_loop().create_task(self._catch_up(w))
        self._catch_ups.add(task)
        task.add_done_callback(self._catch_ups.discard)

    async def _catch_up(self, w: WorkerInfo) -> None:
        async with self._lock:  # after any update in progress, whose version it then loads
            if self.registry.get(w.worker_id) is not w or not w.stale_weights:
                return  # gone, replaced, or brought up to date meanwhile
            target, source = self.version, self.source
            if source is None:
                log.warning(
                    "worker %s serves weights %s, the cluster %s, which no path can load again (a "
                    "distributed update, or the gateway restarted): out of rotation until the next update",
                    w.worker_id,
                    w.weight_version,
                    target,
                )
                return
            log.info(
                "worker %s serves weights %s: loading the cluster's %s", w.worker_id, w.weight_version, target
            )
            ids: dict[str, str] = {}
            path, load_format = source
            prepare = self._cmd("prepare_disk", ids, model_path=path, load_format=load_format)
            r = (await self._ask([w], prepare, PREPARE_TIMEOUT_S))[w.worker_id]
            if r.ok:
                commit = self._cmd("commit", ids, weight_version=target)
                r = (await self._ask([w], commit, COMMIT_TIMEOUT_S))[w.worker_id]
            else:
                await self._ask([w], self._cmd("cancel", ids), QUICK_TIMEOUT_S)
            if not r.ok or r.weight_version != target or self.registry.get(w.worker_id) is not w:
                log.error(
                    "worker %s could not load the cluster's weights %s: %s; out of rotation",
                    w.worker_id,
                    target,
                    r.message or f"serves version {r.weight_version!r}",
                )
                return
            w.weight_version, w.stale_weights = target, False
            self.control.workers_changed()
            log.info("worker %s loaded the cluster's weights %s: back in rotation", w.worker_id, target)

    # ---- the trainer's group ----------------------------------------------------------------

    async def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> dict[str, Any]:
        async with self._exclusive():
            if group_name in self.groups:
                raise ApiError(400, f"weights group {group_name!r} exists already", "group_name")
            workers = self._workers()
            if world_size != rank_offset + len(workers):
                raise ApiError(
                    400,
                    f"world_size {world_size} must be rank_offset ({rank_offset}) + the {len(workers)} workers",
                    "world_size",
                )
            ids: dict[str, str] = {}
            rank = {w.worker_id: rank_offset + i for i, w in enumerate(workers)}

            def make(w: WorkerInfo) -> WeightsCommand:
                g = WeightsGroup(
                    master_address=master_address,
                    master_port=master_port,
                    rank=rank[w.worker_id],
                    world_size=world_size,
                    group_name=group_name,
                    backend=backend,  # type: ignore[arg-type]
                )
                return WeightsCommand(
                    op="init_group", op_id=ids.setdefault(w.worker_id, uuid.uuid4().hex), group=g
                )

            t0 = time.monotonic()
            replies = await self._ask(workers, make, PREPARE_TIMEOUT_S)
            refused = {wid: r.message for wid, r in replies.items() if not r.ok}
            if refused:
                await self._ask(
                    workers, self._cmd("destroy_group", {}, group_name=group_name), QUICK_TIMEOUT_S
                )
                detail = "; ".join(f"{wid}: {why}" for wid, why in sorted(refused.items()))
                raise ApiError(400, f"weights group not made: {detail}", "master_address")
            self.groups[group_name] = [w.worker_id for w in workers]
            return {
                "success": True,
                "message": "Succeeded to initialize the weights update group.",
                "ranks": rank,
                "seconds": round(time.monotonic() - t0, 4),
            }

    async def destroy_group(self, group_name: str) -> dict[str, Any]:
        async with self._exclusive():
            wids = self.groups.pop(group_name, None)
            if wids is None:
                raise ApiError(400, f"no weights group {group_name!r}", "group_name")
            workers = [w for w in self.registry.all() if w.worker_id in wids]
            await self._ask(workers, self._cmd("destroy_group", {}, group_name=group_name), QUICK_TIMEOUT_S)
            return {"success": True, "message": f"weights group {group_name!r} destroyed"}

    # ---- pause ------------------------------------------------------------------------------

    async def pause(self, abort: bool) -> dict[str, Any]:
        aborted = self.control.abort_rids(None) if abort else 0
        replies = await self._ask(self._workers(), self._cmd("pause", {}), QUICK_TIMEOUT_S)
        return self._all_ok(replies, "paused", aborted)

    async def resume(self) -> dict[str, Any]:
        replies = await self._ask(self._workers(), self._cmd("resume", {}), QUICK_TIMEOUT_S)
        return self._all_ok(replies, "resumed", 0)

    @staticmethod
    def _all_ok(replies: dict[str, WeightsReply], what: str, aborted: int) -> dict[str, Any]:
        bad = {wid: r.message for wid, r in replies.items() if not r.ok}
        if bad:
            raise ApiError(503, f"not {what} on: " + "; ".join(f"{k}: {v}" for k, v in bad.items()))
        return {"success": True, "message": f"generation {what}", "num_aborted_requests": aborted}
