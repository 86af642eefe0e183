"""Configuration: frozen dataclasses built once at process start and passed down explicitly."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class RuntimeConfig:
    """What a model runtime (offline engine, prefill or decode worker) needs."""

    model_path: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available, else cpu
    page_size: int = 16
    # KV pool capacity in tokens; None: `mem_fraction_static` of free GPU memory, or 32768 on CPU.
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.8
    max_running_requests: int = 64
    # Prompt tokens per extend forward; longer prompts are prefilled in chunks.
    chunked_prefill_size: int = 2048
    attention_backend: str = "auto"  # auto | torch | triton
    num_threads: int | None = None  # torch intra-op threads; None: leave torch's default
    context_length: int | None = None  # override the model's
    # Speculative decoding (decode side): None | "NGRAM" | "STANDALONE"
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4
    speculative_draft_model_path: str | None = None

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("--page-size must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError("--max-total-tokens must hold at least one page")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.chunked_prefill_size < 1:
            raise ValueError("--chunked-prefill-size must be >= 1")
        if self.speculative_algorithm not in (None, "NGRAM", "STANDALONE"):
            raise ValueError("--speculative-algorithm must be NGRAM or STANDALONE")
        if self.speculative_num_draft_tokens < 0:
            raise ValueError("--speculative-num-draft-tokens must be >= 0")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    """SGLang's flag names, so its users feel at home."""
    d = RuntimeConfig()
    parser.add_argument(
        "--model-path",
        default=os.environ.get("PDSERVE_MODEL_PATH"),
        help="HF folder, .gguf file, or empty for the bundled SmolLM2-135M-Instruct",
    )
    parser.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--page-size", type=int, default=d.page_size)
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static)
    parser.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    parser.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    parser.add_argument(
        "--attention-backend", default=d.attention_backend, choices=["auto", "torch", "triton"]
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads for this process")
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--speculative-algorithm", default=None, choices=["NGRAM", "STANDALONE"])
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=d.speculative_num_draft_tokens)
    parser.add_argument("--speculative-draft-model-path", default=None)


def runtime_config_from_args(args: argparse.Namespace) -> RuntimeConfig:
    names = {f.name for f in fields(RuntimeConfig)}
    return RuntimeConfig(**{k: v for k, v in vars(args).items() if k in names})


@dataclass(frozen=True)
class WorkerConfig:
    """A prefill or decode worker: its runtime plus how it reaches the gateway and its peers."""

    role: str  # "prefill" | "decode"
    runtime: RuntimeConfig
    # The gateway's control socket, host:port (its --control-port).
    gateway_addr: str = "127.0.0.1:30001"
    worker_id: str = ""
    # Address peers use to reach this node (the pod IP in Kubernetes).
    host: str = "127.0.0.1"
    # Prefill only: the KV bootstrap port decode nodes connect to (0: any free port).
    bootstrap_port: int = 0
    kv_transfer_backend: str = "auto"  # auto: nccl for CUDA pools, gloo otherwise
    # One KV send/recv operation (a chunk or the metadata) once data flows.
    transfer_timeout_s: float = 30.0
    # Waiting for the other side: the decode for the KV (the prefill's queue and forward included),
    # the prefill for the decode's page list. Dead peers are caught sooner by the gateway's heartbeats.
    kv_wait_timeout_s: float = 300.0
    register_timeout_s: float = 120.0
    # Seconds added to this worker's clock: a test hook for the gateway's clock-offset estimation.
    clock_skew_s: float = 0.0
    drain_timeout_s: float = 600.0
    # /livez, /readyz and /metrics for orchestrators (0: off); see pdserve/health.py.
    health_port: int = 0


def add_worker_args(parser: argparse.ArgumentParser, role: str) -> None:
    add_runtime_args(parser)
    env = os.environ.get
    parser.add_argument(
        "--gateway",
        dest="gateway_addr",
        default=env("PDSERVE_GATEWAY", "127.0.0.1:30001"),
        help="host:port of the gateway's control socket (env PDSERVE_GATEWAY)",
    )
    parser.add_argument("--worker-id", default=env("PDSERVE_WORKER_ID", ""))
    parser.add_argument(
        "--host",
        default=env("PDSERVE_HOST", "127.0.0.1"),
        help="address peers reach this worker at (env PDSERVE_HOST, e.g. the pod IP)",
    )
    if role == "prefill":
        parser.add_argument(
            "--disaggregation-bootstrap-port",
            dest="bootstrap_port",
            type=int,
            default=int(env("PDSERVE_BOOTSTRAP_PORT", "8998")),
        )
    parser.add_argument("--kv-transfer-backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument(
        "--transfer-timeout",
        dest="transfer_timeout_s",
        type=float,
        default=30.0,
        help="seconds one KV send/recv may take once data flows",
    )
    parser.add_argument(
        "--kv-wait-timeout",
        dest="kv_wait_timeout_s",
        type=float,
        default=300.0,
        help="seconds a KV transfer may wait for its peer (prefill queue + forward included)",
    )
    parser.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, default=600.0)
    parser.add_argument(
        "--health-port",
        type=int,
        default=int(env("PDSERVE_HEALTH_PORT", "0")),
        help="serve /livez, /readyz and /metrics here (env PDSERVE_HEALTH_PORT; 0: off)",
    )
    parser.add_argument("--log-level", default=env("PDSERVE_LOG_LEVEL", "info"))


def worker_config_from_args(args: argparse.Namespace, role: str) -> WorkerConfig:
    import uuid

    names = {f.name for f in fields(WorkerConfig)} - {"role", "runtime"}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw["worker_id"] = kw.get("worker_id") or f"{role}-{uuid.uuid4().hex[:8]}"
    skew = float(os.environ.get("PDSERVE_TEST_CLOCK_SKEW_S", "0"))
    return WorkerConfig(role=role, runtime=runtime_config_from_args(args), clock_skew_s=skew, **kw)
