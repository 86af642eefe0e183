"""Gateway <-> worker channel: control-plane messages over pyzmq (codec and version: codec.py).

Every message is a pydantic model with a literal `kind`. Tensors never travel here; KV goes through
`pdserve.kv_transfer`. A Register of another protocol version is answered with a refusal naming both.

Topology: the gateway binds one ROUTER socket; every worker connects one DEALER socket to it and
uses its `worker_id` as its zmq identity.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from pdserve.protocol.codec import Codec
from pdserve.protocol.codec import Msg as _Msg
from pdserve.protocol.records import DecodeEvents, PrefillEvents, RequestStats
from pdserve.protocol.vocabulary import AbortReason, FailCode, FinishReason
from pdserve.sampling_params import SamplingParams

Role = Literal["prefill", "decode"]

# ---- registration and liveness -------------------------------------------------------------


class Register(_Msg):
    """Worker -> gateway, first message and again after the gateway forgets it."""

    kind: Literal["register"] = "register"
    worker_id: str
    role: Role
    # host:port of the prefill node's KV bootstrap server (prefill only).
    bootstrap_addr: str | None = None
    # Model fingerprint (architecture, layers, kv heads, head dim, dtype, page size, weights hash).
    fingerprint: dict[str, str | int]
    model_name: str
    max_total_tokens: int
    max_running_requests: int
    context_length: int
    vocab_size: int
    # Worker clock when sending; the first sample of the clock-offset estimate.
    t_send: float
    # The label of the weights it serves (`WeightsCommand` commits change it; "default" at start).
    weight_version: str = "default"
    # Processes its model is split over (--tp-size); routing weighs its load per rank.
    tp_size: int = Field(1, ge=1, le=1024)
    # 0: a process starting in its launch role; N > 0: the role a `SwitchRole` of epoch N gave it. The
    # gateway refuses an epoch older than the one it last gave this worker id.
    epoch: int = Field(0, ge=0)


class RegisterAck(_Msg):
    kind: Literal["register_ack"] = "register_ack"
    accepted: bool
    reason: str = ""
    # A refusal that may pass later (the worker id is held by another live connection): the worker
    # registers again after a pause instead of giving up.
    retry: bool = False


class Ping(_Msg):
    """Gateway -> worker. `t0` is the gateway clock at send (NTP's originate timestamp)."""

    kind: Literal["ping"] = "ping"
    t0: float


class Pong(_Msg):
    """Worker -> gateway. t1: worker clock at receipt, t2: worker clock at send. Doubles as heartbeat."""

    kind: Literal["pong"] = "pong"
    t0: float
    t1: float
    t2: float
    queued: int = 0
    running: int = 0
    free_tokens: int = 0
    draining: bool = False


class Deregister(_Msg):
    """Worker -> gateway when draining: take me out of rotation, I finish what I hold."""

    kind: Literal["deregister"] = "deregister"
    worker_id: str


class SwitchRole(_Msg):
    """Gateway -> worker: drain the current role (the gateway routes it nothing new), then serve `role`
    on the same weights and register again with `epoch`."""

    kind: Literal["switch_role"] = "switch_role"
    role: Role
    epoch: int = Field(ge=1)


# ---- prefix cache -------------------------------------------------------------------------


class KVEvents(_Msg):
    """Worker (prefill or decode) -> gateway, at most one per worker step: page blocks its prefix cache stored and
    removed since the last one, as chained block hashes (`block_hash.py`). `snapshot`: `stored` is
    everything cached now and replaces what the gateway knew (sent after each registration)."""

    kind: Literal["kv_events"] = "kv_events"
    worker_id: str
    page_size: int = Field(ge=1)
    snapshot: bool = False
    stored: list[int] = Field(default_factory=list)
    removed: list[int] = Field(default_factory=list)


class FlushCache(_Msg):
    """Gateway -> worker: empty your prefix cache (refused while requests run)."""

    kind: Literal["flush_cache"] = "flush_cache"
    flush_id: str


class FlushCacheDone(_Msg):
    """Worker -> gateway: the answer to `FlushCache`; `message` says why when not `ok`."""

    kind: Literal["flush_cache_done"] = "flush_cache_done"
    flush_id: str
    ok: bool
    message: str = ""


# ---- live weight updates (runtime/weight_update.py on the worker, gateway/cluster/weights.py) ---------

WeightsOp = Literal[
    "prepare_disk",
    "prepare_distributed",
    "commit",
    "cancel",
    "init_group",
    "destroy_group",
    "pause",
    "resume",
]


class WeightsGroup(_Msg):
    """Where a worker joins a trainer's torch.distributed group (the trainer is rank 0 and hosts its store)."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str
    backend: Literal["gloo", "nccl"]


class WeightsCommand(_Msg):
    """Gateway -> worker, applied between forward steps. Two phases: `prepare_*` loads and checks the new
    weights aside (off the loop), `commit` swaps them in and takes `weight_version`, `cancel` drops them.
    `pause`/`resume` stop and restart forward steps; `init_group`/`destroy_group` the trainer's group."""

    kind: Literal["weights"] = "weights"
    op_id: str
    op: WeightsOp
    model_path: str = ""
    load_format: str | None = None
    # prepare_distributed: what the trainer broadcasts, in order.
    names: list[str] = Field(default_factory=list)
    dtypes: list[str] = Field(default_factory=list)
    shapes: list[list[int]] = Field(default_factory=list)
    group_name: str = ""
    weight_version: str = ""
    group: WeightsGroup | None = None


class WeightsReply(_Msg):
    """Worker -> gateway: the answer to a `WeightsCommand`; `message` says why when not `ok`."""

    kind: Literal["weights_done"] = "weights_done"
    op_id: str
    ok: bool
    message: str = ""
    seconds: float = 0.0  # the worker's time on the operation
    weight_version: str = "default"  # what the worker serves after it


# ---- per request -----------------------------------------------------------------------------


class GenerateRequest(_Msg):
    """Gateway -> both legs of a request. `room` is the global id that keys the KV transfer."""

    kind: Literal["generate"] = "generate"
    room: str
    input_ids: list[int]
    sampling: SamplingParams
    prefill_worker: str
    prefill_bootstrap_addr: str
    # "": no decode leg; the prefill node answers alone (sampling.max_new_tokens 0 or 1: its first
    # token is all there is to generate, if anything) and keeps the KV.
    decode_worker: str
    # Conditional disaggregation: the decode worker computes the prompt itself and no prefill worker
    # takes part (`prefill_worker` and `prefill_bootstrap_addr` are then empty).
    local_prefill: bool = False
    # Absolute deadline on the gateway's clock (received time + request timeout); informational.
    deadline_s: float | None = None
    # W3C trace context of the request's trace (`traceparent`), when the gateway traces it; a worker
    # may log it. Spans are built by the gateway (gateway/generation/tracing.py), not by the workers.
    traceparent: str | None = None
    # False: neither leg reads its prefix cache for this request nor stores its KV there (a canary's
    # reference answer, gateway/autopilot/canary.py).
    use_prefix_cache: bool = True

    @model_validator(mode="after")
    def _legs(self) -> GenerateRequest:
        if not self.decode_worker and (self.local_prefill or self.sampling.max_new_tokens > 1):
            raise ValueError(
                "a request without a decode leg is prefilled remotely and asks at most one token"
            )
        if self.decode_worker and self.sampling.max_new_tokens == 0:
            raise ValueError("a prefill-only request (max_new_tokens 0) has no decode leg")
        if self.local_prefill == bool(self.prefill_worker):
            raise ValueError("a local prefill names no prefill worker; any other names one")
        return self


class AbortRequest(_Msg):
    """Gateway -> worker: stop this room (client gone, stop string matched, other leg failed)."""

    kind: Literal["abort"] = "abort"
    room: str
    reason: AbortReason = AbortReason.CANCELLED


class TokenOutput(_Msg):
    room: str
    # Tokens produced for this room in this step (the first token arrives in the first output).
    token_ids: list[int]
    # One logprob per token in token_ids when requested.
    logprobs: list[float] | None = None
    # For each token, [(token_id, logprob), ...] when top_logprobs_num > 0.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    # Sent with the first output (decode_entry, kv_ready) and the final one (finished).
    events: DecodeEvents | None = None
    # A local prefill's events (decode worker clock), with the first output: what PrefillDone carries
    # from a prefill worker otherwise.
    prefill_events: PrefillEvents | None = None
    # Sent with the final output.
    stats: RequestStats | None = None
    # The weights that produced `token_ids` (the first token: the prefill node's at sampling time).
    weight_version: str = "default"


class PrefillDone(_Msg):
    """Prefill -> gateway: the prompt's forward ran and sampled the first token; its KV goes to the
    decode node right after (sent before the hand-off, so that the first token waits for nothing)."""

    kind: Literal["prefill_done"] = "prefill_done"
    room: str
    events: PrefillEvents
    # The first token as the decode node will report it once the KV lands (the same token, logprobs,
    # finish and weight version): the gateway streams it now, and drops the decode's copy. A request
    # that this token finishes is answered from here. A prefill-only request (max_new_tokens 0)
    # finishes with no token.
    first: TokenOutput | None = None
    cached_tokens: int = 0
    # Worker-clock (start, end) of every extend forward that computed part of this prompt (chunked prefill).
    forward_chunks: list[tuple[float, float]] = []
    # Prompt logprobs from the request's logprob_start_len on (the first prompt token's is None).
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    @model_validator(mode="after")
    def _one_first_token_of_this_room(self) -> PrefillDone:
        f = self.first
        if f is not None and (f.room != self.room or len(f.token_ids) > 1 or not (f.token_ids or f.finished)):
            raise ValueError("first must be one token of the same room (none when it finished the request)")
        return self


class RequestFailed(_Msg):
    """Worker -> gateway: this leg of `room` failed; the gateway aborts the other leg."""

    kind: Literal["failed"] = "failed"
    room: str
    role: Role
    code: FailCode
    message: str


class TokenBatch(_Msg):
    """Decode -> gateway, one per decode step: the new tokens of every request in the batch."""

    kind: Literal["tokens"] = "tokens"
    worker_id: str
    outputs: list[TokenOutput]


Message = Annotated[
    Union[
        Register,
        RegisterAck,
        Ping,
        Pong,
        Deregister,
        SwitchRole,
        GenerateRequest,
        AbortRequest,
        PrefillDone,
        RequestFailed,
        TokenBatch,
        KVEvents,
        FlushCache,
        FlushCacheDone,
        WeightsCommand,
        WeightsReply,
    ],
    Field(discriminator="kind"),
]


CODEC: Codec[Message] = Codec("gateway", Message)
encode = CODEC.encode
decode = CODEC.decode
