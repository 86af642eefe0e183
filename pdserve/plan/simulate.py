"""A discrete-event simulator of a pdserve cluster, driven by a host's measured profile (profile.py).

What it models, as pdserve runs:
- the gateway sends each request, as it arrives, to the prefill worker with the fewest requests queued or
  in its forward, and to the decode worker with the fewest requests assigned and not finished;
- a prefill worker runs one forward at a time over the requests queued, first come first served, up to
  `chunked_prefill_size` tokens and `max_running_requests` (a longer prompt alone); each request's first
  token leaves when the forward ends (TTFT), and its KV reaches the decode worker `transfer(prompt)` later;
- a decode worker runs one step at a time over its running requests (continuous batching: requests whose
  KV has landed join at the next step, up to `max_running_requests`; one token each per step);
- compute: on one CPU host every worker's forwards share the cores. With the profile's `sharing` "turns"
  (what `pdserve up` does, runtime/forward_turns.py) one forward computes at a time, the others waiting in
  arrival order; a forward of at least `offer_min_tokens` offers its turn between layers (`layers` equal
  slices), where one waiting forward runs whole before it goes on. With "processor", k active forwards
  progress at 1/k of the profile's speed each. Either way, while more than one forward is active they run
  at the profile's `shared_efficiency` e of its speed (lock hand-offs, caches, the serving path's own CPU);
  with `shared=False` each worker has a device of its own.
- KV room: with the profile's `kv_tokens`, a decode worker admits a request once its prompt and whole
  answer fit beside those running (a request alone always fits), as the pool's admission reserves them.
- prefill and decode workers may have profiles of their own (`decode_profile`: another TP size, say).
- the prefix cache: a request's `cached` prompt tokens are not computed; reading their KV costs what the
  profile's `prefix_s` measured (nothing without it). Which requests hit is the workload's to say (a
  replayed run's as the server reported them); routing does not follow cached prefixes.
Not modelled: retraction (admission reserves whole answers, so none is needed), chunked prefill's
interleaving with other prompts, speculative decoding, network time between hosts.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.plan.profile import Profile


@dataclass(frozen=True)
class Arrival:
    at: float
    prompt: int
    output: int
    cached: int = 0  # of the prompt's tokens, those the prefill worker's prefix cache holds


@dataclass
class Outcome:
    arrival: float
    prompt: int
    output: int
    cached: int = 0
    first: float = -1.0  # when the first token left
    done: float = -1.0  # when the last did

    @property
    def ttft(self) -> float:
        return self.first - self.arrival

    @property
    def tpot(self) -> float:
        return (self.done - self.first) / (self.output - 1) if self.output > 1 else 0.0


def poisson_workload(
    rate: float, n: int, prompt: int, output: int, seed: int = 0, range_ratio: float = 1.0, cached: int = 0
) -> list[Arrival]:
    """`n` requests arriving at `rate` per second (exponential gaps), lengths uniform in
    [ratio * len, len] (bench serving's random dataset); each prompt's first `cached` tokens (a shared
    system prompt, say) in the prefix cache, the rest drawn."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        p = rng.randint(max(1, int(prompt * range_ratio)), prompt)
        o = rng.randint(max(1, int(output * range_ratio)), output)
        out.append(Arrival(t, cached + p, o, cached))
    return out


@dataclass
class _Job:
    worker: _Worker
    work: float  # seconds left at the profile's speed
    requests: list[_Running]
    slice: float = 0.0  # "turns": the work between two offers of its turn (0: it never offers)
    to_offer: float = 0.0  # the work left before its next offer

    def __post_init__(self) -> None:
        self.to_offer = self.slice or self.work

    def due(self) -> float:
        """Work before its next offer or its end."""
        return min(self.work, self.to_offer)


class _Turns:
    """One host's cores under "turns": the forward holding the turn computes; `paused` are forwards that
    offered theirs between layers (the last resumes first), `waiting` those not begun, in arrival order."""

    def __init__(self) -> None:
        self.holder: _Job | None = None
        self.paused: list[_Job] = []
        self.waiting: deque[_Job] = deque()

    def add(self, job: _Job) -> None:
        if self.holder is None:
            self.holder = job
        else:
            self.waiting.append(job)

    def reached(self) -> _Job | None:
        """The holder did its `due()` work: the job that ended, or None at an offer."""
        h = self.holder
        assert h is not None
        if h.work <= 1e-12:
            self.holder = (
                self.paused.pop() if self.paused else (self.waiting.popleft() if self.waiting else None)
            )
            return h
        h.to_offer = h.slice
        if self.waiting:  # the offer is taken: one waiting forward runs whole, then this one goes on
            self.paused.append(h)
            self.holder = self.waiting.popleft()
        return None


@dataclass
class _Running:
    outcome: Outcome
    context: int
    left: int  # tokens still to produce
    decode_worker: int  # where the gateway sent its decode leg


@dataclass
class _Worker:
    role: str
    index: int
    queue: deque[_Running] = field(default_factory=deque)
    running: list[_Running] = field(default_factory=list)
    job: _Job | None = None
    assigned: int = 0  # decode: requests sent here and not finished; prefill: queued or in the forward
    kv_reserved: int = 0  # decode: KV tokens its running requests hold (prompt and whole answer)


class _Pending:
    """Workers to look at once the current instant's events are all in, in the order they were added."""

    def __init__(self) -> None:
        self._workers: dict[tuple[str, int], _Worker] = {}

    def add(self, index: int, w: _Worker) -> None:
        self._workers.setdefault((w.role, index), w)

    def take(self) -> list[_Worker]:
        out = list(self._workers.values())
        self._workers.clear()
        return out

    def __bool__(self) -> bool:
        return bool(self._workers)


class _Cluster:
    """One simulated run: the workers, the events to come (arrivals, KV landing) and the forwards under
    way; `run` takes the next of a worker starting, a forward reaching its end or an offer, and an event."""

    def __init__(
        self,
        profile: Profile,
        num_prefill: int,
        num_decode: int,
        arrivals: list[Arrival],
        shared: bool,
        dp: Profile,
    ) -> None:
        self.profile, self.dp, self.shared = profile, dp, shared
        self.prefill = [_Worker("prefill", i) for i in range(num_prefill)]
        self.decode = [_Worker("decode", i) for i in range(num_decode)]
        self.outcomes = [Outcome(a.at, a.prompt, a.output, min(a.cached, a.prompt - 1)) for a in arrivals]
        self.events: list[tuple[float, int, str, int]] = []  # (time, seq, "arrive" | "kv", request or KV key)
        self.seq = 0
        for i, a in enumerate(arrivals):
            self._push(a.at, "arrive", i)
        self.jobs: list[_Job] = []
        self.turns = _Turns() if shared and profile.sharing == "turns" else None
        self.t = 0.0
        self.kv_waiting: dict[int, _Running] = {}
        self.pending = _Pending()  # workers to start once every event of this instant is in (a batch forms)

    def _push(self, at: float, kind: str, key: int) -> None:
        heapq.heappush(self.events, (at, self.seq, kind, key))
        self.seq += 1

    def run(self) -> list[Outcome]:
        while self.events or self.jobs or self.pending:
            if self.pending and (not self.events or self.events[0][0] > self.t):
                self._start_pending()
            elif not self._compute():
                self._next_event()
        return self.outcomes

    # ---- admission: arrivals routed by the gateway, KV landing on a decode worker ----

    def _next_event(self) -> None:
        _, _, kind, i = heapq.heappop(self.events)
        if kind == "arrive":
            o = self.outcomes[i]
            p = min(self.prefill, key=lambda w: (w.assigned, w.index))
            d = min(self.decode, key=lambda w: (w.assigned, w.index))
            r = _Running(o, o.prompt + 1, o.output - 1, d.index)
            p.assigned += 1
            d.assigned += 1
            p.queue.append(r)
            self.pending.add(p.index, p)
        else:
            r = self.kv_waiting.pop(i)
            d = self.decode[r.decode_worker]
            d.queue.append(r)
            self.pending.add(d.index, d)

    def _start_pending(self) -> None:
        for w in self.pending.take():
            if w.job is None and w.role == "prefill" and w.queue:
                self._start_prefill(w)
            elif w.job is None and w.role == "decode" and (w.queue or w.running):
                self._start_decode(w)

    def _start(self, job: _Job) -> None:
        self.jobs.append(job)
        if self.turns is not None:
            self.turns.add(job)

    # ---- a prefill turn: the queue's head, up to the chunk and batch limits ----

    def _start_prefill(self, w: _Worker) -> None:
        profile = self.profile
        batch: list[_Running] = []
        tokens = 0
        while w.queue and len(batch) < profile.max_running_requests:
            o = w.queue[0].outcome
            n = o.prompt - o.cached  # only the tokens after a cached prefix are computed
            if batch and tokens + n > profile.chunked_prefill_size:
                break
            batch.append(w.queue.popleft())
            tokens += n
        work = profile.prefill(tokens)
        for r in batch:  # what reading each cached prefix adds
            o = r.outcome
            if o.cached:
                n = o.prompt - o.cached
                work += profile.prefill(n, o.cached) - profile.prefill(n)
        offers = self.turns is not None and tokens >= profile.offer_min_tokens and profile.layers > 1
        w.job = _Job(w, work, batch, work / profile.layers if offers else 0.0)
        self._start(w.job)

    def _finish_prefill(self, job: _Job, now: float) -> None:
        w = job.worker
        for r in job.requests:
            w.assigned -= 1
            r.outcome.first = now
            if r.left == 0:
                r.outcome.done = now
                self.decode[r.decode_worker].assigned -= 1
                continue
            self.kv_waiting[self.seq] = r
            self._push(now + self.profile.transfer(r.outcome.prompt), "kv", self.seq)

    # ---- a decode step: the running requests and those the KV room admits ----

    def _fits(self, w: _Worker, r: _Running) -> bool:
        need = r.outcome.prompt + r.outcome.output
        return not w.running or not self.dp.kv_tokens or w.kv_reserved + need <= self.dp.kv_tokens

    def _start_decode(self, w: _Worker) -> None:
        while w.queue and len(w.running) < self.dp.max_running_requests and self._fits(w, w.queue[0]):
            r = w.queue.popleft()
            w.running.append(r)
            w.kv_reserved += r.outcome.prompt + r.outcome.output
        context = sum(r.context for r in w.running) / len(w.running)
        w.job = _Job(w, self.dp.decode(len(w.running), context), list(w.running))
        self._start(w.job)

    def _finish_decode(self, job: _Job, now: float) -> None:
        w = job.worker
        for r in job.requests:
            r.left -= 1
            r.context += 1
            if r.left == 0:
                r.outcome.done = now
                w.running.remove(r)
                w.assigned -= 1
                w.kv_reserved -= r.outcome.prompt + r.outcome.output

    # ---- bookkeeping: the cores' time shared among the forwards, and forwards ending ----

    def _compute(self) -> bool:
        """Advance to the next forward's end or offer, or to the next event, whichever comes first; True
        where it was a forward's (handled here), False where the event is next."""
        # While more than one forward is active they run at shared_efficiency of the profile's speed; under
        # "processor" sharing each then gets 1/k of it, under "turns" only the turn's holder computes.
        jobs, turns = self.jobs, self.turns
        eff = self.profile.shared_efficiency if self.shared and len(jobs) > 1 else 1.0
        t_event = self.events[0][0] if self.events else float("inf")
        if turns is not None:
            running, speed = ([turns.holder] if turns.holder is not None else []), eff
        else:
            running, speed = jobs, (eff / len(jobs) if self.shared and len(jobs) > 1 else 1.0)
        nxt = min(running, key=_Job.due) if running else None
        t_job = self.t + nxt.due() / speed if nxt is not None else float("inf")
        now = min(t_job, t_event)
        for j in running:
            j.work -= (now - self.t) * speed
            j.to_offer -= (now - self.t) * speed
        self.t = now
        if nxt is None or t_job > t_event:
            return False
        ended = turns.reached() if turns is not None else nxt
        if ended is not None:
            self._finish(ended, now)
        return True

    def _finish(self, job: _Job, now: float) -> None:
        w = job.worker
        w.job = None
        self.jobs.remove(job)
        if w.role == "prefill":
            self._finish_prefill(job, now)
        else:
            self._finish_decode(job, now)
        self.pending.add(w.index, w)


def simulate(
    profile: Profile,
    num_prefill: int,
    num_decode: int,
    arrivals: list[Arrival],
    shared: bool = True,
    decode_profile: Profile | None = None,
) -> list[Outcome]:
    """Every request's first and last token times on a cluster of that split; the decode workers run
    `decode_profile` where given (a TP size of their own), else `profile`."""
    return _Cluster(profile, num_prefill, num_decode, arrivals, shared, decode_profile or profile).run()


# The least shared efficiency a fit considers.
MIN_EFFICIENCY = 0.05


def fit_efficiency(mean_e2e: Callable[[float], float], measured: float) -> float:
    """The shared_efficiency e at which `mean_e2e(e)`, a simulated mean time to the last token that falls
    as e rises, is `measured` (bisection): 1.0 when even e = 1 is that slow (no overlap to tell by), and
    MIN_EFFICIENCY when even that is faster."""
    if mean_e2e(1.0) >= measured:
        return 1.0
    lo, hi = MIN_EFFICIENCY, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if mean_e2e(mid) > measured:
            lo = mid
        else:
            hi = mid
    return round(hi, 4)
