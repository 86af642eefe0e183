"""What prefill and decode workers share: registration, the entry point and the drain loop.

A worker process serves one role at a time. `SwitchRole` from the gateway (POST /workers/{id}/role)
drains the current role as a SIGTERM would, but for at most --switch-drain-timeout (what it still
holds then fails as `draining`, and the gateway runs it on elsewhere), and the process stays:
`run_worker` builds the other role's worker on the same `ModelRunner` (weights, KV pool, kernels;
nothing reloaded), with its prefix cache emptied, and that worker registers again under the
switch's epoch."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from pdserve.cluster_auth import warn_if_open
from pdserve.config import WorkerConfig, worker_config_from_args
from pdserve.model_source import ModelSourceError
from pdserve.protocol import gateway as m
from pdserve.worker.drain import DrainDeadlines, DrainSignal
from pdserve.worker.health import Failure, start_health_server
from pdserve.worker.link import RegistrationRefused, WorkerLink
from pdserve.worker.step_faults import BLIND_FAILURE_LIMIT, StepFailed
from pdserve.worker.test_hooks import TestHooks, warn_test_hooks

# How long an idle worker loop sleeps in `WorkerLink.recv`. What needs the loop wakes it sooner (a
# gateway message, a KV transfer's end); a drain signal or a dead KV engine is noticed within this.
# Short waits cost a wake-up each on cores that a forward of the other worker may be using.
IDLE_WAIT_S = 0.5
# The same while a weight update's background job runs (its reply is polled).
BACKGROUND_WAIT_S = 0.05


def loop_wait(can_compute: bool, weights: WeightUpdater) -> float:
    """How long a worker loop may wait for messages: not at all with work it can do now (and not
    paused), else until woken (`IDLE_WAIT_S`), or `BACKGROUND_WAIT_S` while a weight job runs."""
    wait = 0.0 if can_compute and not weights.paused else IDLE_WAIT_S
    return min(wait, BACKGROUND_WAIT_S) if weights.busy else wait


def paused_for_weights(link: WorkerLink, weights: WeightUpdater, cache_events: CacheEvents) -> bool:
    """A step's weight-update part: the replies of finished weight jobs go out. True while generation
    is paused (/pause_generation): that step runs no forward and only publishes its cache events."""
    for reply in weights.poll():
        link.send(reply)
    if weights.paused:
        cache_events.publish(link)
        return True
    return False


if TYPE_CHECKING:
    from pdserve.runtime.radix_cache import RadixCache
    from pdserve.runtime.runner import ModelRunner
    from pdserve.runtime.weight_update import WeightUpdater
    from pdserve.worker.cache_events import CacheEvents


class _Worker(Protocol):
    runner: ModelRunner
    cache: RadixCache | None

    def serve(self) -> m.SwitchRole | None: ...


def register_factory(
    cfg: WorkerConfig,
    runner: ModelRunner,
    clock: Callable[[], float],
    bootstrap_addr: str | None,
    weight_version: Callable[[], str],
) -> Callable[[], m.Register]:
    spec = runner.spec

    def make() -> m.Register:
        return m.Register(
            worker_id=cfg.worker_id,
            role=cfg.role,  # type: ignore[arg-type]
            bootstrap_addr=bootstrap_addr,
            fingerprint=runner.fingerprint(),
            model_name=cfg.runtime.model_path or "default",
            max_total_tokens=runner.max_total_tokens,
            tp_size=runner.cfg.tp_size,
            epoch=cfg.epoch,
            max_running_requests=cfg.runtime.max_running_requests,
            context_length=runner.context_length,
            vocab_size=spec.vocab_size,
            t_send=clock(),
            weight_version=weight_version(),
        )

    return make


def connect_link(
    cfg: WorkerConfig,
    runner: ModelRunner,
    clock: Callable[[], float],
    signals: DrainSignal,
    weights: WeightUpdater,
    bootstrap_addr: str | None = None,
    link_type: Callable[..., WorkerLink] = WorkerLink,
) -> WorkerLink:
    """The worker's control link to the gateway, started and registered (a drain cancels the wait).
    `link_type`: WorkerLink, or a test hook's (test_hooks.py)."""
    register = register_factory(cfg, runner, clock, bootstrap_addr, lambda: weights.version)
    link = link_type(cfg.gateway_addr, register, clock, keys=cfg.keys)
    link.start()
    link.wait_registered(cfg.register_timeout_s, cancel=signals.draining)
    return link


