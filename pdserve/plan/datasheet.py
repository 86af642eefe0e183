"""Profiles on paper: a GPU worker's forward times scaled from published datasheet figures, for plans
beyond the host at hand (`pdserve plan --gpu H100-SXM --gpu-model llama-3.1-8b`).

Nothing here is measured. A forward's time is a roofline over the GPU's peak dense bf16 FLOP/s and HBM
bandwidth (vendor datasheets), at the efficiencies below, plus a fixed cost per forward:
- prefill of n tokens: max(FLOPs / (peak x PREFILL_MFU), weight bytes / (bandwidth x BW_EFFICIENCY)),
  FLOPs = 2 x params x n + 2 x layers x n^2 x q heads x head_dim (causal attention);
- decode step of b requests at mean context c: max((weight bytes + b x c x KV bytes per token) /
  (bandwidth x BW_EFFICIENCY), 2 x params x b / (peak x PREFILL_MFU));
- the hand-off of a prompt's KV: its bytes over `transfer_gbps` (a parameter: the link between workers).
A worker of TP size t spans t GPUs (Megatron's split, as runtime/tp_layout.py): FLOPs, weight bytes and
KV bytes divide by t, and each layer adds two all-reduces of the activations (tokens x hidden x 2 bytes)
over the GPUs' links, a ring's 2 (t - 1) / t of them at LINK_EFFICIENCY of the per-direction NVLink
bandwidth, plus ALLREDUCE_LATENCY_S each. Its KV room is what t GPUs hold past the weights
(MEMORY_SHARE of memory; the simulator admits requests into it). bf16 weights and KV. The profile's
`host` and `notes` say it is on paper, and with which figures; a lent GPU records measured profiles
instead (benchmarks/gpu_profiles.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.plan.profile import Profile

PREFILL_MFU = 0.5  # share of peak FLOP/s a large prefill reaches
BW_EFFICIENCY = 0.7  # share of peak HBM bandwidth a decode step reaches
STEP_OVERHEAD_S = 0.0005  # per forward: launches, sampling, the scheduler (CUDA graphs assumed)
LINK_EFFICIENCY = 0.7  # share of the NVLink bandwidth an all-reduce reaches
ALLREDUCE_LATENCY_S = 10e-6  # per all-reduce: a small one is latency-bound
MEMORY_SHARE = 0.9  # of a GPU's memory, for weights and KV (the rest: activations, CUDA graphs)


@dataclass(frozen=True)
class Gpu:
    flops: float  # peak dense bf16 FLOP/s
    bandwidth: float  # HBM bytes/s
    memory: float  # bytes
    link: float  # NVLink bytes/s per direction, per GPU


@dataclass(frozen=True)
class ModelShape:
    params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @property
    def hidden(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def weight_bytes(self) -> float:
        return 2 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


GPUS = {  # vendor datasheets: dense bf16 tensor FLOP/s, HBM bandwidth, memory
    "H100-SXM": Gpu(989e12, 3.35e12, 80e9, 450e9),
    "H200": Gpu(989e12, 4.8e12, 141e9, 450e9),
    "A100-SXM-80GB": Gpu(312e12, 2.04e12, 80e9, 300e9),
}
MODELS = {  # from the models' config.json
    "llama-3.1-8b": ModelShape(8.03e9, 32, 32, 8, 128),
    "qwen2.5-7b": ModelShape(7.62e9, 28, 28, 4, 128),
    "llama-3.1-70b": ModelShape(70.6e9, 80, 64, 8, 128),
}


def fits(gpu_name: str, model_name: str, tp: int) -> bool:
    """Whether the model's bf16 weights fit `tp` GPUs with room for KV."""
    return MODELS[model_name].weight_bytes < GPUS[gpu_name].memory * MEMORY_SHARE * tp


def paper_profile(gpu_name: str, model_name: str, transfer_gbps: float, tp: int = 1) -> Profile:
    gpu, m = GPUS[gpu_name], MODELS[model_name]
    if tp < 1 or m.kv_heads % tp and tp % m.kv_heads:
        raise ValueError(f"TP {tp} does not split {model_name}'s {m.kv_heads} KV heads")
    if not fits(gpu_name, model_name, tp):
        raise ValueError(f"{model_name} in bf16 does not fit {tp} x {gpu_name}")
    prefill_tokens = [128, 512, 1024, 2048, 4096, 8192]
    decode_batch = [1, 8, 32, 64, 128, 256]
    decode_context = [256, 1024, 4096, 8192]

    def all_reduces(tokens: int) -> float:
        """A forward's 2 all-reduces a layer over `tokens` rows of activations (0 at TP 1)."""
        if tp == 1:
            return 0.0
        ring = 2 * (tp - 1) / tp * tokens * m.hidden * 2 / (gpu.link * LINK_EFFICIENCY)
        return 2 * m.layers * (ring + ALLREDUCE_LATENCY_S)

    def prefill(n: int) -> float:
        flops = 2 * m.params * n + 2 * m.layers * n * n * m.q_heads * m.head_dim
        compute = max(flops / (gpu.flops * PREFILL_MFU), m.weight_bytes / (gpu.bandwidth * BW_EFFICIENCY))
        return compute / tp + all_reduces(n)

    def decode(b: int, c: int) -> float:
        read = m.weight_bytes + b * c * m.kv_bytes_per_token
        compute = max(read / (gpu.bandwidth * BW_EFFICIENCY), 2 * m.params * b / (gpu.flops * PREFILL_MFU))
        return compute / tp + all_reduces(b)

    kv_room = int((gpu.memory * MEMORY_SHARE * tp - m.weight_bytes) / m.kv_bytes_per_token)
    return Profile(
        host=f"{gpu_name} on paper (datasheet roofline, not measured)",
        model=model_name,
        dtype="bfloat16",
        quantization="none",
        threads=0,
        prefill_tokens=prefill_tokens,
        prefill_s=[prefill(n) + STEP_OVERHEAD_S for n in prefill_tokens],
        decode_batch=decode_batch,
        decode_context=decode_context,
        decode_s=[[decode(b, c) + STEP_OVERHEAD_S for c in decode_context] for b in decode_batch],
        transfer_s_per_token=m.kv_bytes_per_token / (transfer_gbps * 1e9),
        chunked_prefill_size=8192,
        max_running_requests=256,
        kv_tokens=kv_room,
        devices=tp,
        notes=[
            f"{gpu_name}: {gpu.flops / 1e12:.0f} TFLOP/s dense bf16, {gpu.bandwidth / 1e12:.2f} TB/s HBM, "
            f"{gpu.link / 1e9:.0f} GB/s NVLink a direction (datasheet); prefill at {PREFILL_MFU:.0%} of peak, "
            f"decode at {BW_EFFICIENCY:.0%} of bandwidth, {STEP_OVERHEAD_S * 1e3:g} ms a forward",
            f"{model_name}: {m.params / 1e9:.2f}B parameters, {m.kv_bytes_per_token / 1024:.0f} KiB of KV a token; "
            f"TP {tp}: KV room {kv_room / 1e3:.0f}k tokens a worker",
            f"hand-off at {transfer_gbps:g} GB/s between workers",
        ],
    )
