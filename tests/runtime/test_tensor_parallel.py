"""--tp-size: a model split over N real processes in one gloo group (runtime/tp_layout.py, tp_group.py,
tp_follower.py) gives the tokens of the whole model; the KV hand-off's full-head pool gathers exactly
the ranks' heads and hands each rank exactly its own."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from pdserve.config import RuntimeConfig
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_model
from pdserve.runtime.model_config import ModelSpec
from pdserve.runtime.request import Request
from pdserve.runtime.tp_group import TPGroupBroken
from pdserve.runtime.tp_layout import TPLayout, TPLayoutError
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[5, 17, 99, 3, 42, 8] * k for k in (1, 3, 7)]
GREEDY = SamplingParams(
    max_new_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs_num=2
)


def _engine(folder: str | None, tp: int, **kw) -> Engine:
    cfg = dict(device="cpu", dtype="float32", max_total_tokens=4096, tp_size=tp)
    cfg.update(kw)
    return Engine(RuntimeConfig(model_path=folder, **cfg))


def _agreed_steps(a, b, tol: float) -> int:
    """Steps on which `a` gave `b`'s token with its log-probability within `tol`; a first different
    token is allowed only where b's top two were within `tol` (a tie under the rounding), and ends it."""
    for t, (x, y) in enumerate(zip(a.output_ids, b.output_ids)):
        if x != y:
            (_, first), (_, second) = b.output_top_logprobs[t][:2]
            assert first - second < tol, (t, x, y, b.output_top_logprobs[t])
            return t
        assert abs(a.output_logprobs[t] - b.output_logprobs[t]) < tol, (
            t,
            a.output_logprobs,
            b.output_logprobs,
        )
    return len(b.output_ids)


@pytest.fixture(scope="module")
def references(tiny_folders):
    """TP-1 outputs of each tiny model (computed once)."""
    out = {}
    for name in ("llama-untied", "llama3-rope-tied", "qwen2-bias", "qwen3-qknorm"):
        out[name] = _engine(tiny_folders[name], 1).generate(PROMPTS, GREEDY)
    return out


def test_a_layout_that_does_not_split_is_refused(tiny_folders, bundled) -> None:
    from transformers import AutoConfig

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(tiny_folders["llama-untied"]))
    assert TPLayout.of(spec, 4).kv_heads(3) == range(1, 2)  # 2 KV heads over 4 ranks: each on 2
    with pytest.raises(TPLayoutError, match="TP size 3 does not split 8 query heads"):
        TPLayout.of(spec, 3)
    # the bundled model: 9 query heads, 3 KV heads
    with pytest.raises(TPLayoutError, match=r"9 query heads and 3 KV heads \(neither divides the other\)"):
        TPLayout.of(bundled.spec, 2)
    with pytest.raises(ValueError, match="--tp-size must be >= 1"):
        RuntimeConfig(tp_size=0)


@pytest.mark.parametrize(
    "name,tp",
    [
        ("llama-untied", 2),
        ("llama-untied", 4),
        ("llama3-rope-tied", 4),
        ("qwen2-bias", 2),
        ("qwen3-qknorm", 2),
    ],
)
def test_tp_gives_the_whole_models_tokens(tiny_folders, references, name, tp) -> None:
    """Heads split (and replicated where KV heads are fewer than ranks), q/k norms, qkv bias, tied and
    untied vocabularies: the same greedy tokens as TP 1, their logprobs to float32 rounding, on the
    C++ and the torch attention; the second run of the prompts starts from the prefix cache."""
    for backend in ("cpu", "torch") if tp == 2 and name == "llama-untied" else ("auto",):
        e = _engine(tiny_folders[name], tp, attention_backend=backend)
        try:
            for run in range(2):
                got = e.generate(PROMPTS, GREEDY)
                if run:
                    assert sum(o.cached_tokens for o in got) > 0
                for a, b in zip(got, references[name]):
                    assert a.output_ids == b.output_ids
                    assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-4
        finally:
            e.runner.close()


def test_bundled_model_over_three_ranks_equals_transformers(bundled, hf_bundled) -> None:
    """SmolLM2-135M's 3 KV heads split over TP 3 (3 query heads and 1 KV head per rank)."""
    e = _engine(None, 3)
    try:
        prompts = [list(range(100, 140)), [1, 504, 3458, 282, 4649, 314]]
        got = e.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
        for p, o in zip(prompts, got):
            want = hf_bundled.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :]
            assert o.output_ids == want.tolist()
    finally:
        e.runner.close()


def test_quantized_shards_agree_with_the_whole_quantized_model(tiny_folders) -> None:
    """Each rank quantizes its own shard (a row-parallel projection's scales then cover its columns
    only): the tokens of the whole quantized model except at near-ties."""
    whole = _engine(tiny_folders["llama-untied"], 1, dtype="auto", quantization="w8a16_int8")
    want = whole.generate(PROMPTS, GREEDY)
    e = _engine(tiny_folders["llama-untied"], 2, dtype="auto", quantization="w8a16_int8")
    try:
        assert e.runner.loaded.quantization == "w8a16_int8"
        got = e.generate(PROMPTS, GREEDY)
        # bfloat16 activations where the host has BF16 instructions: rounding of ~0.06 in a logprob
        agreed = [_agreed_steps(a, b, tol=0.15) for a, b in zip(got, want)]
        assert sum(agreed) >= 0.75 * sum(len(b.output_ids) for b in want), agreed
    finally:
        e.runner.close()