def run_worker(role: str, args: argparse.Namespace) -> int:
    """Entry of `pdserve prefill|decode`: build the worker, serve until drained, and again in the other
    role after each switch (same runner); CLI errors exit 2."""
    signals = DrainSignal()
    signals.install()
    runner: ModelRunner | None = None
    try:
        cfg = worker_config_from_args(args, role)
        hooks = TestHooks.from_args(args)
        warn_test_hooks(args, role)
        warn_if_open(
            cfg.keys, "this worker's control link" + (" and KV bootstrap port" if role == "prefill" else "")
        )
        while True:
            worker = _worker_class(cfg.role)(cfg, signals, runner, hooks)
            runner = worker.runner
            switch = worker.serve()
            if switch is None:
                return 0
            if worker.cache is not None:  # the new role starts with an empty prefix cache
                worker.cache.invalidate()
            held = runner.allocator.num_pages - runner.allocator.num_free
            logging.getLogger(f"pdserve.{cfg.role}").info(
                "role switch: %s -> %s (epoch %d) on the same weights; %d KV pages still held",
                cfg.role,
                switch.role,
                switch.epoch,
                held,
            )
            cfg = dataclasses.replace(cfg, role=switch.role, epoch=switch.epoch)
    except (ValueError, ModelSourceError, RegistrationRefused, TimeoutError) as e:
        print(f"pdserve {role}: {e}", file=sys.stderr)
        return 2
    except (EngineDead, StepFailed) as e:
        print(f"pdserve {role}: {e}", file=sys.stderr)
        return 1
    finally:
        if runner is not None:
            runner.close()


def _worker_class(
    role: str,
) -> Callable[[WorkerConfig, DrainSignal, ModelRunner | None, TestHooks | None], _Worker]:
    if role == "prefill":
        from pdserve.prefill.worker import PrefillWorker

        return PrefillWorker
    from pdserve.decode.worker import DecodeWorker

    return DecodeWorker


def accept_switch(cfg: WorkerConfig, msg: m.SwitchRole, current: m.SwitchRole | None) -> m.SwitchRole | None:
    """The switch a worker of `cfg` takes from `msg` (`current`: one it took already). A switch to the
    role it has, or of an epoch not newer than its own, is logged and ignored."""
    log = logging.getLogger(f"pdserve.{cfg.role}")
    if current is not None or msg.role == cfg.role or msg.epoch <= cfg.epoch:
        log.warning(
            "ignoring a switch to %s (epoch %d): this worker is %s at epoch %d%s",
            msg.role,
            msg.epoch,
            cfg.role,
            cfg.epoch,
            ", switching already" if current is not None else "",
        )
        return current
    log.info("switching to %s (epoch %d): draining this role first", msg.role, msg.epoch)
    return msg


def serve_until_drained(
    cfg: WorkerConfig,
    link: WorkerLink,
    signals: DrainSignal,
    step: Callable[[], None],
    outstanding: Callable[[], int],
    failure: Failure | None = None,
    switching: Callable[[], bool] = lambda: False,
    hand_off: Callable[[], None] = lambda: None,
) -> None:
    """Run `step` until stopped; on drain: deregister, keep stepping until nothing is outstanding
    (or the drain timeout), then return. Serves the health port meanwhile, when one is set.

    `failure` (the KV engine's `io_failure`): once it reports, the worker is unhealthy on its health
    port, leaves rotation and drains; it then raises `EngineDead`, so that its process exits non-zero
    and a supervisor restarts it.

    An exception out of `step` (the workers fail the requests whose work raised, see step_faults.py;
    what is left is the loop's own work) is logged and the loop goes on; `BLIND_FAILURE_LIMIT` of
    them in a row raise `StepFailed`, so that a worker broken for good exits and is restarted.

    `switching` (a `SwitchRole` taken): drain the same way, then return, the process staying up; but
    past `cfg.switch_drain_timeout_s`, `hand_off()` (each step while anything is outstanding) fails
    what the worker holds with code `draining`, which the gateway runs on elsewhere."""
    log = logging.getLogger(f"pdserve.{cfg.role}")
    failed_steps = 0
    failure = failure or (lambda: None)
    health = start_health_server(cfg.host, cfg.health_port, link, signals, failure)
    drain: DrainDeadlines | None = None
    dead: str | None = None
    try:
        while not signals.stop.is_set():
            if dead is None and (dead := failure()) is not None:
                log.error("%s: leaving rotation and draining", dead)
                signals.draining.set()
            if (signals.draining.is_set() or switching()) and drain is None:
                drain = DrainDeadlines.start(cfg, switch=not signals.draining.is_set())
                link.load.draining = True
                link.send(m.Deregister(worker_id=cfg.worker_id))
                log.info("draining: %d requests left", outstanding())
            if drain is not None and outstanding() and drain.hand_off_due():
                if not drain.handing_off:
                    drain.handing_off = True
                    log.warning(
                        "the switch's drain deadline (%g s) passed: handing off %d requests",
                        cfg.switch_drain_timeout_s,
                        outstanding(),
                    )
                hand_off()
            if drain is not None and (not outstanding() or drain.over()):
                log.info(
                    "drained; %s",
                    "switching role" if switching() and not signals.draining.is_set() else "exiting",
                )
                break
            try:
                step()
                failed_steps = 0
            except StepFailed:
                raise
            except Exception as exc:  # noqa: BLE001 - one bad step must not end the worker
                failed_steps += 1
                log.error("a step failed (%d in a row); going on", failed_steps, exc_info=exc)
                if failed_steps >= BLIND_FAILURE_LIMIT:
                    raise StepFailed(
                        f"{failed_steps} steps in a row failed: {type(exc).__name__}: {exc}"
                    ) from exc
    finally:
        if health is not None:
            health.close()
    if dead is not None:
        raise EngineDead(dead)


class EngineDead(RuntimeError):
    """An engine thread of the worker died (see serve_until_drained)."""
