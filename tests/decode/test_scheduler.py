"""The decode node's page policy: retraction under pool pressure, resumption by recomputation."""

from __future__ import annotations

import pytest

from pdserve.config import RuntimeConfig, WorkerConfig
from pdserve.decode import worker as decode_worker
from pdserve.decode.scheduler import ADMISSION_HEADROOM, DecodeScheduler
from pdserve.protocol import gateway as m
from pdserve.runtime.kv_pool import PageAllocator, RequestPages
from pdserve.runtime.request import Request, RequestState
from pdserve.runtime.runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.worker.link import LoadReport

PROMPTS = [[504, 3575, 282, 4649, 314], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [9999, 123, 77], [42] * 20]


class GatewayStub:
    """The decode worker's link to the gateway, reduced to what `DecodeWorker.step` uses: the
    messages it is handed, the messages it sends."""

    def __init__(self, inbox: list[m.Message]) -> None:
        self.inbox, self.sent = inbox, []
        self.load = LoadReport()

    def recv(self, wait: float) -> list[m.Message]:
        msgs, self.inbox = self.inbox, []
        return msgs

    def send(self, msg: m.Message) -> None:
        self.sent.append(msg)

    def wake(self) -> None:
        pass


def run_to_completion(worker: decode_worker.DecodeWorker, reqs: list[m.GenerateRequest]):
    """Step the real decode worker until it has served `reqs`, each a local prefill (its prompt's KV
    computed on the worker in place of a transfer, which is not what this test is about). Returns
    each room's output tokens, its final stats, and how many retractions happened."""
    retractions = 0
    grow_or_retract = worker.sched.grow_or_retract

    def counted() -> list[Request]:
        nonlocal retractions
        retracted = grow_or_retract()
        retractions += len(retracted)
        return retracted

    worker.sched.grow_or_retract = counted  # type: ignore[method-assign]
    link = worker.link = GatewayStub(list(reqs))  # type: ignore[assignment]
    for _ in range(2000):
        worker.step()
        worker.runner.allocator.check_invariants()
        if not len(worker.sched) and not link.inbox:
            break
    else:
        raise AssertionError("the worker did not finish the work")
    tokens: dict[str, list[int]] = {r.room: [] for r in reqs}
    stats = {}
    for msg in link.sent:
        assert isinstance(msg, m.TokenBatch), msg
        for out in msg.outputs:
            tokens[out.room] += out.token_ids
            if out.finished:
                stats[out.room] = out.stats
    return tokens, stats, retractions


@pytest.mark.timeout(900)
def test_small_pool_retracts_resumes_and_matches_engine(bundled, make_engine, monkeypatch):
    params = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    ref = [o.output_ids for o in make_engine(bundled).generate(PROMPTS, params)]

    # 14 pages of 16 tokens: each request needs 5 pages over its life; the four together need 20.
    runtime = RuntimeConfig(
        device="cpu",
        max_total_tokens=224,
        page_size=16,
        attention_backend="torch",
        max_running_requests=8,
        disable_radix_cache=True,
    )
    monkeypatch.setattr(decode_worker, "ModelRunner", lambda cfg: ModelRunner(cfg, bundled))
    worker = decode_worker.DecodeWorker(WorkerConfig(role="decode", runtime=runtime, worker_id="decode-0"))
    reqs = [
        m.GenerateRequest(
            room=f"r{i}",
            input_ids=p,
            sampling=params,
            prefill_worker="",
            prefill_bootstrap_addr="",
            decode_worker="decode-0",
            local_prefill=True,
        )
        for i, p in enumerate(PROMPTS)
    ]
    try:
        tokens, stats, retractions = run_to_completion(worker, reqs)
    finally:
        worker.weights.close()
        worker.receiver.close()

    assert retractions > 0
    assert sum(stats[r.room]["num_retractions"] for r in reqs) == retractions
    for r, expected in zip(reqs, ref):
        assert tokens[r.room] == expected, r.room
    allocator = worker.runner.allocator
    assert allocator.num_free == allocator.num_pages


# The page policy alone: an allocator and requests, no model. A "step" appends a token the way a
# stepper would, after checking that the pages cover the KV the step writes.
PAGE = 4


def make_sched(num_pages: int, max_running: int = 8, lookahead: int = 1) -> DecodeScheduler:
    return DecodeScheduler(RequestPages(PageAllocator(num_pages), PAGE), max_running, lookahead)


def req(i: int, prompt_len: int, max_new: int) -> Request:
    return Request(
        f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    )


def fake_step(sched: DecodeScheduler) -> None:
    for r in sched.running:
        assert r.state is RequestState.RUNNING
        assert len(r.pages) * PAGE >= r.num_tokens, "the step would write KV past the request's pages"
        r.num_computed = r.num_tokens  # the newest token's KV is written; a new token is sampled
        r.append_token(7)


def fake_recompute(reqs: list[Request]) -> None:
    for r in reqs:
        assert len(r.pages) * PAGE >= r.num_tokens - 1
        r.num_computed = r.num_tokens - 1


