"""How big a worker's KV pool is, and in which dtype: --kv-cache-dtype, --max-total-tokens, and the
defaults without them (a share of the host's memory on CPU, --mem-fraction-static of the free GPU memory).

The runner (runtime/runner.py) builds the pool this module sizes; it decides nothing else about it.
"""

from __future__ import annotations

import torch

from pdserve.config import RuntimeConfig
from pdserve.procfs import kb_field_bytes
from pdserve.runtime.kv_pool import KVGeometry
from pdserve.runtime.loader import LoadedModel

# The CPU KV pool's default size (`default_cpu_pool_tokens`): at most this share of the host's available
# memory per worker, and 32768 tokens where that cannot be read.
CPU_POOL_MEMORY_SHARE = 0.1
CPU_DEFAULT_MAX_TOTAL_TOKENS = 32768

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_cache_dtype(flag: str, loaded: LoadedModel, device: torch.device) -> tuple[torch.dtype, str]:
    """The KV pool's dtype for `--kv-cache-dtype`, and why (for the start-up line). auto: float16 for a
    quantized model computing in float32 on CPU (half the pool's bytes; the attention converts each row
    back to float32, F16C on x86; docs/benchmarks.md has its accuracy), else the model's dtype: an
    unquantized float32 model stays the exactness reference. Other dtypes than the model's are CPU only
    (the CUDA kernels store and read the model's dtype)."""
    if flag == "auto":
        if device.type == "cpu" and loaded.dtype == torch.float32 and loaded.quantization != "none":
            return torch.float16, "auto: float16 for a quantized float32 model on CPU"
        return loaded.dtype, "auto: the model's dtype"
    if flag not in KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype {flag!r}: choose auto, {', '.join(KV_DTYPES)}")
    dtype = KV_DTYPES[flag]
    if dtype != loaded.dtype and device.type != "cpu":
        raise ValueError(
            f"--kv-cache-dtype {flag} differs from the model's dtype, which only CPU workers take"
        )
    return dtype, "asked"


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The host's MemAvailable (what it can give without swapping) in bytes; None where unknown."""
    return kb_field_bytes(meminfo, "MemAvailable")


def default_cpu_pool_tokens(
    context_length: int,
    max_running_requests: int,
    page_size: int,
    bytes_per_token: int,
    mem_available: int | None,
) -> tuple[int, str]:
    """The CPU KV pool's size in tokens when --max-total-tokens is not given, and why, in words.

    What the worker can ever use, every running request at the full context length, capped at
    CPU_POOL_MEMORY_SHARE of the host's available memory; whole pages, at least one. The pool costs
    memory only as far as it is used (KVPool), so a large bound is cheap while idle; it is the
    most the pool can grow to, requests' pages and the prefix cache's together (the cache keeps
    pages until the pool runs short)."""
    demand = context_length * max_running_requests
    why = f"context {context_length} x {max_running_requests} running requests = {demand} tokens"
    if mem_available is None:
        tokens = min(demand, CPU_DEFAULT_MAX_TOTAL_TOKENS)
        why += f", at most {CPU_DEFAULT_MAX_TOTAL_TOKENS} (MemAvailable unknown)"
    else:
        cap = int(mem_available * CPU_POOL_MEMORY_SHARE) // bytes_per_token
        tokens = min(demand, cap)
        share = f"{CPU_POOL_MEMORY_SHARE:.0%} of MemAvailable {mem_available / 2**30:.2f} GiB"
        why += f", capped at {share} = {cap} tokens" if cap < demand else f" (under {share})"
    return max(page_size, tokens // page_size * page_size), why


def pool_tokens(
    cfg: RuntimeConfig, device: torch.device, context_length: int, bytes_per_token: int
) -> tuple[int, str]:
    """The pool's size in tokens, and why (for the start-up log): --max-total-tokens, else the default
    of the device (`bytes_per_token`: one token's KV over every layer of this rank's heads)."""
    if cfg.max_total_tokens:
        return cfg.max_total_tokens, "--max-total-tokens"
    if device.type != "cuda":
        return default_cpu_pool_tokens(
            context_length, cfg.max_running_requests, cfg.page_size, bytes_per_token, mem_available_bytes()
        )
    free, _ = torch.cuda.mem_get_info(device)
    why = f"{cfg.mem_fraction_static:.2f} of free GPU memory {free / 2**30:.2f} GiB"
    return int(free * cfg.mem_fraction_static) // bytes_per_token, why


def describe_pool(geometry: KVGeometry, num_pages: int, dtype_why: str, lazy: bool, why: str) -> str:
    """The start-up line's account of a built pool (`lazy`: a CPU pool, taking memory as pages are
    first used)."""
    return "%d pages x %d tokens in %s (%s; %.2f GiB%s): %s" % (  # noqa: UP031
        num_pages,
        geometry.page_size,
        str(geometry.dtype).removeprefix("torch."),
        dtype_why,
        num_pages * geometry.page_size * geometry.bytes_per_token / 2**30,
        ", memory taken as pages are first used" if lazy else "",
        why,
    )
