"""Prometheus metrics of one gateway, in its own CollectorRegistry (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.protocol.records import RequestStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    """The gateway's metric families, by concern: latencies, requests and tokens, load."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._latencies(self.registry)
        self._requests(self.registry)
        self._aborts(self.registry)
        self._load(self.registry)

    def _latencies(self, r: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Request received to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Time between output tokens",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Request received to finished",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def _requests(self, r: CollectorRegistry) -> None:
        """What happened to requests and their legs, and the tokens they moved."""
        self.requests = Counter(
            "pdserve_requests", "Finished generations by finish type", ["finish"], registry=r
        )
        self.errors = Counter(
            "pdserve_request_errors", "Failed generations by leg and code", ["leg", "code"], registry=r
        )
        self.rejected = Counter(
            "pdserve_rejected_requests", "Requests refused by reason", ["reason"], registry=r
        )
        self.retries = Counter(
            "pdserve_request_retries", "Generations retried on another pair after a lost leg", registry=r
        )
        self.retries_withheld = Counter(
            "pdserve_request_retries_withheld",
            "Generations not retried: their decode gave up waiting while the prompt sat in an overloaded "
            "prefill worker's queue, and no other prefill worker was in rotation",
            registry=r,
        )
        self.migrations = Counter(
            "pdserve_request_migrations",
            "Generations moved mid-stream to another pair (prompt + tokens so far) after a failed leg",
            registry=r,
        )
        self.canaries = Counter(
            "pdserve_canaries",
            "Canary requests (gateway/autopilot/canary.py) by outcome: answered, or error (the pair failed it)",
            ["result"],
            registry=r,
        )
        self.canary_mismatches = Counter(
            "pdserve_canary_mismatches",
            "Canary answers that differed from their pair's reference",
            ["prefill", "decode"],
            registry=r,
        )
        self.kv_corrupt = Counter(
            "pdserve_kv_corrupt",
            "Attempts whose KV landed unlike the prefill node's checksums (never decoded; run again elsewhere)",
            registry=r,
        )
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens", registry=r)
        self.routed = Counter(
            "pdserve_routed_requests", "Request legs sent to each worker", ["role", "worker"], registry=r
        )
        self.local_prefill = Counter(
            "pdserve_local_prefill_requests",
            "Requests whose prompt a decode worker computed (conditional disaggregation)",
            registry=r,
        )
        self.cached_tokens = Counter(
            "pdserve_cached_tokens",
            "Prompt tokens taken from the prefix cache of the worker that computed the prompt",
            registry=r,
        )
        self.transfer_skipped_tokens = Counter(
            "pdserve_transfer_skipped_tokens",
            "Prompt tokens whose KV did not travel: the decode worker cached them (incremental transfer)",
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV bytes moved from prefill to decode workers", registry=r
        )
        self.generation_tokens = Counter("pdserve_generation_tokens", "Generated tokens", registry=r)
        self.spec_proposed = Counter(
            "pdserve_spec_proposed_drafts", "Speculative draft tokens proposed", registry=r
        )
        self.spec_correct = Counter(
            "pdserve_spec_correct_drafts", "Speculative draft tokens accepted", registry=r
        )
        self.spec_verify = Counter("pdserve_spec_verify", "Speculative verify forwards", registry=r)

    def _aborts(self, r: CollectorRegistry) -> None:
        """Legs and generations ended early, and failed KV transfers: a client that leaves is an
        abort, never a transfer failure."""
        self.aborted_legs = Counter(
            "pdserve_aborted_legs",
            "Legs the gateway aborted on a worker, by role and reason (cancelled: the client left)",
            ["role", "reason"],
            registry=r,
        )
        self.transfer_failures = Counter(
            "pdserve_kv_transfer_failures",
            "KV transfers reported failed by a worker while the gateway waited on them (a transfer "
            "ended by the gateway's own abort, its client gone, is not one: see pdserve_request_aborts)",
            registry=r,
        )
        self.request_aborts = Counter(
            "pdserve_request_aborts",
            "Generations ended by their client: it disconnected (client_disconnect) or /abort_request "
            "named them (abort_request)",
            ["reason"],
            registry=r,
        )

    def _load(self, r: CollectorRegistry) -> None:
        """What is in flight at the gateway, and each worker's load and clock."""
        self.pending = Gauge("pdserve_pending_requests", "HTTP requests in flight at the gateway", registry=r)
        self.pending_generations = Gauge(
            "pdserve_pending_generations", "Generations (prompts x n) admitted and not finished", registry=r
        )
        self.workers = Gauge("pdserve_workers", "Workers in rotation", ["role"], registry=r)
        self.role_switches = Counter(
            "pdserve_role_switches",
            "Workers that switched role in place",
            ["from_role", "to_role"],
            registry=r,
        )
        self.stale_epoch_frames = Counter(
            "pdserve_stale_epoch_frames",
            "Control frames dropped from a connection a role switch retired",
            registry=r,
        )
        labels = ["worker", "role"]
        self.queued = Gauge("pdserve_worker_queue_depth", "Requests queued on a worker", labels, registry=r)
        self.running = Gauge(
            "pdserve_worker_running_requests", "Requests running on a worker", labels, registry=r
        )
        self.free_kv = Gauge(
            "pdserve_worker_kv_free_tokens", "Free KV pool tokens on a worker", labels, registry=r
        )
        self.clock_offset = Gauge(
            "pdserve_worker_clock_offset_seconds", "Worker clock minus gateway clock", labels, registry=r
        )
        self.clock_rtt = Gauge(
            "pdserve_worker_clock_rtt_seconds",
            "Round trip of the ping behind the clock offset (the offset's error is at most half)",
            labels,
            registry=r,
        )

    def worker_load(
        self, worker: str, role: str, queued: int, running: int, free: int, offset: float, rtt: float
    ) -> None:
        self.queued.labels(worker, role).set(queued)
        self.running.labels(worker, role).set(running)
        self.free_kv.labels(worker, role).set(free)
        self.clock_offset.labels(worker, role).set(offset)
        self.clock_rtt.labels(worker, role).set(rtt)

    def worker_gone(self, worker: str, role: str) -> None:
        for g in (self.queued, self.running, self.free_kv, self.clock_offset, self.clock_rtt):
            try:
                g.remove(worker, role)
            except KeyError:
                pass

    def spec(self, stats: RequestStats) -> None:
        self.spec_proposed.inc(stats.get("spec_num_proposed_drafts", 0))
        self.spec_correct.inc(stats.get("spec_num_correct_drafts", 0))
        self.spec_verify.inc(stats.get("spec_verify_ct", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
