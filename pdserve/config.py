"""Configuration: frozen dataclasses built once at process start and passed down explicitly."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from pdserve.cluster_auth import ClusterKeys, load_keys

# Mirrors runtime/quant.py's QUANT_MODES (config must not import torch).
QUANT_MODES = ("none", "w8a16_int8", "w8a8_int8", "w4a16", "w4a8")
# `auto` resolves at load time (runtime/loader.py): a GGUF file on CPU keeps its own quantization
# (Q4_0/Q4_1 -> w4a16, Q8_0 and other types -> w8a16_int8); anything else, and --dtype float32, none.
QUANT_CHOICES = ("auto", *QUANT_MODES)
# How KV pages travel from prefill to decode (kv_transfer/shm.py): auto = shared memory between CPU pools
# of one host, else the torch.distributed pair group; shm = the same, each fall-back a warning; dist =
# the pair group only.
KV_TRANSPORTS = ("auto", "shm", "dist")
KV_CHECKSUMS = ("off", "sample", "all")  # pdserve/kv_transfer/checksum.py
# Batch-invariant decoding (runtime/determinism.py): auto = on where it costs nothing on this host.
DETERMINISTIC_CHOICES = ("auto", "on", "off")

# The KV transfer's timeouts, one default each: the worker flags, `pdserve up` and
# kv_transfer.TransferConfig all take them from here.
TRANSFER_TIMEOUT_S = 30.0  # one KV send/recv operation (a chunk or the trailer) once data flows
WAITING_TIMEOUT_S = 300.0  # waiting for the other side of a transfer (the prefill's queue included)
# A constraint's grammar compile, at the gateway and on each worker (runtime/grammar/backend.py).
GRAMMAR_COMPILE_TIMEOUT_S = 10.0
# A role switch waits this long for the requests its worker holds, then hands them off (the gateway's
# switch timeout follows it: gateway/cluster/role_switch.py).
SWITCH_DRAIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RuntimeConfig:
    """What a model runtime (offline engine, prefill or decode worker) needs."""

    model_path: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    # auto: bfloat16 on CUDA and on CPUs with BF16 instructions (AVX512-BF16 or AMX), else float32.
    dtype: str = "auto"
    # Weights quantized at load time (runtime/quant.py): auto | none | w8a16_int8 | w8a8_int8 | w4a16.
    # --dtype float32 means the exactness reference: it implies none.
    quantization: str = "auto"
    device: str = "auto"  # auto: cuda if available, else cpu
    # The KV pool's dtype (runtime/runner.py kv_cache_dtype): auto is float16 for a quantized model computing
    # in float32 on CPU (half the pool's memory), else the model's dtype.
    kv_cache_dtype: str = "auto"
    page_size: int = 16
    # KV pool capacity in tokens; None: `mem_fraction_static` of free GPU memory, or on CPU the context
    # length x max_running_requests capped at a share of MemAvailable (runtime/runner.py).
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.8
    max_running_requests: int = 64
    # Prompt tokens per extend forward; longer prompts are prefilled in chunks.
    chunked_prefill_size: int = 2048
    attention_backend: str = "auto"  # auto | torch | cpu | triton
    # Batch-invariant decoding (runtime/determinism.py): auto | on | off.
    deterministic: str = "auto"
    num_threads: int | None = None  # torch intra-op threads; None: leave torch's default
    context_length: int | None = None  # override the model's
    # Speculative decoding (decode side): None | "NGRAM" | "STANDALONE"
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4
    speculative_draft_model_path: str | None = None
    # The prefix cache of the offline engine and prefill workers (runtime/radix_cache.py).
    disable_radix_cache: bool = False
    # Structured output (runtime/grammar/): xgrammar | none (constrained requests refused).
    grammar_backend: str = "xgrammar"
    # A grammar's compile runs beside the forwards; a request whose compile takes longer fails (400).
    grammar_compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S
    # Decode steps through torch.compile (runtime/compiled_decode.py; CPU).
    enable_torch_compile: bool = False
    # A file whose exclusive lock every forward holds (runtime/forward_turns.py): co-located CPU workers
    # take turns at the cores. None: no turns.
    cpu_forward_lock: str | None = None
    # Tensor parallelism (runtime/tp_layout.py): the model split over this many processes of one host,
    # rank 0 scheduling and the others following its forwards (runtime/tp_follower.py).
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError("--tp-size must be >= 1")
        if self.page_size < 1:
            raise ValueError("--page-size must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError("--max-total-tokens must hold at least one page")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.chunked_prefill_size < 1:
            raise ValueError("--chunked-prefill-size must be >= 1")
        if self.deterministic not in DETERMINISTIC_CHOICES:
            raise ValueError(f"--deterministic must be one of {', '.join(DETERMINISTIC_CHOICES)}")
        if self.speculative_algorithm not in (None, "NGRAM", "STANDALONE"):
            raise ValueError("--speculative-algorithm must be NGRAM or STANDALONE")
        if self.speculative_num_draft_tokens < 0:
            raise ValueError("--speculative-num-draft-tokens must be >= 0")
        if self.grammar_backend not in ("xgrammar", "none"):
            raise ValueError("--grammar-backend must be xgrammar or none")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError("--grammar-compile-timeout must be > 0")
        if self.quantization not in QUANT_CHOICES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANT_CHOICES)}")
        if self.dtype == "float32" and self.quantization not in ("auto", "none"):
            raise ValueError(
                "--dtype float32 serves the unquantized weights (the exactness reference); "
                f"drop it or use --quantization none, not {self.quantization}"
            )

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def runtime_config_from_args(args: argparse.Namespace) -> RuntimeConfig:
    names = {f.name for f in fields(RuntimeConfig)}
    return RuntimeConfig(**{k: v for k, v in vars(args).items() if k in names})


@dataclass(frozen=True)
class WorkerConfig:
    """A prefill or decode worker: its runtime plus how it reaches the gateway and its peers."""

    role: str  # "prefill" | "decode"
    runtime: RuntimeConfig
    # 0 in the launch role; the gateway's epoch after each role switch (pdserve/protocol/gateway.py).
    epoch: int = 0
    # The gateway's control socket, host:port (its --control-port).
    gateway_addr: str = "127.0.0.1:30001"
    worker_id: str = ""
    # Address peers use to reach this node (the pod IP in Kubernetes).
    host: str = "127.0.0.1"
    # Prefill only: the KV bootstrap port decode nodes connect to (0: any free port).
    bootstrap_port: int = 0
    kv_transfer_backend: str = "auto"  # auto: nccl for CUDA pools, gloo otherwise
    # auto: shared memory between CPU pools of one host, the pair group otherwise; shm: the same, every
    # fall-back logged as a warning; dist: the pair group only (kv_transfer/shm.py).
    kv_transport: str = "auto"
    kv_checksum: str = "sample"
    # One KV send/recv operation (a chunk or the trailer) once data flows.
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S
    # Waiting for the other side: the decode for the KV (the prefill's queue and forward included),
    # the prefill for the decode's page list. Dead peers are caught sooner by the gateway's heartbeats.
    waiting_timeout_s: float = WAITING_TIMEOUT_S
    register_timeout_s: float = 120.0
    drain_timeout_s: float = 600.0
    # A role switch's drain: past it, what the worker still holds fails with code `draining`, which the
    # gateway runs again or migrates to another worker (pdserve/worker/common.py serve_until_drained).
    switch_drain_timeout_s: float = SWITCH_DRAIN_TIMEOUT_S
    # /livez, /readyz and /metrics for orchestrators (0: off); see pdserve/worker/health.py.
    health_port: int = 0
    # The cluster secret (pdserve/cluster_auth.py); None: PDSERVE_CLUSTER_SECRET, else unauthenticated.
    cluster_secret_file: str | None = None
    # Its Curve keys, derived once at start (worker_config_from_args); None: unauthenticated.
    keys: ClusterKeys | None = None
    # The test hooks (hidden --test-* flags) are not serving configuration: pdserve/worker/test_hooks.py.


def worker_config_from_args(args: argparse.Namespace, role: str) -> WorkerConfig:
    import uuid

    names = {f.name for f in fields(WorkerConfig)} - {"role", "runtime", "epoch"}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw["worker_id"] = kw.get("worker_id") or f"{role}-{uuid.uuid4().hex[:8]}"
    if "/" in kw["worker_id"]:
        raise ValueError("--worker-id must not contain '/'")
    kw["keys"] = load_keys(kw.get("cluster_secret_file"))
    return WorkerConfig(role=role, runtime=runtime_config_from_args(args), **kw)
