"""Triton kernels, one concern per module, each with a wrapper that checks its arguments and a torch
reference with the same signature (`<name>_ref`):

- decode_attention: paged decode attention, grouped-query heads, split-K with a merge kernel.
- extend_attention: packed prefill/extend over cached prefix pages; a speculative verify (k+1
  causal candidates per request) is the same kernel with max_extend_len = k+1.
- kv_copy: the store of new tokens' K/V into the paged pool.
- rmsnorm: RMSNorm with an optional fused residual add.
- rotary: rotary embedding applied in place to q and k.

One C++ kernel for CPUs (not Triton): cpu_decode_attention, paged decode attention reading the KV pool
in place, built at first use and registered as a torch operator (`torch.ops.pdserve_cpu`), with its
torch reference; the `cpu` attention backend (runtime/attention_cpu.py) runs it.

Who calls the Triton kernels: the Triton attention backend (runtime/attention_triton.py) runs the attention
kernels and the KV store; the model (runtime/models/llama.py) runs rmsnorm and rotary on CUDA.

Modules import triton at import time; this package does not, so `import pdserve.kernels` works
where triton is missing. On CPU the kernels run only under TRITON_INTERPRET=1 (set before triton
is first imported).
"""