@pytest.fixture(scope="module")
def handoff_runners(tiny_folders):
    """Runners of the tiny 8-query / 2-KV-head model at TP 1, 2 and 4, each with one prompt prefilled
    into the same pages."""
    runners = {tp: _engine(tiny_folders["llama-untied"], tp).runner for tp in (1, 2, 4)}
    prompt = PROMPTS[2]
    pages = list(range(runners[1].pages_for(len(prompt))))
    for r in runners.values():
        req = Request("r", prompt, SamplingParams(max_new_tokens=1))
        assert r.reserve(req, len(prompt)) and req.pages == pages
        r.forward(ForwardMode.EXTEND, [req], [prompt])
    yield runners, pages
    for r in runners.values():
        r.close()


@pytest.mark.parametrize("p,d", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_kv_handed_between_tp_layouts_lands_as_each_ranks_heads(handoff_runners, p, d) -> None:
    """What a TP-p prefill sends (its ranks' heads gathered) equals a TP-1 pool's pages to float32
    rounding; a TP-d decode that receives it hands each rank its heads, byte for byte: rank 0 holds
    exactly its slice, and gathering every rank back gives the bytes received."""
    runners, pages = handoff_runners
    src, dst = runners[p], runners[d]
    src.before_send(pages)
    sent = src.transfer_kv[pages].clone()
    torch.testing.assert_close(sent, runners[1].pool.kv[pages], atol=1e-5, rtol=1e-5)
    assert sent.shape[4] == 2  # every KV head travels, whatever the layouts
    dst.transfer_kv[pages] = sent  # what the transport writes
    dst.after_receive(pages)
    if dst.tp_size > 1:
        heads = dst.head_split[0]
        assert torch.equal(dst.pool.kv[pages], sent[:, :, :, :, heads.start : heads.stop])
        dst.transfer_kv[pages] = 0
        dst.before_send(pages)
        assert torch.equal(dst.transfer_kv[pages], sent)
    else:
        assert torch.equal(dst.pool.kv[pages], sent)


def test_a_rank_that_dies_takes_the_worker_down(tiny_folders) -> None:
    e = _engine(tiny_folders["llama-untied"], 2)
    try:
        assert e.runner.tp_failure() is None
        follower = e.runner.tp.followers[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.wait(timeout=30)
        assert "TP rank 1 exited" in (e.runner.tp_failure() or "")
        with pytest.raises(TPGroupBroken):
            e.generate(PROMPTS[:1], GREEDY)
    finally:
        e.runner.close()


def test_loading_a_rank_cuts_its_weights(tiny_folders) -> None:
    whole = load_model(tiny_folders["llama-untied"], "float32", "cpu", "none")
    part = load_model(tiny_folders["llama-untied"], "float32", "cpu", "none", tp_size=2, tp_rank=1)
    assert part.tp_layout is not None and part.tp_rank == 1
    a, b = whole.model.model.layers[0], part.model.model.layers[0]
    assert b.self_attn.nq == a.self_attn.nq // 2 and b.self_attn.nkv == a.self_attn.nkv // 2
    assert b.mlp.down_proj.weight.shape[1] * 2 == a.mlp.down_proj.weight.shape[1]
    # rank 1's o_proj columns are the second half of the whole one's
    half = a.self_attn.o_proj.weight.shape[1] // 2
    assert torch.equal(b.self_attn.o_proj.weight, a.self_attn.o_proj.weight[:, half:])
    vocab = whole.spec.vocab_size
    assert torch.equal(part.model.lm_head.weight, whole.model.lm_head.weight[vocab // 2 :])


def test_the_shared_memory_all_reduce_sums_in_rank_order_and_notices_a_dead_rank(tmp_path) -> None:
    """Two ranks (threads here, processes in a worker) over one segment: both get the same sum, call
    after call through the alternating slots; a rank left waiting for a dead one gives up."""
    import threading

    from pdserve.runtime.tp_shm import ShmAllReduce, make_segment

    path = str(tmp_path / "segment")
    make_segment(path, 2)
    ranks = [ShmAllReduce(path, r, 2) for r in range(2)]
    inputs = [[torch.randn(3, 576) for _ in range(5)] for _ in range(2)]
    outs: list[list[torch.Tensor]] = [[], []]

    def run(r: int) -> None:
        for x in inputs[r]:
            t = x.clone()
            ranks[r].all_reduce(t, lambda: True, 30.0)
            outs[r].append(t)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for k in range(5):
        assert torch.equal(outs[0][k], outs[1][k])
        assert torch.equal(outs[0][k], inputs[0][k] + inputs[1][k])
    assert ranks[0].fits(torch.empty(1024, 1024)) and not ranks[0].fits(torch.empty(4096, 1024))
    with pytest.raises(ConnectionError, match="died"):  # rank 1 never comes
        ranks[0].all_reduce(torch.ones(4), lambda: False, 30.0)


def test_a_worker_whose_model_does_not_split_leaves_nothing_behind(bundled) -> None:
    """The ranks start before rank 0 reads the model: when it does not split, rank 0 says so and stops
    them, and their folder and shared-memory segment go too."""
    import glob
    import subprocess

    def followers() -> set[str]:
        ps = subprocess.run(
            ["ps", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True, text=True
        )
        return {line.split()[0] for line in ps.stdout.splitlines() if "tp_follower" in line}

    def segments() -> set[str]:
        return set(glob.glob(f"/dev/shm/pdserve-tp-{os.getpid()}-*"))

    before = (followers(), segments())  # other tests' live TP workers
    with pytest.raises(TPLayoutError, match="TP size 2 does not split 9 query heads"):
        Engine(RuntimeConfig(device="cpu", dtype="float32", tp_size=2, max_total_tokens=4096))
    assert (followers(), segments()) == before


def _wait_reply(up, timeout: float = 120.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replies = up.poll()
        if replies:
            return replies[0]
        time.sleep(0.02)
    raise AssertionError("no reply from the weights job")


def test_live_weight_updates_reach_every_rank(tiny_folders, tmp_path) -> None:
    """A TP-2 worker's updates: every rank stages its cut of a new checkpoint (from disk, and of the
    tensors a trainer broadcasts) and swaps it in at the commit, so the worker then gives the new
    weights' tokens; a commit a rank has nothing staged for changes nothing, on any rank."""
    import shutil
    import socket
    import threading

    from safetensors.torch import load_file, save_file

    from pdserve.protocol import gateway as m
    from pdserve.runtime.weight_update import WeightUpdater
    from pdserve.runtime.weights_group import WeightsGroup

    old = tiny_folders["llama-untied"]
    new = str(tmp_path / "new")
    shutil.copytree(old, new)
    (weights,) = [f for f in os.listdir(new) if f.endswith(".safetensors")]
    tensors = load_file(os.path.join(new, weights))
    g = torch.Generator().manual_seed(7)
    changed = {
        k: v + 0.05 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in tensors.items()
    }
    save_file(changed, os.path.join(new, weights))

    def tokens(e: Engine) -> list[list[int]]:
        return [o.output_ids for o in e.generate(PROMPTS[:2], GREEDY)]

    want_new = tokens(e := _engine(new, 1))
    e.runner.close()
    tp = _engine(old, 2)
    want_old = tokens(tp)
    assert want_old != want_new
    up = WeightUpdater.for_runner(tp.runner, tp.cache, "127.0.0.1", lambda: None)
    try:
        # From disk: rank 0 stages in the background, rank 1 alongside; the commit swaps both.
        assert up.on_command(m.WeightsCommand(op_id="d", op="prepare_disk", model_path=new)) is None
        reply = _wait_reply(up)
        assert reply.ok, reply.message
        assert up.on_command(m.WeightsCommand(op_id="d", op="commit", weight_version="v2")).ok  # type: ignore[union-attr]
        assert tokens(tp) == want_new

        # Nothing staged on rank 1 for this commit: refused, and no rank changes.
        from pdserve.runtime.weight_update import Staged, stage

        up._staged = Staged("x", stage(tp.runner.model, [("model.norm.weight", torch.zeros(64))], False), 0.0)
        reply = up.on_command(m.WeightsCommand(op_id="x", op="commit", weight_version="v3"))
        assert reply is not None and not reply.ok and "TP rank 1" in reply.message
        assert up.version == "v2" and tokens(tp) == want_new

        # From a trainer's broadcast (its rank 0 here, a thread): back to the old weights, whole tensors
        # that each rank cuts.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        group = m.WeightsGroup(
            master_address="127.0.0.1", master_port=port, rank=1, world_size=2, group_name="t", backend="gloo"
        )
        trainer: list[WeightsGroup] = []
        t = threading.Thread(
            target=lambda: trainer.append(
                WeightsGroup(
                    master_address="127.0.0.1",
                    master_port=port,
                    rank=0,
                    world_size=2,
                    group_name="t",
                    backend="gloo",
                )
            )
        )
        t.start()
        assert up.on_command(m.WeightsCommand(op_id="g", op="init_group", group=group)) is None
        assert _wait_reply(up).ok
        t.join(30)
        names = sorted(tensors)
        cmd = m.WeightsCommand(
            op_id="b",
            op="prepare_distributed",
            group_name="t",
            names=names,
            dtypes=[str(tensors[n].dtype) for n in names],
            shapes=[list(tensors[n].shape) for n in names],
        )
        assert up.on_command(cmd) is None
        for n in names:
            trainer[0].broadcast(tensors[n].clone())
        reply = _wait_reply(up)
        assert reply.ok, reply.message
        assert up.on_command(m.WeightsCommand(op_id="b", op="commit", weight_version="v4")).ok  # type: ignore[union-attr]
        assert tokens(tp) == want_old
    finally:
        up.close()
        tp.runner.close()
