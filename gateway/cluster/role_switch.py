"""Role switching: a worker moved between prefill and decode in place (`POST /workers/{id}/role`).

A switch, one at a time in the cluster:
1. `begin` checks it (the worker is known and healthy, in the other role, and not the last of its role
   in rotation; no other switch is under way), gives it the next epoch of that worker id, and takes the
   worker out of rotation; the control plane sends it `SwitchRole(role, epoch)`.
2. The worker drains its role as on SIGTERM (what it holds finishes; nothing new is routed to it)
   for at most its --switch-drain-timeout; what it still holds then fails with code `draining`, and
   the gateway runs those requests on elsewhere (retried, or migrated mid-stream). It then builds the other role's worker on the same weights and KV pool and registers again, on a new
   connection, with that epoch (pdserve/worker/common.py).
3. `registered` sees the Register of the pending epoch: the switch is done. The new connection takes
   the worker id over at once (the old one has closed), without counting as a restart.

Epochs: the last epoch given per worker id is kept. A Register of an older epoch (> 0) is refused, and
frames from a connection a switch retired are dropped and counted, so nothing the worker said in its
old role is taken for its new one. A Register of epoch 0 is a process (re)starting in its launch role:
accepted as a restart; it ends any switch of that id that was under way (killed mid-switch, the
supervisor brings it back as it was launched).
A switch whose Register has not come `timeout_s` after it began is given up (logged): the worker stays
out of rotation until it registers again.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.config import SWITCH_DRAIN_TIMEOUT_S
from pdserve.gateway.cluster.workers import WorkerInfo, WorkerRegistry
from pdserve.protocol.gateway import Register, Role

log = logging.getLogger(__name__)

RETIRED_KEEP = 64  # connections retired by switches whose stray frames are still recognised
# A switch not completed after this is given up: the workers' default --switch-drain-timeout, then two
# minutes for the transfers of what it handed off to end and for the other role to be built and register.
SWITCH_TIMEOUT_S = SWITCH_DRAIN_TIMEOUT_S + 120.0


@dataclass
class Switch:
    worker_id: str
    from_role: Role
    to_role: Role
    epoch: int
    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)  # epoch seconds, for /workers

    def view(self) -> dict[str, object]:
        return {"from": self.from_role, "to": self.to_role, "epoch": self.epoch, "since": self.started_at}


class SwitchRefused(Exception):
    """A switch that may not start: `status` 404 (no such worker) or 409 (not now, or not at all)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RoleSwitches:
    def __init__(self, registry: WorkerRegistry, timeout_s: float) -> None:
        self.registry = registry
        self.timeout_s = timeout_s
        self.pending: dict[str, Switch] = {}
        self.epochs: dict[str, int] = {}  # worker id -> the last epoch given by a switch or registered
        self._retired: OrderedDict[bytes, tuple[str, int]] = OrderedDict()  # identity -> (id, epoch)

    def begin(self, worker_id: str, role: Role, now: float | None = None) -> Switch:
        """Check and start a switch (raises SwitchRefused); the caller sends the worker `SwitchRole`."""
        self.expire(time.monotonic() if now is None else now)
        w = self.registry.get(worker_id)
        if w is None:
            raise SwitchRefused(404, f"no registered worker {worker_id!r}")
        if self.pending:
            s = next(iter(self.pending.values()))
            raise SwitchRefused(
                409,
                f"a role switch is under way ({s.worker_id}: {s.from_role} to {s.to_role}); one at a time",
            )
        if w.role == role:
            raise SwitchRefused(409, f"{worker_id} is a {role} worker already")
        if w.state != "healthy":
            raise SwitchRefused(409, f"{worker_id} is {w.state}: only a worker in rotation switches")
        if not [x for x in self.registry.in_rotation(w.role) if x.worker_id != worker_id]:
            raise SwitchRefused(
                409, f"{worker_id} is the last {w.role} worker in rotation: the cluster would have none"
            )
        epoch = max(self.epochs.get(worker_id, 0), w.reg.epoch) + 1
        self.epochs[worker_id] = epoch
        s = Switch(worker_id, w.role, role, epoch)
        self.pending[worker_id] = s
        w.draining = True  # out of rotation now: nothing new is routed to it while it drains
        log.info("role switch of %s: %s -> %s (epoch %d) begins", worker_id, w.role, role, epoch)
        return s

    def expire(self, now: float) -> None:
        for wid, s in list(self.pending.items()):
            if now - s.started > self.timeout_s:
                log.error(
                    "role switch of %s to %s (epoch %d): no Register within %.0f s; given up",
                    wid,
                    s.to_role,
                    s.epoch,
                    self.timeout_s,
                )
                del self.pending[wid]

    def check_register(self, reg: Register) -> tuple[str | None, Switch | None]:
        """(why `reg` is refused, None) for a stale epoch; else (None, the switch it completes or None)."""
        wid = reg.worker_id
        s = self.pending.get(wid)
        if reg.epoch == 0:
            if s is not None:
                log.warning("%s restarted in its launch role during its switch to %s", wid, s.to_role)
                del self.pending[wid]
            return None, None
        if s is not None and reg.epoch == s.epoch:
            if reg.role != s.to_role:
                return f"epoch {reg.epoch} of {wid} is a switch to {s.to_role}, not {reg.role}", None
            return None, s
        known = self.epochs.get(wid, 0)
        if reg.epoch < known:
            return f"stale epoch {reg.epoch}: worker {wid} is at epoch {known}", None
        # The epoch given last (a re-registration after silence), or one this gateway never gave (it
        # restarted since): the worker is what it says.
        self.epochs[wid] = reg.epoch
        return None, None

    def completed(self, s: Switch, old: WorkerInfo | None) -> None:
        """`s`'s Register was accepted: the old connection is retired."""
        self.pending.pop(s.worker_id, None)
        if old is not None:
            self._retired[old.identity] = (s.worker_id, old.reg.epoch)
            while len(self._retired) > RETIRED_KEEP:
                self._retired.popitem(last=False)
        log.info("role switch of %s: now %s (epoch %d)", s.worker_id, s.to_role, s.epoch)

    def retired(self, identity: bytes) -> tuple[str, int] | None:
        """(worker id, epoch) when `identity` is a connection a switch retired."""
        return self._retired.get(identity)
