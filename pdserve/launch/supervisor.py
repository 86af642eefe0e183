"""Process supervision shared by the launchers (`pdserve up`, `deploy/launch.py`).

Every child runs in a session of its own, so a terminal's Ctrl-C reaches the launcher only, which
then drains the children, and a child's whole process group can be stopped at once. Every child
also dies with its launcher, even when the launcher is SIGKILLed (Linux `PR_SET_PDEATHSIG`), so an
interrupted launcher leaves no orphans behind.

A child that dies unexpectedly is started again with the same arguments after a backoff that
doubles from `RestartPolicy.backoff_initial_s` up to `backoff_max_s`. One restarted `max_restarts`
times within `window_s` is crash-looping: it is retried every `backoff_max_s`, never given up on
(whatever killed it, a bad request or a full disk, may pass), and the launcher never exits for it.
The log says when a child enters the crash loop and when it leaves it (fewer than `max_restarts`
restarts within the window again), not at every attempt; each start still logs its pid. A worker
that exits 0 drained on request (a SIGTERM sent to it alone) is let go, not restarted.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

_PR_SET_PDEATHSIG = 1
# Loaded once here: a forked child should not have to dlopen anything before it execs.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


@dataclass(frozen=True)
class Child:
    name: str  # "gateway", or "<role>-<i>"
    argv: list[str]
    env: dict[str, str]  # added to the launcher's environment

    @property
    def role(self) -> str:
        return role_of(self.name)


def role_of(name: str) -> str:
    """ "prefill" of "prefill-0": the role in a child's name."""
    return name.split("-", 1)[0]


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    max_restarts: int = 5  # within window_s; past it, retries come every backoff_max_s
    window_s: float = 300.0


class ChildState(StrEnum):
    RUNNING = "running"
    BACKOFF = "restarting"  # crashed; starts again at `restart_at`
    DRAINED = "drained"  # exited 0 on its own: let go


@dataclass
class _Slot:
    child: Child
    proc: subprocess.Popen[bytes]
    state: ChildState = ChildState.RUNNING
    restart_at: float = 0.0
    restarts: deque[float] = field(default_factory=deque)  # monotonic times, within the window
    total_restarts: int = 0
    crash_looping: bool = False  # restarted max_restarts times within the window: retried at the cap


