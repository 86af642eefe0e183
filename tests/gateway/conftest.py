"""Gateway fixtures: the bundled tokenizer (loaded once) and an in-process gateway on free ports."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.server import create_app
from pdserve.gateway.text.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(None)


def gateway_client(tokenizer: Tokenizer, **overrides) -> TestClient:
    """A TestClient over a fresh app; its control socket binds a free port (`control_addr`)."""
    # A worker silent for 3 s is removed: 1 s removed a live in-process worker once on a loaded 2-core
    # CI machine (most likely its link thread waiting for the GIL); tests that stop a worker wait up to 10 s.
    cfg = dataclasses.replace(
        GatewayConfig(
            control_host="127.0.0.1", control_port=0, heartbeat_interval_s=0.1, heartbeat_timeout_s=3.0
        ),
        **overrides,
    )
    return TestClient(create_app(cfg, tokenizer=tokenizer), raise_server_exceptions=False)


def control_addr(client: TestClient) -> str:
    return f"tcp://127.0.0.1:{client.app.state.gw.control.bound_port}"


@pytest.fixture
def client(tokenizer: Tokenizer) -> Iterator[TestClient]:
    with gateway_client(tokenizer) as c:
        yield c


# ---- workers speaking the real wire protocol (through the workers' own control link) ---------------

import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

from pdserve.protocol import gateway as m  # noqa: E402
from pdserve.worker.link import WorkerLink  # noqa: E402

FINGERPRINT = {"architecture": "llama", "num_layers": 30, "page_size": 16, "dtype": "bfloat16"}

# A decode script: GenerateRequest -> the TokenOutputs of each step (events/stats are added here).
Script = Callable[[m.GenerateRequest], list[m.TokenOutput]]


class WireWorker:
    """A prefill or decode stand-in for gateway tests: registers, answers pings through
    `WorkerLink`, and answers GenerateRequest from a script (no model).

    prefill: sends PrefillDone (or RequestFailed when `fail_code` is set); for a request without a
    decode leg (at most one token) it carries the script's answer, as a prefill node's would.
    decode: sends one TokenBatch per script step every `step_s`, stops a room on AbortRequest.
    `skew_s` shifts this worker's clock, as a worker on another machine would be.
    """

    def __init__(
        self,
        addr: str,
        worker_id: str,
        role: str,
        script: Script | None = None,
        skew_s: float = 0.0,
        step_s: float = 0.005,
        fingerprint: dict | None = None,
        context_length: int = 2048,
        vocab_size: int = 49152,
        fail_code: str | None = None,
        prefill_delay_s: float = 0.0,
        max_total_tokens: int = 4096,
    ) -> None:
        self.worker_id, self.role, self.script = worker_id, role, script
        self.skew_s, self.step_s, self.fail_code = skew_s, step_s, fail_code
        self.prefill_delay_s = prefill_delay_s
        self.kv_wait_s = 0.0  # decode: seconds before a request's first step (its KV "arriving")
        self.fingerprint = fingerprint or dict(FINGERPRINT)
        self.context_length, self.vocab_size = context_length, vocab_size
        self.max_total_tokens = max_total_tokens
        self.received: list = []
        self.aborted: list[str] = []
        self.events: dict[str, dict[str, float]] = {}  # room -> the event times sent (worker clock)
        self._active: dict[str, list[m.TokenOutput]] = {}
        self._first_step_at: dict[str, float] = {}
        self._delayed: list[tuple[float, m.PrefillDone]] = []
        self._stop = threading.Event()
        self.link = WorkerLink(addr, self._register, self.clock, reregister_after_s=3.0)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def clock(self) -> float:
        return time.time() + self.skew_s

    def _register(self) -> m.Register:
        return m.Register(
            worker_id=self.worker_id,
            role=self.role,
            bootstrap_addr="127.0.0.1:9" if self.role == "prefill" else None,
            fingerprint=self.fingerprint,
            model_name="smollm2",
            max_total_tokens=self.max_total_tokens,
            max_running_requests=16,
            context_length=self.context_length,
            vocab_size=self.vocab_size,
            t_send=self.clock(),
        )

    def start(self, wait: bool = True) -> WireWorker:
        self.link.start()
        if wait:
            self.link.wait_registered(5.0)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Go silent: no more pongs or outputs (as a crashed worker)."""
        self._stop.set()
        self._thread.join(timeout=2)
        self.link.close()

    def requests(self) -> list[m.GenerateRequest]:
        return [r for r in self.received if isinstance(r, m.GenerateRequest)]

    def _run(self) -> None:
        while not self._stop.is_set():
            for msg in self.link.recv(self.step_s):
                self.received.append(msg)
                if isinstance(msg, m.AbortRequest):
                    self.aborted.append(msg.room)
                    self._active.pop(msg.room, None)
                elif isinstance(msg, m.GenerateRequest):
                    self._on_request(msg)
            now = time.time()
            for due, done in [d for d in self._delayed if d[0] <= now]:
                self._delayed.remove((due, done))
                self.link.send(done)
            if self.role == "decode" and self._active:
                outs = []
                for room, steps in list(self._active.items()):
                    if self._first_step_at.get(room, 0.0) > now:
                        continue
                    out = steps.pop(0)
                    if not steps:
                        del self._active[room]
                        if out.finished:  # finished now: the true time, as a decode node stamps it
                            out.events = {**(out.events or {}), "finished": self.clock()}
                    self.events[room].update(out.events or {})
                    outs.append(out)
                if outs:
                    self.link.send(m.TokenBatch(worker_id=self.worker_id, outputs=outs))

    def _on_request(self, req: m.GenerateRequest) -> None:
        c = self.clock()
        if self.role == "prefill":
            if self.fail_code:
                self.link.send(
                    m.RequestFailed(room=req.room, role="prefill", code=self.fail_code, message="injected")
                )
                return
            ev = {"queue_entry": c, "forward_entry": c + 0.001, "prefill_finished": c + 0.002}
            self.events[req.room] = ev
            first = None
            if not req.decode_worker:
                if req.sampling.max_new_tokens == 0:
                    reason = {"type": "length", "length": 0}
                    first = m.TokenOutput(room=req.room, token_ids=[], finished=True, finish_reason=reason)
                else:
                    assert self.script is not None
                    first = self.script(req)[0]
            done = m.PrefillDone(room=req.room, events=ev, cached_tokens=1, first=first)
            self._delayed.append((time.time() + self.prefill_delay_s, done))
            return
        if self.fail_code:
            self.link.send(
                m.RequestFailed(room=req.room, role="decode", code=self.fail_code, message="injected")
            )
            return
        steps = [s.model_copy() for s in self.script(req)]
        steps[0].events = {"decode_entry": c, "kv_ready": c + self.kv_wait_s + 0.003}
        if steps[-1].finished:
            steps[-1].stats = {
                "cached_tokens": 1,
                "num_retractions": 0,
                "spec_verify_ct": len(steps),
                "spec_num_proposed_drafts": 3 * len(steps),
                "spec_num_correct_drafts": sum(len(s.token_ids) for s in steps) - len(steps),
                "spec_correct_drafts_histogram": [1, 2, 0, 0],
            }
        self.events[req.room] = {}
        self._first_step_at[req.room] = time.time() + self.kv_wait_s
        self._active[req.room] = steps


