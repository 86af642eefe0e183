"""Argument checks shared by the kernel wrappers: clear errors before a launch, never after."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def check_tensor(
    name: str,
    t: torch.Tensor,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = True,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if last_dim_contiguous and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride(-1)})")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def interpreted(kernel: object) -> bool:
    """Whether a `@triton.jit` kernel runs in Triton's CPU interpreter.

    The interpreter's `tl.dot` on bf16/fp16 blocks returns garbage (numpy has no bf16), so the
    attention kernels upcast their dot operands to fp32 when this is true.
    """
    return type(kernel).__name__ == "InterpretedFunction"


def check_launchable(kernel: object, device: torch.device) -> None:
    """A compiled kernel needs a GPU; on CPU tensors only the interpreter can run it.

    Triton decides at `@triton.jit` time (module import) whether kernels are interpreted, so
    TRITON_INTERPRET=1 must be in the environment before the kernel modules are imported.
    """
    if device.type == "cpu" and not interpreted(kernel):
        raise RuntimeError(
            "Triton kernels got CPU tensors but are compiled for a GPU; set TRITON_INTERPRET=1 "
            "before importing pdserve.kernels to run them on CPU (slow, for tests)"
        )


def check_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[int, int]:
    """The checks the paged attention wrappers share: q [rows, Hq, D] in a float dtype; k_cache and v_cache
    [num_pages, page_size, Hkv, D] of q's dtype, Hkv dividing Hq; page_table [B, max_pages] int32,
    contiguous in its last dim; seq_lens [B] int32; all on q's device. Returns (page_size, Hkv)."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    dev = q.device
    check_tensor("k_cache", k_cache, 4, (q.dtype,), dev)
    check_tensor("v_cache", v_cache, 4, (q.dtype,), dev)
    check_tensor("page_table", page_table, 2, (torch.int32,), dev)
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), dev)
    _, Hq, D = q.shape
    _, page_size, Hkv, Dk = k_cache.shape
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if Dk != D:
        raise ValueError(f"q head_dim {D} != cache head_dim {Dk}")
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} must be a multiple of kv heads {Hkv}")
    if page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError("page_table must be contiguous in its last dim")
    return page_size, Hkv


def output_like(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out` checked to have q's shape, dtype and device, or a new tensor like q."""
    if out is None:
        return torch.empty_like(q)
    check_tensor("out", out, 3, (q.dtype,), q.device)
    check_shape("out", out, tuple(q.shape))
    return out
