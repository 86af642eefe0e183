"""Fixtures for the kv_transfer tests: endpoints in real processes (peer.py), driven over stdin/stdout."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pdserve.launch.supervisor import die_with

PEER_SCRIPT = Path(__file__).with_name("peer.py")


class Peer:
    """One peer.py process. `call` sends a command and returns its JSON reply.

    Construction only starts the process (dying with the test run); `wait_ready` then reads its
    ready line, so a caller can register the peer for cleanup before anything can fail.
    """

    def __init__(
        self, role: str, *args: str, prefix: list[str] | None = None, env: dict | None = None
    ) -> None:
        cmd = [*(prefix or []), sys.executable, str(PEER_SCRIPT), role, *args]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            preexec_fn=die_with(os.getpid()),
        )
        # Until the ready line names it, the peer is the process we started (no wrapper prefix yet seen).
        self.pid: int = self.proc.pid
        self.addr: str | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self._stderr.append), daemon=True).start()

    def wait_ready(self, timeout: float = 60) -> Peer:
        ready = self._read(timeout)
        assert ready.get("event") == "ready", ready
        self.addr = ready["addr"]
        self.pid = ready["pid"]
        return self

    @staticmethod
    def _pump(stream, sink) -> None:
        for line in stream:
            sink(line)
        sink(None)

    def _read(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"peer gave no reply within {timeout}s; stderr:\n{self.stderr()}") from None
        if line is None:
            raise RuntimeError(f"peer exited (rc={self.proc.poll()}); stderr:\n{self.stderr()}")
        return json.loads(line)

    def stderr(self) -> str:
        return "".join(s for s in self._stderr if s)[-4000:]

    def call(self, op: str, reply_timeout: float = 90, **fields) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self._read(reply_timeout)

    def post(self, op: str, **fields) -> None:
        """Send a command without waiting for its reply (collect it later with `reply`)."""
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float = 60) -> dict:
        return self._read(timeout)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(
                    self.pid, signal.SIGKILL
                )  # the peer itself (pid from its ready line), then the wrapper
            except ProcessLookupError:
                pass
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def spawn():
    """spawn(role, *args, prefix=None, env=None) -> Peer; every peer is stopped after the test."""
    started: list[Peer] = []

    def make(role: str, *args: str, prefix: list[str] | None = None, env: dict | None = None) -> Peer:
        peer = Peer(role, *args, prefix=prefix, env=env)
        started.append(peer)  # before waiting: a peer that never gets ready is still stopped
        return peer.wait_ready()

    yield make
    for peer in started:
        try:
            os.kill(peer.pid, signal.SIGCONT)
        except OSError:
            pass
        peer.stop()
