"""Staging new weights against the bundled model: names map onto fused parameters, shapes are checked,
a whole checkpoint must cover every parameter, and a commit changes exactly what was sent."""

from __future__ import annotations

import pytest
import torch

from pdserve.model_source import resolve_model_source
from pdserve.protocol import gateway as m
from pdserve.runtime.loader import iter_weights, load_model, model_folder
from pdserve.runtime.weight_update import Staged, WeightUpdateError, WeightUpdater, stage


def float_folder() -> str:
    """The bundled GGUF dequantized into safetensors: a checkpoint a weight update can read."""
    return model_folder(resolve_model_source(None))


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, "float32")


@pytest.fixture(scope="module")
def checkpoint(loaded):
    return dict(iter_weights(float_folder()))


def test_stage_refuses_wrong_shapes_unknown_names_and_incomplete_checkpoints(loaded, checkpoint):
    model = loaded.model
    with pytest.raises(WeightUpdateError, match="shape"):
        stage(model, [("model.norm.weight", torch.ones(7))], require_all=False)
    with pytest.raises(WeightUpdateError, match="no place"):
        stage(model, [("model.layers.99.mlp.up_proj.weight", torch.ones(1))], require_all=False)
    partial = {k: v for k, v in checkpoint.items() if k != "model.layers.0.mlp.up_proj.weight"}
    with pytest.raises(WeightUpdateError, match="lacks 1"):
        stage(model, partial.items(), require_all=True)


def test_commit_changes_exactly_the_tensors_sent(loaded, checkpoint):
    model = loaded.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    s = loaded.spec
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    new_k = checkpoint["model.layers.3.self_attn.k_proj.weight"] + 1
    new_norm = checkpoint["model.norm.weight"] * 2
    commits: list[int] = []
    up = WeightUpdater(model, s, None, "127.0.0.1", lambda: commits.append(1))
    # A subset, as a trainer's broadcast may be: one fused shard (copied) and one whole tensor (swapped).
    copies = stage(
        model, [("model.layers.3.self_attn.k_proj.weight", new_k), ("model.norm.weight", new_norm)], False
    )
    up._staged = Staged("op", copies, 0.0)
    reply = up.on_command(m.WeightsCommand(op_id="op", op="commit", weight_version="v2"))
    assert reply is not None and reply.ok and reply.weight_version == "v2" and commits == [1]
    after = model.state_dict()
    qkv = "model.layers.3.self_attn.qkv_proj.weight"
    assert torch.equal(after["model.norm.weight"], new_norm)
    assert torch.equal(after[qkv][q : q + kv], new_k)
    assert torch.equal(after[qkv][:q], before[qkv][:q]) and torch.equal(
        after[qkv][q + kv :], before[qkv][q + kv :]
    )
    assert all(torch.equal(after[k], before[k]) for k in before if k not in (qkv, "model.norm.weight"))
    # A commit with nothing prepared under its id changes nothing.
    reply = up.on_command(m.WeightsCommand(op_id="other", op="commit", weight_version="v3"))
    assert reply is not None and not reply.ok and up.version == "v2"
    # Back to the checkpoint, whole: fused shards assembled off the loop and swapped in.
    whole = stage(model, checkpoint.items(), require_all=True)
    assert all(rows is None for _, rows, _ in whole)
    up._staged = Staged("back", whole, 0.0)
    assert up.on_command(m.WeightsCommand(op_id="back", op="commit", weight_version="v1")).ok  # type: ignore[union-attr]
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    up.close()


def test_a_quantized_worker_refuses_updates_before_loading_anything(loaded):
    up = WeightUpdater(loaded.model, loaded.spec, None, "127.0.0.1", lambda: None, quantization="w4a16")
    for op in ("prepare_disk", "prepare_distributed"):
        reply = up.on_command(m.WeightsCommand(op_id=op, op=op, model_path=float_folder()))
        assert reply is not None and not reply.ok and "--quantization w4a16" in reply.message
    assert up.version == "default" and up._staged is None and not up._jobs
    up.close()


def test_a_worker_updater_reads_the_resolved_quantization(loaded):
    """The config says `auto`; the updater goes by what was loaded: the fp32 reference accepts updates,
    the default (the GGUF's own int4) refuses them."""
    from pdserve.config import RuntimeConfig
    from pdserve.runtime.runner import ModelRunner

    fp32 = ModelRunner(RuntimeConfig(device="cpu", max_total_tokens=256), loaded)
    assert fp32.cfg.quantization == "auto"
    reference = WeightUpdater.for_runner(fp32, None, "127.0.0.1", lambda: None)
    assert reference.quantization == "none"
    reference.close()
    default = ModelRunner(RuntimeConfig(device="cpu", max_total_tokens=256))
    up = WeightUpdater.for_runner(default, None, "127.0.0.1", lambda: None)
    mode = default.loaded.quantization
    assert mode in ("w4a16", "w4a8") and up.quantization == mode  # w4a8 where int4 multiplies in fp32
    reply = up.on_command(m.WeightsCommand(op_id="d", op="prepare_disk", model_path=float_folder()))
    assert reply is not None and not reply.ok and f"--quantization {mode}" in reply.message
    up.close()
