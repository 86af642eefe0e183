"""The flags of the model runtime (every worker and the offline engine) and of the prefill and decode
workers, the gateway's among them where it takes the same flag: rows of the flag table
(pdserve/launch/flags.py). SGLang's names, so its users feel at home."""

from __future__ import annotations

from pdserve import env
from pdserve.cluster_auth import SECRET_FILE_HELP
from pdserve.config import (
    DETERMINISTIC_CHOICES,
    GRAMMAR_COMPILE_TIMEOUT_S,
    KV_CHECKSUMS,
    KV_TRANSPORTS,
    QUANT_CHOICES,
    RuntimeConfig,
    WorkerConfig,
)
from pdserve.launch.flag import (
    DECODE,
    GATEWAY,
    GENERATE,
    LAUNCH,
    PREFILL,
    RUNTIME,
    TO_BOTH,
    TO_WORKERS,
    UP,
    WORKERS,
    Flag,
    launch_env,
)

# The dataclasses' defaults are the flags' defaults.
_R = RuntimeConfig()
_W = WorkerConfig(role=PREFILL, runtime=_R)

# The model runtime: every worker and the offline engine; `pdserve up` forwards them to its workers.
RUNTIME_FLAGS = [
    Flag(
        "--model-path",
        RUNTIME | {LAUNCH, GATEWAY},
        "HF folder, .gguf file, or empty for the bundled SmolLM2-135M-Instruct (env PDSERVE_MODEL_PATH, "
        "but not for the gateway); the gateway loads its tokenizer, and the launchers give it theirs",
        default=env.model_path,
        role_default={GATEWAY: None},
        passed_to=TO_BOTH,
    ),
    Flag(
        "--dtype",
        RUNTIME,
        "auto: bfloat16 on CUDA and on CPUs with BF16 instructions, else float32; float32 is the "
        "exactness reference (unquantized weights)",
        default=_R.dtype,
        choices=("auto", "float32", "bfloat16", "float16"),
        passed_to=TO_WORKERS,
    ),
    Flag(
        "--quantization",
        RUNTIME,
        "quantize the weights at load time (CPU): int8 weight-only, int8 weights and activations, "
        "or int4 weight-only in groups of 32 (a Q4_1 GGUF's own blocks); auto: a GGUF model keeps its "
        "own quantization on CPU, anything else and --dtype float32 none",
        default=_R.quantization,
        choices=QUANT_CHOICES,
        passed_to=TO_WORKERS,
    ),
    Flag(
        "--kv-cache-dtype",
        RUNTIME,
        "the KV pool's dtype; auto: float16 for a quantized model computing in float32 on CPU (half the "
        "memory; attention reads it back in float32), else the model's dtype",
        default=_R.kv_cache_dtype,
        choices=("auto", "float32", "bfloat16", "float16"),
        passed_to=TO_WORKERS,
    ),
    Flag(
        "--device",
        RUNTIME | {LAUNCH},
        "auto (cuda if available, else cpu) | cuda | cpu; deploy/launch.sh: cuda pins one worker per "
        "listed GPU (env PDSERVE_DEVICE)",
        default=_R.device,
        role_default={LAUNCH: launch_env("PDSERVE_DEVICE", "cuda")},
        passed_to=TO_WORKERS,
    ),
    Flag("--page-size", RUNTIME, type=int, default=_R.page_size, passed_to=TO_WORKERS),
    Flag("--max-total-tokens", RUNTIME, type=int, passed_to=TO_WORKERS),
    Flag("--mem-fraction-static", RUNTIME, type=float, default=_R.mem_fraction_static, passed_to=TO_WORKERS),
    Flag("--max-running-requests", RUNTIME, type=int, default=_R.max_running_requests, passed_to=TO_WORKERS),
    Flag("--chunked-prefill-size", RUNTIME, type=int, default=_R.chunked_prefill_size, passed_to=TO_WORKERS),
    Flag(
        "--attention-backend",
        RUNTIME,
        "auto: triton on CUDA; on CPU, cpu (decode attention in C++, reading the KV pool in place; "
        "built at first use) where it builds, else torch (the reference)",
        default=_R.attention_backend,
        choices=("auto", "torch", "cpu", "triton"),
        passed_to=TO_WORKERS,
    ),
    Flag(
        "--deterministic",
        RUNTIME,
        "batch-invariant decoding: a request's tokens do not depend on its batch, its prompt's chunking, a "
        "prefix-cache hit, a retraction or a migration (CPU, quantized models). auto: on where it costs "
        "nothing on this host (w4a8 and w8a16_int8 without a dense copy); on: everywhere it can run, "
        "at the speed it costs (docs/reliability.md); given bare, on (so SGLang's "
        "--enable-deterministic-inference too)",
        default=_R.deterministic,
        choices=DETERMINISTIC_CHOICES,
        const="on",
        aliases=("--enable-deterministic-inference",),
        passed_to=TO_WORKERS,
    ),
    Flag(
        "--num-threads",
        WORKERS | {GENERATE},
        "torch threads for this process (the launchers set it from --threads-per-worker)",
        type=int,
    ),
    Flag("--context-length", RUNTIME, type=int, passed_to=TO_WORKERS),
    Flag(
        "--tp-size",
        WORKERS | {GENERATE},
        "tensor parallelism: the model split over this many processes (one per GPU, from this "
        "worker's GPU on; on CPU they share the cores), its query and KV heads, MLP and vocabulary "
        "(pdserve up: --prefill-tp / --decode-tp)",
        type=int,
        default=_R.tp_size,
        aliases=("--tensor-parallel-size",),
    ),
    Flag(
        "--cpu-forward-lock",
        WORKERS | {GENERATE},
        "take an exclusive lock on this file around every forward, so that workers sharing one "
        "host's cores compute in turns (the launchers set it for co-located CPU workers)",
        metavar="PATH",
    ),
    Flag("--speculative-algorithm", RUNTIME, choices=("NGRAM", "STANDALONE"), passed_to=TO_WORKERS),
    Flag(
        "--speculative-num-draft-tokens",
        RUNTIME,
        type=int,
        default=_R.speculative_num_draft_tokens,
        passed_to=TO_WORKERS,
    ),
    Flag("--speculative-draft-model-path", RUNTIME, passed_to=TO_WORKERS),
    Flag(
        "--disable-radix-cache",
        RUNTIME,
        "no prefix cache: every prompt is computed in full",
        switch=True,
        passed_to=TO_WORKERS,
    ),
    Flag(
        "--grammar-backend",
        RUNTIME | {GATEWAY},
        "structured output (json_schema, regex, ebnf, response_format); none: refuse them",
        default=_R.grammar_backend,
        choices=("xgrammar", "none"),
        passed_to=TO_BOTH,
    ),
    Flag(
        "--grammar-compile-timeout",
        RUNTIME | {LAUNCH, GATEWAY},
        "seconds a constraint's grammar may take to compile (in the background), at the gateway and "
        "each worker; a request whose grammar takes longer fails with a 400",
        type=float,
        default=GRAMMAR_COMPILE_TIMEOUT_S,
        dest="grammar_compile_timeout_s",
        passed_to=TO_BOTH,
    ),
    Flag(
        "--enable-torch-compile",
        RUNTIME,
        "run decode steps through torch.compile (CPU): fused small ops, ~1.4-1.6x faster steps at "
        "small batches (measured offline); compiles at the decode worker's start (~1.5 minutes from "
        "inductor's disk cache, 2-5 minutes cold)",
        switch=True,
        passed_to=TO_WORKERS,
    ),
]

