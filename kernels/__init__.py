"""Triton kernels, one concern per module, each with a wrapper that checks its arguments and a torch
reference with the same signature (`<name>_ref`):

- decode_attention: paged decode attention, grouped-query heads, split-K with a merge kernel.
- extend_attention: packed prefill/extend over cached prefix pages; `verify_attention` for
  speculative verify (k+1 causal candidates per request) is the same kernel.
- kv_copy: page gather/scatter between the pool and a transfer buffer; store of new K/V.
- rmsnorm: RMSNorm with an optional fused residual add.
- rotary: rotary embedding applied in place to q and k.

Modules import triton at import time; this package does not, so `import pdserve.kernels` works
where triton is missing. On CPU the kernels run only under TRITON_INTERPRET=1 (set before triton
is first imported).
"""
