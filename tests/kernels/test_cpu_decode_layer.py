"""The one-call CPU decode layer (kernels/cpu_decode_layer.py) against the model's eager layer: the same
outputs and the same pool contents, bit for bit, on tiny checkpoints in bf16 (plain and w4a16) and in
fp32 (w4a16: a quantized model takes the fused path in fp32 too); and the model's forward takes it
exactly where it should."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from pdserve.kernels import cpu_decode_layer, cpu_quant_linear
from pdserve.runtime.attention import TorchAttention
from pdserve.runtime.attention_cpu import CpuAttention
from pdserve.runtime.batch import ForwardBatch, ForwardMode
from pdserve.runtime.kv_pool import KVGeometry, KVPool
from pdserve.runtime.loader import load_model

PAGE = 4
OP = "pdserve_cpu::decode_layer"


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_decode_layer.load(), "the CPU kernels did not build"


def _decode_case(loaded, prefix_lens: list[int], seed: int = 0) -> tuple[ForwardBatch, KVPool]:
    """A decode batch (one new token per request after `prefix_lens` cached ones) over a pool of
    random KV, the requests' pages scattered."""
    spec = loaded.spec
    g = torch.Generator().manual_seed(seed)
    geo = KVGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, PAGE, loaded.dtype)
    pages_per = [-(-(p + 1) // PAGE) for p in prefix_lens]
    num_pages = sum(pages_per) + 2
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in pages_per]
    tokens = [[int(t)] for t in torch.randint(0, spec.vocab_size, (len(prefix_lens),), generator=g)]
    batch = ForwardBatch.build(ForwardMode.DECODE, tokens, prefix_lens, tables, PAGE)
    pool = KVPool(geo, num_pages)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g).to(loaded.dtype))
    return batch, pool


@pytest.mark.parametrize(
    "dtype,quantization", [("bfloat16", "none"), ("bfloat16", "w4a16"), ("float32", "w4a16")]
)
@pytest.mark.parametrize("name", ["llama3-rope-tied", "llama-untied", "qwen2-bias"])
@pytest.mark.parametrize("prefix_lens", [[6], [5, 17, 1]])
def test_each_layer_equals_the_eager_layer(tiny_folders, name, dtype, quantization, prefix_lens):
    loaded = load_model(tiny_folders[name], dtype=dtype, quantization=quantization)
    model = loaded.model
    batch, pool = _decode_case(loaded, prefix_lens)
    ref_pool = KVPool(pool.geometry, pool.kv.shape[0])
    ref_pool.kv.copy_(pool.kv)
    backend, ref_backend = CpuAttention(), CpuAttention()
    backend.prepare(batch, pool)
    ref_backend.prepare(batch, ref_pool)
    rotary = model.rotary
    with torch.inference_mode():
        x = model.model.embed_tokens(batch.input_ids)
        residual = None
        for layer in model.model.layers:
            weights = layer.decode_weights()
            if quantization in ("w4a16", "w4a8") and not cpu_quant_linear.support()[0]:
                # This host builds no int4 kernel (no AVX2 + FMA + F16C): its w4a16 linears are
                # torch's, and the layer keeps the eager path, as decode_weights documents.
                assert weights is None
                return
            assert weights is not None, "every layer of these models can run as one call"
            args = backend.decode_args(layer.layer_id, pool)
            got = cpu_decode_layer.decode_layer(
                x, residual, weights, batch.positions, rotary.cos, rotary.sin_signed, args
            )
            ref = layer(x, residual, batch.positions, rotary, ref_backend, ref_pool)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
            x, residual = ref
    assert torch.equal(pool.kv, ref_pool.kv)  # the same new K and V at the same rows


def _layer_calls(model, batch: ForwardBatch, pool: KVPool, backend) -> int:
    with profile() as prof:
        model.forward(batch, pool, backend)
    return sum(e.name == OP for e in prof.events())


@pytest.mark.parametrize(
    "dtype,quantization", [("bfloat16", "none"), ("bfloat16", "w4a16"), ("float32", "w4a16")]
)
def test_the_forward_takes_one_call_per_layer_for_cpu_decode_batches(tiny_folders, dtype, quantization):
    loaded = load_model(tiny_folders["llama-untied"], dtype=dtype, quantization=quantization)
    batch, pool = _decode_case(loaded, [3, 9])
    # Without an int4 kernel on this host (no AVX2 + FMA + F16C) w4a16 layers keep the eager path.
    one_call = quantization != "w4a16" or cpu_quant_linear.support()[0]
    want = loaded.spec.num_layers if one_call else 0
    assert _layer_calls(loaded.model, batch, pool, CpuAttention()) == want
    # the torch attention backend (the reference) and prefills keep the eager layers
    assert _layer_calls(loaded.model, batch, pool, TorchAttention()) == 0
    prefill = ForwardBatch.build(ForwardMode.EXTEND, [[1, 2, 3]], [0], [[0]], PAGE)
    assert _layer_calls(loaded.model, prefill, pool, CpuAttention()) == 0


@pytest.mark.parametrize(
    "name,dtype,quantization",
    [
        ("qwen3-qknorm", "bfloat16", "none"),  # per-head q/k norms: not in the one-call layer
        ("llama-untied", "float32", "none"),  # fp32, the exactness reference, keeps torch's ops
        ("llama-untied", "bfloat16", "w8a16_int8"),  # int8 projections: their own modules
    ],
)
def test_other_layers_keep_the_eager_path(tiny_folders, name, dtype, quantization):
    loaded = load_model(tiny_folders[name], dtype=dtype, quantization=quantization)
    batch, pool = _decode_case(loaded, [3, 9])
    assert _layer_calls(loaded.model, batch, pool, CpuAttention()) == 0