# How a worker reaches the gateway and its peers, its KV transfers, health and drain.
WORKER_FLAGS = [
    Flag(
        "--gateway",
        WORKERS | {LAUNCH},
        "host:port of the gateway's control socket (env PDSERVE_GATEWAY; deploy/launch.sh: default the "
        "gateway it starts)",
        default=env.gateway_addr,
        role_default={LAUNCH: launch_env("PDSERVE_GATEWAY")},
        dest="gateway_addr",
    ),
    Flag("--worker-id", WORKERS, "(env PDSERVE_WORKER_ID)", default=env.worker_id),
    Flag(
        "--host",
        WORKERS | {LAUNCH},
        "address peers reach the worker at (env PDSERVE_HOST; Kubernetes: the pod IP)",
        default=env.host,
        passed_to=TO_WORKERS,
    ),
    Flag(
        "--disaggregation-bootstrap-port",
        frozenset({PREFILL}),
        "the KV bootstrap port decode workers connect to (env PDSERVE_BOOTSTRAP_PORT; 0: any free port)",
        type=int,
        default=env.bootstrap_port,
        dest="bootstrap_port",
    ),
    Flag(
        "--kv-transfer-backend",
        WORKERS | {UP},
        default=_W.kv_transfer_backend,
        choices=("auto", "gloo", "nccl"),
        passed_to=TO_WORKERS,
    ),
    Flag(
        "--kv-transport",
        WORKERS | {UP},
        "auto: KV pages go through shared memory when prefill and decode share a host (CPU pools), "
        "else over --kv-transfer-backend; shm: the same, warning at each fall-back; dist: never shared memory",
        default=_W.kv_transport,
        choices=KV_TRANSPORTS,
        passed_to=TO_WORKERS,
    ),
    Flag(
        "--kv-checksum",
        WORKERS | {UP},
        "which KV pages the prefill node hashes for the decode node to check after they land "
        "(off | sample: the first, the last and every 128th | all); a mismatch fails the hand-off as kv_corrupt",
        default=_W.kv_checksum,
        choices=KV_CHECKSUMS,
        passed_to=TO_WORKERS,
    ),
    Flag(
        "--transfer-timeout",
        WORKERS | {UP},
        "seconds one KV send/recv may take once data flows",
        type=float,
        default=_W.transfer_timeout_s,
        dest="transfer_timeout_s",
        passed_to=TO_WORKERS,
    ),
    Flag(
        "--waiting-timeout",
        WORKERS | {UP},
        "seconds a KV transfer may wait for its peer (prefill queue + forward included)",
        type=float,
        default=_W.waiting_timeout_s,
        dest="waiting_timeout_s",
        aliases=("--kv-wait-timeout",),
        passed_to=TO_WORKERS,
    ),
    Flag("--drain-timeout", WORKERS, type=float, default=_W.drain_timeout_s, dest="drain_timeout_s"),
    Flag(
        "--switch-drain-timeout",
        WORKERS,
        "seconds a role switch waits for the requests the worker holds; then they fail as draining and "
        "the gateway runs them on elsewhere (retried, or migrated mid-stream)",
        type=float,
        default=_W.switch_drain_timeout_s,
        dest="switch_drain_timeout_s",
    ),
    Flag(
        "--health-port",
        WORKERS,
        "serve /livez, /readyz and /metrics here, on --host (env PDSERVE_HEALTH_PORT; 0: off)",
        type=int,
        default=env.health_port,
    ),
    Flag(
        "--log-level",
        WORKERS | {GATEWAY, UP, LAUNCH},
        "a worker: default env PDSERVE_LOG_LEVEL; the launchers give it to their children",
        default=env.log_level,
        role_default={GATEWAY: "info", UP: "info", LAUNCH: "info"},
        choices=("critical", "error", "warning", "info", "debug"),
        passed_to=TO_BOTH,
    ),
    Flag(
        "--cluster-secret-file",
        WORKERS | {GATEWAY, UP, LAUNCH},
        SECRET_FILE_HELP,
        passed_to=TO_BOTH,
    ),
    # Test hooks: each dest is a field of TestHooks (pdserve/worker/test_hooks.py), not of WorkerConfig.
    Flag("--test-clock-skew", WORKERS, type=float, default=0.0, dest="clock_skew_s", hidden=True),
    Flag(
        "--test-stall-kv-send",
        frozenset({PREFILL}),
        type=float,
        default=0.0,
        dest="stall_kv_send_s",
        hidden=True,
    ),
    Flag(
        "--test-corrupt-kv",
        frozenset({PREFILL}),
        type=int,
        default=0,
        dest="corrupt_kv",
        hidden=True,
    ),
    Flag(
        "--test-wrong-tokens-from",
        frozenset({DECODE}),
        type=int,
        default=0,
        dest="wrong_tokens_from",
        hidden=True,
    ),
    Flag(
        "--test-stall-kv-data",
        frozenset({PREFILL}),
        type=float,
        default=0.0,
        dest="stall_kv_data_s",
        hidden=True,
    ),
]
