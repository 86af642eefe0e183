"""The `pdserve bench` commands: name -> the module that runs it (its `main(argv)`) and one line of help.
The CLI (pdserve/cli.py), its help and the tests (tests/bench/test_bench_commands.py) read this table; a
new benchmark is one row here."""

from __future__ import annotations

import types
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchCommand:
    module: str  # imported only when the command runs: most load torch or start clusters
    help: str


def _row(module: str, help: str) -> BenchCommand:
    return BenchCommand(f"pdserve.bench.{module}", help)


BENCH_COMMANDS = types.MappingProxyType(
    {
        "engine": _row("bench_engine", "offline throughput: pdserve's engine against transformers' generate"),
        "serving": _row(
            "bench_serving",
            "online serving: TTFT, ITL, TPOT, E2E and throughput against OpenAI-compatible servers",
        ),
        "transfer": _row(
            "bench_transfer", "KV transfer throughput: shared memory, loopback gloo and a plain socket"
        ),
        "kernels": _row(
            "bench_kernels", "every Triton kernel's correctness and speed against torch (one GPU)"
        ),
        "spec": _row(
            "bench_spec", "speculative decoding: throughput and inter-token latency with and without it"
        ),
        "grammar": _row("bench_grammar", "structured output's grammar backends: compile and mask costs"),
        "control": _row(
            "bench_control", "the control plane's cost per request, with and without the cluster secret"
        ),
        "auth": _row("bench_auth", "the HTTP API keys' cost per request"),
        "abuse": _row(
            "bench_abuse", "the abuse table: what one hostile or careless client can do to a cluster"
        ),
        "gpu": _row("gpu_check", "one prepared run that builds, checks and times pdserve on one GPU"),
        "weights": _row("bench_weights", "live weight updates: their duration and the pause streams see"),
        "quant": _row("bench_quant", "each --quantization mode's accuracy and speed against the fp32 model"),
        "ttft": _row("bench_ttft", "served time to first token against the offline engine's prefill"),
        "cpu": _row("bench_cpu", "the C++ CPU kernels against torch on the bundled model's shapes"),
        "responses": _row(
            "bench_responses", "multi-turn Responses conversations: TTFT per turn, cache affinity on/off"
        ),
        "restart": _row("bench_restart", "how long a killed worker takes to serve again under `pdserve up`"),
        "deterministic": _row(
            "bench_deterministic", "what batch-invariant decoding (--deterministic on) costs"
        ),
        "tp": _row("bench_tp", "what tensor parallelism costs or gains on this host"),
        "goodput": _row(
            "bench_goodput", "requests per second within TTFT and TPOT targets at each of --rates"
        ),
        "role-switch": _row(
            "bench_role_switch", "request latency under 8 clients with and without a role switch mid-run"
        ),
        "write-model": _row(
            "model_writer", "random-weight GGUF or safetensors files of real models' shapes and sizes"
        ),
    }
)


def commands_help() -> str:
    """The table as `pdserve bench --help` lists it: one command a line."""
    width = max(map(len, BENCH_COMMANDS))
    return "commands:\n" + "\n".join(f"  {name:<{width}}  {c.help}" for name, c in BENCH_COMMANDS.items())