def die_with(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn`: the kernel SIGKILLs the child when the thread that started it exits."""

    def arm() -> None:
        if _LIBC is None:  # not Linux: the launcher's own stop() still applies
            return
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(1)

    return arm


def pdserve_command(*args: str, python: str | None = None) -> list[str]:
    """The argv of `pdserve <args>` run by `python` (default: this interpreter), as every launcher,
    benchmark and test starts a pdserve process.

    `-P` keeps the working folder off the child's sys.path. Started from a checkout's root, the
    child would otherwise import the checkout's top-level folders as packages of their own, and
    `kernels/` (installed as `pdserve.kernels`) would stand in for the `kernels` distribution that
    transformers imports, which then fails to import.
    """
    return [python or sys.executable, "-P", "-m", "pdserve.cli", *args]


def spawn(
    argv: list[str], log_path: str | None, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start `argv` in its own session, dying with this process; output appended to `log_path`."""
    out = open(log_path, "ab") if log_path else None
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=die_with(os.getpid()),
        )
    finally:
        if out:
            out.close()


def signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    # The group id is the child's pid (its own session); it outlives the leader while members remain.
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """The children of one launcher: start, restart, watch, stop (workers first, then the gateway)."""

    def __init__(
        self,
        log_dir: str | None,
        stop_timeout_s: float,
        prefix: str = "launch",
        policy: RestartPolicy | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.stop_timeout_s = stop_timeout_s
        self.prefix = prefix
        self.policy = policy or RestartPolicy()
        self.slots: dict[str, _Slot] = {}
        self.stopping = False
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)

    def handle_signals(self) -> None:
        def on_signal(signum: int, frame: object) -> None:
            self.stopping = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def say(self, text: str, error: bool = False) -> None:
        print(f"{self.prefix}: {text}", file=sys.stderr if error else sys.stdout, flush=True)

    def _spawn(self, c: Child) -> subprocess.Popen[bytes]:
        path = os.path.join(self.log_dir, f"{c.name}.log") if self.log_dir else None
        p = spawn(c.argv, path, c.env)
        self.say(f"started {c.name} pid {p.pid}" + (f" log {path}" if path else ""))
        return p

    def start(self, c: Child) -> subprocess.Popen[bytes]:
        p = self._spawn(c)
        self.slots[c.name] = _Slot(c, p)
        return p

    def set_argv(self, name: str, argv: list[str]) -> None:
        """What a restart of `name` runs from now on (e.g. the gateway on the ports it first bound)."""
        slot = self.slots[name]
        slot.child = Child(name, argv, slot.child.env)

    def proc(self, name: str) -> subprocess.Popen[bytes]:
        return self.slots[name].proc

    def states(self) -> dict[str, ChildState]:
        return {name: slot.state for name, slot in self.slots.items()}

    def crash_looping(self) -> list[str]:
        """The children retried at the longest backoff (see the module docstring)."""
        return [name for name, slot in self.slots.items() if slot.crash_looping]

    def poll(self) -> None:
        """Notice exits, and start again what is due."""
        now = time.monotonic()
        for name, slot in self.slots.items():
            if slot.state == ChildState.RUNNING:
                rc = slot.proc.poll()
                if rc is None:
                    if slot.crash_looping:
                        self._maybe_recovered(slot, now)
                    continue
                if rc == 0 and slot.child.role != "gateway":
                    slot.state = ChildState.DRAINED
                    self.say(f"{name} exited after draining")
                    continue
                self._crashed(slot, rc, now)
            elif slot.state == ChildState.BACKOFF and now >= slot.restart_at and not self.stopping:
                slot.restarts.append(now)
                slot.total_restarts += 1
                slot.proc = self._spawn(slot.child)
                slot.state = ChildState.RUNNING

    def _prune(self, slot: _Slot, now: float) -> int:
        """The restarts within the window (older ones forgotten)."""
        while slot.restarts and now - slot.restarts[0] > self.policy.window_s:
            slot.restarts.popleft()
        return len(slot.restarts)

    def _refusal(self, name: str, rc: int) -> str:
        """For a child that exited with 2 (the CLI's refusal of its flags or model: restarting does not
        help), the line of its log that says why, else ''."""
        if rc != 2 or not self.log_dir:
            return ""
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4096))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        said = [line for line in lines if line.startswith("pdserve ")]
        return f" ({said[-1]})" if said else ""

    def _crashed(self, slot: _Slot, rc: int, now: float) -> None:
        p = self.policy
        recent = self._prune(slot, now)
        name = slot.child.name
        why = self._refusal(name, rc)
        slot.state = ChildState.BACKOFF
        if recent >= p.max_restarts:
            slot.restart_at = now + p.backoff_max_s
            if not slot.crash_looping:  # one line when it starts, none at each attempt
                slot.crash_looping = True
                self.say(
                    f"{name} exited with {rc}{why} and was restarted {recent} times within {p.window_s:.0f} s: "
                    f"crash-looping, retried every {p.backoff_max_s:g} s until it stays up",
                    error=True,
                )
            return
        delay = min(p.backoff_max_s, p.backoff_initial_s * 2**recent)
        slot.restart_at = now + delay
        self.say(f"{name} exited with {rc}{why}; restarting in {delay:g} s", error=True)

    def _maybe_recovered(self, slot: _Slot, now: float) -> None:
        recent = self._prune(slot, now)
        if recent < max(1, self.policy.max_restarts):
            slot.crash_looping = False
            self.say(
                f"{slot.child.name} has stayed up ({recent} restarts within the last "
                f"{self.policy.window_s:.0f} s): out of the crash loop"
            )

    def wait_until(self, ready: Callable[[], bool], timeout_s: float) -> str | None:
        """Poll `ready` until it holds; None then, else why it never will (a signal, time). A child
        that crash-loops meanwhile is retried until the timeout."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            self.poll()
            why = "stopped" if self.stopping else None
            if why is None and time.monotonic() > deadline:
                looping = self.crash_looping()
                why = f"not healthy within {timeout_s:.0f} s" + (
                    f" ({', '.join(looping)} crash-looping)" if looping else ""
                )
            if why:
                return why
            time.sleep(0.2)
        return None

    def watch(self) -> int:
        """Until a signal (0): a crashing child, even one that crash-loops, never ends the watch."""
        while not self.stopping:
            self.poll()
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        """SIGTERM each process group, workers before the gateway so they can finish and deregister;
        SIGKILL whatever is left after the grace."""
        order = sorted(self.slots.values(), key=lambda s: s.child.role == "gateway")
        workers = [s.proc for s in order if s.child.role != "gateway"]
        for slot in order:
            if slot.child.role == "gateway" and any(p.poll() is None for p in workers):
                _wait(workers, self.stop_timeout_s)
            signal_group(slot.proc, signal.SIGTERM)
        _wait([s.proc for s in order], self.stop_timeout_s)
        for slot in order:
            signal_group(slot.proc, signal.SIGKILL)  # whatever is left in each group, leader or not
            slot.proc.wait()


def _wait(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
