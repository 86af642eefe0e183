"""The C++ paged decode attention (kernels/cpu_decode_attention.py) against its torch reference, and the
`cpu` attention backend against the torch backend on the same batches and pool contents."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.kernels import cpu_decode_attention as cda
from pdserve.runtime.attention import TorchAttention, make_attention_backend
from pdserve.runtime.attention_cpu import CpuAttention
from pdserve.runtime.batch import ForwardBatch, ForwardMode
from pdserve.runtime.kv_pool import KVGeometry, KVPool

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
TOL = {F32: 1e-5, BF16: 2e-2, F16: 2e-3}


@pytest.fixture(scope="module", autouse=True)
def built():
    # The kernel builds wherever the test suite runs (a C++ compiler is part of the set-up, as for
    # --enable-torch-compile): a failed build fails here rather than skipping.
    assert cda.load(), "the CPU paged decode attention did not build"


def _case(B, H, hkv, group, dim, dtype, lens, new, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(4 * B * H + 7, hkv, dim, generator=g).to(dtype)
    # every request's positions at scattered rows, leaving room for the V offset
    key_rows = torch.randperm(2 * B * H, generator=g)[: B * H].view(B, H).long()
    q = torch.randn(B, hkv * group, dim, generator=g).to(dtype)
    k_new = v_new = None
    if new:
        k_new = torch.randn(B, hkv, dim, generator=g).to(dtype)
        v_new = torch.randn(B, hkv, dim, generator=g).to(dtype)
    args = (q, rows, key_rows, torch.tensor(lens), 3, 2 * B * H + 5, dim**-0.5, k_new, v_new)
    return args


@pytest.mark.parametrize(
    "B,H,hkv,group,dim,lens,new",
    [
        pytest.param(1, 1, 1, 1, 64, [1], False, id="one-key"),
        pytest.param(3, 37, 3, 3, 64, [37, 5, 20], False, id="gqa-uneven"),
        pytest.param(4, 200, 1, 8, 128, [200, 199, 1, 77], True, id="mqa-new-key"),
        pytest.param(2, 9, 2, 1, 32, [0, 9], True, id="only-new-key"),
        pytest.param(2, 16, 4, 2, 80, [16, 3], True, id="dim80"),
        # several requests a thread: each prefetches the next one's rows while it computes
        pytest.param(9, 50, 3, 3, 64, [50, 0, 3, 49, 1, 50, 0, 17, 33], True, id="staged-next-rows"),
    ],
)
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
def test_kernel_matches_reference(B, H, hkv, group, dim, lens, new, dtype):
    args = _case(B, H, hkv, group, dim, dtype, lens, new)
    got = cda.paged_decode_attention(*args)
    ref = cda.paged_decode_attention_ref(*args)
    assert got.dtype == dtype and got.shape == args[0].shape
    torch.testing.assert_close(got.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("kv_dtype", [F16, BF16], ids=["fp16-pool", "bf16-pool"])
@pytest.mark.parametrize("new", [False, True], ids=["cached", "new-key"])
def test_float32_queries_read_a_half_pool(kv_dtype, new):
    """--kv-cache-dtype: fp32 queries over an fp16 / bf16 pool; rows (and a new key, rounded to the pool's
    dtype as it will be stored) read back into float32: the fp32 reference on the same values."""
    args = list(_case(4, 60, 3, 3, 64, F32, [60, 1, 33, 59], new))
    args[1] = args[1].to(kv_dtype)
    got = cda.paged_decode_attention(*args)
    ref = cda.paged_decode_attention_ref(*args)
    assert got.dtype == F32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # and the rounding is the pool's: the same as a float32 pool holding the rounded values
    rounded = list(args)
    rounded[1] = args[1].float()
    if new:
        rounded[7], rounded[8] = args[7].to(kv_dtype).float(), args[8].to(kv_dtype).float()
    torch.testing.assert_close(got, cda.paged_decode_attention(*rounded), rtol=1e-5, atol=1e-5)
    other = BF16 if kv_dtype == F16 else F16  # half queries over the other half pool: refused
    with pytest.raises(RuntimeError, match="dtype"):
        cda.paged_decode_attention(
            args[0].to(other), *args[1:7], *(None if t is None else t.to(other) for t in args[7:])
        )


@pytest.mark.parametrize(
    "dtype,kv_dtype", [(F32, F32), (BF16, BF16), (F32, F16)], ids=["fp32", "bf16", "fp32-fp16-pool"]
)
def test_store_then_attend_matches_index_copy_then_reference(dtype, kv_dtype):
    """The eager step's form: each request's new K and V (views of a fused qkv, as the model passes
    them) stored at its new row, then attended to with its cached rows."""
    B, H, hkv, group, dim = 5, 40, 3, 3, 64
    q, rows, key_rows, _, k_off, v_off, scale, _, _ = _case(B, H, hkv, group, dim, dtype, [1] * B, False)
    rows = rows.to(kv_dtype)
    g = torch.Generator().manual_seed(5)
    lens = torch.tensor([40, 1, 17, 33, 2])
    new_rows = key_rows[torch.arange(B), lens - 1]  # the last visible position is the new token's
    qkv = torch.randn(B, (group + 2) * hkv * dim, generator=g).to(dtype)
    k = qkv[:, group * hkv * dim : (group + 1) * hkv * dim].view(B, hkv, dim)
    v = qkv[:, (group + 1) * hkv * dim :].view(B, hkv, dim)
    assert not k.is_contiguous()
    want_rows = rows.clone()
    ref = cda.paged_decode_attention_store_ref(
        q, want_rows, key_rows, lens, k_off, v_off, scale, new_rows, k, v
    )
    got = cda.paged_decode_attention_store(q, rows, key_rows, lens, k_off, v_off, scale, new_rows, k, v)
    assert torch.equal(rows, want_rows)
    torch.testing.assert_close(got.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
    with pytest.raises(RuntimeError, match="new row .* outside the pool"):
        cda.paged_decode_attention_store(
            q, rows, key_rows, lens, k_off, v_off, scale, new_rows + rows.shape[0], k, v
        )


def test_a_request_that_sees_nothing_gets_zeros():
    args = _case(2, 4, 1, 2, 64, F32, [0, 4], new=False)
    out = cda.paged_decode_attention(*args)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert out[1].abs().sum() > 0


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.__setitem__(3, torch.tensor([5, 99])), "outside"),  # lens past H
        (lambda a: a.__setitem__(3, torch.tensor([-1, 2])), "outside"),
        (lambda a: a[2].__setitem__((0, 0), 10**9), "outside the pool"),
        (lambda a: a[2].__setitem__((1, 0), -50), "outside the pool"),
        (lambda a: a.__setitem__(0, a[0].double()), "dtype"),
        (lambda a: a.__setitem__(3, torch.tensor([1, 2], dtype=torch.int32)), "int64"),
        (lambda a: a.__setitem__(7, None), "both"),
        (lambda a: a.__setitem__(0, a[0][:, :3]), "head"),
    ],
    ids=[
        "lens-past-H",
        "lens-negative",
        "row-past-pool",
        "row-negative",
        "dtype",
        "lens-int32",
        "k-without-v",
        "heads",
    ],
)
def test_bad_arguments_are_errors_not_reads_out_of_bounds(change, message):
    args = list(_case(2, 5, 2, 2, 64, F32, [5, 2], new=True))
    change(args)
    with pytest.raises(RuntimeError, match=message):
        cda.paged_decode_attention(*args)


def test_auto_picks_the_cpu_backend_on_cpu():
    assert isinstance(make_attention_backend("auto", torch.device("cpu")), CpuAttention)
    assert type(make_attention_backend("torch", torch.device("cpu"))) is TorchAttention


def _run_backends(mode, prefix_lens, extend_lens, kv_heads, group, dim, page, dtype, kv_dtype=None, seed=0):
    """The cpu and torch backends on one random batch and pool (in kv_dtype, else dtype): (outputs, pools)
    per backend."""
    g = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    geo = KVGeometry(num_layers=2, kv_heads=kv_heads, head_dim=dim, page_size=page, dtype=kv_dtype)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_per = [-(-s // page) for s in seq_lens]
    num_pages = sum(pages_per) + 3
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in pages_per]
    batch = ForwardBatch.build(mode, [list(range(e)) for e in extend_lens], prefix_lens, tables, page)
    pools = {name: KVPool(geo, num_pages) for name in ("cpu", "torch")}
    init = torch.randn(pools["cpu"].kv.shape, generator=g).to(kv_dtype)
    outs: dict[str, list[torch.Tensor]] = {"cpu": [], "torch": []}
    backends = {"cpu": CpuAttention(), "torch": TorchAttention()}
    for name, pool in pools.items():
        pool.kv.copy_(init)
        backends[name].prepare(batch, pool)
    for layer in range(2):
        T = batch.num_tokens
        q = torch.randn(T, kv_heads * group, dim, generator=g).to(dtype)
        k = torch.randn(T, kv_heads, dim, generator=g).to(dtype)
        v = torch.randn(T, kv_heads, dim, generator=g).to(dtype)
        for name, pool in pools.items():
            outs[name].append(backends[name].forward(q, k, v, layer, pool, dim**-0.5))
    return outs, pools


@pytest.mark.parametrize(
    "mode,prefix,ext,hkv,group,dim,page,dtype",
    [
        pytest.param(ForwardMode.DECODE, [0, 16, 40, 7], [1, 1, 1, 1], 2, 3, 64, 16, F32, id="decode"),
        pytest.param(ForwardMode.DECODE, [130, 1], [1, 1], 1, 8, 64, 1, BF16, id="decode-page1-bf16"),
        pytest.param(ForwardMode.DECODE, [33], [1], 3, 3, 64, 4, BF16, id="decode-single"),
        pytest.param(ForwardMode.EXTEND, [0, 21, 5], [9, 1, 30], 1, 8, 64, 16, F32, id="extend-falls-back"),
        pytest.param(ForwardMode.VERIFY, [5, 31, 0], [4, 4, 4], 2, 3, 64, 16, F32, id="verify-falls-back"),
        # --kv-cache-dtype float16 under float32: both read the rounded rows back into float32
        pytest.param(
            ForwardMode.DECODE, [0, 16, 40, 7], [1, 1, 1, 1], 2, 3, 64, 16, (F32, F16), id="decode-fp16-pool"
        ),
        pytest.param(
            ForwardMode.EXTEND, [0, 21, 5], [9, 1, 30], 1, 8, 64, 16, (F32, F16), id="extend-fp16-pool"
        ),
    ],
)
def test_cpu_backend_matches_torch_backend(mode, prefix, ext, hkv, group, dim, page, dtype):
    dtype, kv_dtype = dtype if isinstance(dtype, tuple) else (dtype, dtype)
    outs, pools = _run_backends(mode, prefix, ext, hkv, group, dim, page, dtype, kv_dtype)
    tol = TOL[dtype]
    for got, ref in zip(outs["cpu"], outs["torch"]):
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    # both wrote the new tokens' K and V at the same places
    assert torch.equal(pools["cpu"].kv, pools["torch"].kv)


def _load_in_subprocess(env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = (
        "import torch\n"
        "from pdserve.kernels import cpu_decode_attention as c\n"
        "from pdserve.runtime.attention import make_attention_backend\n"
        "print(c.load(), type(make_attention_backend('auto', torch.device('cpu'))).__name__)\n"
    )
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_worker():
    """torch's own build lock is a file that outlives a worker killed mid-build; the next worker
    takes the flock (which died with the killed one), clears the stale file and loads."""
    build = cda.build_dir()
    (build / "lock").touch()
    out = _load_in_subprocess({})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "CpuAttention"]
    assert not (build / "lock").exists()


def test_without_a_compiler_auto_keeps_the_torch_path(tmp_path):
    out = _load_in_subprocess({"TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/bin/false"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "TorchAttention"]
    assert "the pdserve_cpu kernels were not built" in out.stderr


@pytest.mark.parametrize(
    "hkv,group,dim",
    [(3, 3, 64), (1, 8, 128), (2, 1, 32), (2, 2, 80)],  # 80: the plain (no vector) path
    ids=["gqa64", "mqa128", "mha32", "dim80"],
)
@pytest.mark.parametrize(
    ("qdtype", "kv_dtype"), [(F32, F32), (BF16, BF16), (F32, F16)], ids=["fp32", "bf16", "fp32-over-fp16"]
)
def test_extend_kernel_is_the_decode_kernel_query_by_query(hkv, group, dim, qdtype, kv_dtype):
    """Batch invariance: every query of an extend batch (blocks of 16 sharing rows) gives, bit for bit,
    what the decode kernel gives it alone as a decode step over the same rows."""
    g = torch.Generator().manual_seed(1)
    prefix, new = [0, 5, 40], [37, 1, 18]  # a fresh prompt, one token over a prefix, a chunk
    B, H = len(prefix), max(p + n for p, n in zip(prefix, new)) + 3
    rows = torch.randn(4 * B * H, hkv, dim, generator=g).to(kv_dtype)
    key_rows = torch.randperm(2 * B * H, generator=g)[: B * H].view(B, H).long()
    q = torch.randn(sum(new), hkv * group, dim, generator=g).to(qdtype)
    qo = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()])
    k_off, v_off, scale = 1, 2 * B * H, dim**-0.5
    got = cda.paged_extend_attention(q, rows, key_rows, torch.tensor(prefix), qo, k_off, v_off, scale)
    owner = torch.repeat_interleave(torch.arange(B), torch.tensor(new))
    lens = torch.cat([torch.arange(p + 1, p + n + 1) for p, n in zip(prefix, new)])
    for batch in (1, 5, len(lens)):  # decode batches of several sizes: the same values
        for s in range(0, len(lens), batch):
            sl = slice(s, s + batch)
            one = cda.paged_decode_attention(q[sl], rows, key_rows[owner[sl]], lens[sl], k_off, v_off, scale)
            assert torch.equal(got[sl], one)
    ref = cda.paged_decode_attention_ref(q, rows, key_rows[owner], lens, k_off, v_off, scale)
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[qdtype], rtol=TOL[qdtype])


def test_extend_kernel_refuses_rows_outside_the_pool():
    rows = torch.randn(10, 1, 64)
    q = torch.randn(2, 1, 64)
    key_rows = torch.tensor([[0, 1, 2, 50]])
    args = (torch.tensor([2]), torch.tensor([0, 2]), 0, 1, 0.125)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cda.paged_extend_attention(q, rows, key_rows, *args)
    with pytest.raises(RuntimeError, match="sees 5 rows of 4"):
        cda.paged_extend_attention(q, rows, key_rows, torch.tensor([3]), *args[1:])
