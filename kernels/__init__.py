"""pdserve's kernels: Triton kernels for CUDA, and the `pdserve_cpu` C++ library for CPUs. Each has a
wrapper that checks its arguments and a torch reference with the same behaviour (`<name>_ref`, or the
eager path named in its module).

Triton, one concern per module:

- decode_attention: paged decode attention, grouped-query heads, split-K with a merge kernel.
- extend_attention: packed prefill/extend over cached prefix pages; a speculative verify (k+1
  causal candidates per request) is the same kernel with max_extend_len = k+1.
- kv_copy: the store of new tokens' K/V into the paged pool.
- rmsnorm: RMSNorm with an optional fused residual add.
- rotary: rotary embedding applied in place to q and k.
- _online_softmax (the paged K/V loop and online softmax both attention kernels run) and _checks
  (argument checks, the paged attention wrappers' shared ones among them).

C++ for CPUs (not Triton), one `.cpp` and its Python module each, compiled together into one operator
library at first use (cpu_library.py, `torch.ops.pdserve_cpu`; cpu_rows.h holds the shared row
conversions, cpu_simd.h the AVX-512 and AVX2 registers the kernels are written over; cpu_isa.py picks
the instruction set at run time, from the CPU's flags or the PDSERVE_CPU_ISA cap):

- cpu_decode_attention: paged decode attention reading the KV pool in place, and its storing form
  that writes the step's new K/V first.
- cpu_fused_ops: RMSNorm (with a fused residual add), SiLU-and-mul and rotary, one pass each.
- cpu_quant_linear: weight-only int4 (GGUF Q4_1 groups) and int8 linears, with packers, and the int4
  weights dequantized into a scratch for many-row products.
- cpu_sampling: greedy sampling.
- cpu_decode_layer: one decoder layer of a decode step in one call, making the eager layer's calls.

Who calls them: the Triton attention backend (runtime/attention_triton.py) runs the attention kernels
and the KV store, and the model (runtime/models/) runs rmsnorm and rotary on CUDA; on CPU the
`cpu` attention backend (runtime/attention_cpu.py) runs the C++ attention, the model the fused ops and
the decoder layer, the quantized linears (runtime/quant.py) the int4/int8 kernels, and the sampler the
greedy kernel.

Triton modules import triton at import time; this package does not, so `import pdserve.kernels` works
where triton is missing. On CPU the Triton kernels run only under TRITON_INTERPRET=1 (set before triton
is first imported). Where the C++ library cannot be built, every caller keeps its torch path.
"""