def test_admission_reserves_prompt_plus_headroom_within_slots():
    sched = make_sched(num_pages=100, max_running=2)
    reqs = [req(i, 10, 100) for i in range(3)]
    for r in reqs:
        sched.add(r)
    admitted = sched.admit()
    assert admitted == reqs[:2]  # the third has no slot: transferring requests hold one
    for r in admitted:
        assert r.state is RequestState.TRANSFERRING and sched.is_transferring(r.room)
        assert len(r.pages) == -(-(10 + ADMISSION_HEADROOM) // PAGE)
    assert reqs[2].state is RequestState.QUEUED and reqs[2].pages == []
    assert sched.kv_arrived("r0") is reqs[0]
    assert reqs[0].state is RequestState.RUNNING and reqs[0].num_computed == 10
    assert sched.kv_arrived("r0") is None  # a room is collected once
    assert sched.admit() == []  # r0 running + r1 transferring still fill both slots
    with pytest.raises(ValueError, match="not QUEUED"):
        sched.add(reqs[0])


def test_admission_waits_for_pages():
    sched = make_sched(num_pages=12)
    a, b = req(0, 20, 20), req(1, 20, 20)  # 40 tokens = 10 pages each at admission
    sched.add(a)
    sched.add(b)
    assert sched.admit() == [a]
    assert b.state is RequestState.QUEUED and sched.pages.allocator.num_free == 2
    assert sched.kv_failed("r0") is a  # a failed transfer frees the pages at once
    assert a.state is RequestState.FAILED and a.pages == []
    assert sched.admit() == [b]


def test_pool_pressure_retracts_newest_and_resumes_oldest_first():
    sched = make_sched(num_pages=28)
    reqs = [req(i, 4, 100) for i in range(3)]
    for r in reqs:
        sched.add(r)
    assert sched.admit() == reqs  # 36 tokens = 9 pages each; one page left over
    for r in reqs:
        sched.kv_arrived(r.room)
        r.append_token(5)
    retracted: list[Request] = []
    while len(retracted) < 2:
        fake_step(sched)
        retracted += sched.grow_or_retract()
    assert retracted == [reqs[2], reqs[1]]  # the newest goes first; the oldest keeps running
    for r in retracted:
        assert r.state is RequestState.RETRACTED and r.pages == [] and r.num_retractions == 1
        assert r.num_computed == 0 and len(r.output_ids) > 30  # KV gone, outputs kept
    assert list(sched.retracted) == [reqs[1], reqs[2]]  # oldest first
    sched.add(req(9, 1, 1))
    assert sched.admit() == []  # new work waits while retracted work does
    while reqs[0].state is RequestState.RUNNING:
        fake_step(sched)
        assert sched.grow_or_retract() == []
        sched.retire_finished()
    assert reqs[0].state is RequestState.FINISHED and reqs[0].pages == []
    resumed = sched.resume_retracted()
    assert resumed[0] is reqs[1]  # oldest first
    assert all(r.state is RequestState.RUNNING and r.num_computed == 0 and r.pages for r in resumed)
    sched.pages.allocator.check_invariants()


def test_remove_fails_the_request_and_frees_its_pages():
    sched = make_sched(num_pages=40, max_running=3)
    reqs = [req(i, 8, 8) for i in range(4)]
    for r in reqs:
        sched.add(r)
    sched.admit()  # r0..r2 transferring, r3 pending
    sched.kv_arrived("r0")
    assert sched.remove("r1") is None  # transferring: left to the receiver (abort, then kv_failed)
    assert reqs[1].state is RequestState.TRANSFERRING
    for r in (reqs[0], reqs[3]):
        assert sched.remove(r.room) is r
        assert r.state is RequestState.FAILED and r.pages == []
    sched.kv_arrived("r2")
    sched.retract(reqs[2])
    assert sched.remove("r2") is reqs[2] and reqs[2].state is RequestState.FAILED
    assert sched.kv_failed("r1") is reqs[1] and reqs[1].state is RequestState.FAILED
    assert len(sched) == 0 and sched.pages.allocator.num_free == 40
    sched.pages.allocator.check_invariants()


@pytest.mark.parametrize("lookahead", [1, 3])
def test_many_requests_on_a_small_pool_all_finish(lookahead):
    sched = make_sched(num_pages=24, max_running=6, lookahead=lookahead)
    reqs = [req(i, 3 + 5 * (i % 4), 30 + 7 * (i % 3)) for i in range(10)]
    for r in reqs:
        sched.add(r)
    retractions = 0
    for _ in range(2000):
        fake_recompute(sched.resume_retracted())
        for r in sched.admit():
            assert sched.kv_arrived(r.room) is r
            r.append_token(5)  # the first token, as sampled on the prefill node
        retractions += len(sched.grow_or_retract())
        fake_step(sched)
        sched.retire_finished()
        sched.pages.allocator.check_invariants()
        if not len(sched):
            break
    assert retractions > 0
    assert sum(r.num_retractions for r in reqs) == retractions
    for r in reqs:
        assert r.state is RequestState.FINISHED and len(r.output_ids) == r.params.max_new_tokens
    assert sched.pages.allocator.num_free == 24
