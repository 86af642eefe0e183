"""Profiles on paper: a GPU worker's forward times scaled from published datasheet figures, for plans
beyond the host at hand (`pdserve plan --gpu H100-SXM --gpu-model llama-3.1-8b`).

Nothing here is measured. A forward's time is a roofline over the GPU's peak dense bf16 FLOP/s and HBM
bandwidth (vendor datasheets), at the efficiencies below, plus a fixed cost per forward:
- prefill of n tokens: max(FLOPs / (peak x PREFILL_MFU), weight bytes / (bandwidth x BW_EFFICIENCY)),
  FLOPs = 2 x params x n + 2 x layers x n^2 x q heads x head_dim (causal attention);
- decode step of b requests at mean context c: max((weight bytes + b x c x KV bytes per token) /
  (bandwidth x BW_EFFICIENCY), 2 x params x b / (peak x PREFILL_MFU));
- the hand-off of a prompt's KV: its bytes over `transfer_gbps` (a parameter: the link between workers).
One model replica per GPU, bf16 weights and KV. The profile's `host` and `notes` say it is on paper, and
with which figures; a lent GPU records measured profiles instead (benchmarks/gpu_profiles.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.plan.profile import Profile

PREFILL_MFU = 0.5  # share of peak FLOP/s a large prefill reaches
BW_EFFICIENCY = 0.7  # share of peak HBM bandwidth a decode step reaches
STEP_OVERHEAD_S = 0.0005  # per forward: launches, sampling, the scheduler (CUDA graphs assumed)


@dataclass(frozen=True)
class Gpu:
    flops: float  # peak dense bf16 FLOP/s
    bandwidth: float  # HBM bytes/s
    memory: float  # bytes


@dataclass(frozen=True)
class ModelShape:
    params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @property
    def weight_bytes(self) -> float:
        return 2 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


GPUS = {  # vendor datasheets: dense bf16 tensor FLOP/s, HBM bandwidth, memory
    "H100-SXM": Gpu(989e12, 3.35e12, 80e9),
    "H200": Gpu(989e12, 4.8e12, 141e9),
    "A100-SXM-80GB": Gpu(312e12, 2.04e12, 80e9),
}
MODELS = {  # from the models' config.json
    "llama-3.1-8b": ModelShape(8.03e9, 32, 32, 8, 128),
    "qwen2.5-7b": ModelShape(7.62e9, 28, 28, 4, 128),
}


def paper_profile(gpu_name: str, model_name: str, transfer_gbps: float) -> Profile:
    gpu, m = GPUS[gpu_name], MODELS[model_name]
    if m.weight_bytes >= gpu.memory:
        raise ValueError(f"{model_name} in bf16 does not fit one {gpu_name}")
    prefill_tokens = [128, 512, 1024, 2048, 4096, 8192]
    decode_batch = [1, 8, 32, 64, 128, 256]
    decode_context = [256, 1024, 4096, 8192]

    def prefill(n: int) -> float:
        flops = 2 * m.params * n + 2 * m.layers * n * n * m.q_heads * m.head_dim
        return max(flops / (gpu.flops * PREFILL_MFU), m.weight_bytes / (gpu.bandwidth * BW_EFFICIENCY))

    def decode(b: int, c: int) -> float:
        read = m.weight_bytes + b * c * m.kv_bytes_per_token
        return max(read / (gpu.bandwidth * BW_EFFICIENCY), 2 * m.params * b / (gpu.flops * PREFILL_MFU))

    kv_room = (gpu.memory * 0.9 - m.weight_bytes) / m.kv_bytes_per_token  # tokens of KV one GPU holds
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
        notes=[
            f"{gpu_name}: {gpu.flops / 1e12:.0f} TFLOP/s dense bf16, {gpu.bandwidth / 1e12:.2f} TB/s HBM "
            f"(datasheet); prefill at {PREFILL_MFU:.0%} of peak, decode at {BW_EFFICIENCY:.0%} of bandwidth, "
            f"{STEP_OVERHEAD_S * 1e3:g} ms a forward",
            f"{model_name}: {m.params / 1e9:.2f}B parameters, {m.kv_bytes_per_token / 1024:.0f} KiB of KV a token; "
            f"KV room about {kv_room / 1e3:.0f}k tokens a GPU (decode batches are not limited by it here)",
            f"hand-off at {transfer_gbps:g} GB/s between workers",
        ],
    )