def text_script(tokenizer: Tokenizer, reply: str, per_step: int = 2, with_logprobs: bool = True) -> Script:
    """Decode `reply`'s tokens (then EOS), `per_step` per step, cut at max_new_tokens like a decode node."""
    reply_ids = tokenizer.encode(reply)
    eos = tokenizer.eos_token_id

    def script(req: m.GenerateRequest) -> list[m.TokenOutput]:
        ids = reply_ids + [eos]
        stop_ids = set(req.sampling.stop_token_ids) | ({eos} if not req.sampling.ignore_eos else set())
        n = req.sampling.max_new_tokens
        out: list[int] = []
        reason: dict = {"type": "length", "length": n}
        for t in ids[:n]:
            out.append(t)
            if t in stop_ids:
                reason = {"type": "stop", "matched": t}
                break
        if reason["type"] == "length":
            reason["length"] = len(out)
        steps = []
        for i in range(0, len(out), per_step):
            chunk = out[i : i + per_step]
            lp = [-0.5] * len(chunk) if req.sampling.logprobs and with_logprobs else None
            top = (
                [[(t, -0.5), (t + 1, -1.5)][: req.sampling.top_logprobs_num] for t in chunk]
                if req.sampling.top_logprobs_num
                else None
            )
            steps.append(m.TokenOutput(room=req.room, token_ids=chunk, logprobs=lp, top_logprobs=top))
        steps[-1].finished = True
        steps[-1].finish_reason = reason
        return steps

    return script


class WireCluster:
    """A gateway (config `overrides`) plus one prefill and one decode WireWorker (reply text settable)."""

    def __init__(self, tokenizer: Tokenizer, **overrides) -> None:
        self.tokenizer = tokenizer
        self.client = gateway_client(tokenizer, **overrides).__enter__()
        self.addr = control_addr(self.client)
        self.reply = "The capital of France is Paris. Ça coûte 5 €, 日本語も!"
        self.workers: list[WireWorker] = []
        self.prefill = self.add("p0", "prefill")
        self.decode = self.add("d0", "decode")

    def add(self, worker_id: str, role: str, **kw) -> WireWorker:
        kw.setdefault("script", lambda req: text_script(self.tokenizer, self.reply)(req))
        w = WireWorker(self.addr, worker_id, role, **kw).start()
        self.workers.append(w)
        return w

    def close(self) -> None:
        for w in self.workers:
            if not w._stop.is_set():
                w.stop()
        self.client.__exit__(None, None, None)


@pytest.fixture
def cluster(tokenizer: Tokenizer):
    """A gateway plus one prefill and one decode WireWorker (reply text settable per test)."""
    c = WireCluster(tokenizer)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def wire_cluster(tokenizer: Tokenizer):
    """Build WireClusters with gateway config overrides: `wire_cluster(reasoning_parser="qwen3")`."""
    made: list[WireCluster] = []

    def make(**overrides) -> WireCluster:
        made.append(WireCluster(tokenizer, **overrides))
        return made[-1]

    try:
        yield make
    finally:
        for c in made:
            c.close()


@pytest.fixture
def limited_gateway(tmp_path) -> Iterator[str]:
    """`pdserve gateway` as its own process, two requests per client, an inference and an admin key."""
    from harness import start_gateway, stop_processes

    flags = ["--max-requests-per-client", "2", "--api-key", "user-key", "--admin-api-key", "admin-key"]
    proc, port, _ = start_gateway(str(tmp_path), [*flags, "--log-level", "warning"])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_processes([proc], grace_s=10)
