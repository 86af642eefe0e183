"""`pdserve bench engine`'s matmul floor times every projection, plain or quantized: under
`--quantization` the projections are no longer nn.Linear, and a floor that looked for those alone timed
the LM head only (a floor far above anything reachable)."""

from __future__ import annotations

import pytest

from pdserve.bench.bench_engine import _matmul_stack_seconds, weight_projections
from pdserve.runtime.loader import load_model


@pytest.mark.parametrize("quantization", ["none", "w4a16"])
def test_floor_counts_every_projection(tiny_folders, quantization) -> None:
    folder = next(iter(tiny_folders.values()))
    loaded = load_model(folder, "bfloat16", "cpu", quantization)
    assert loaded.quantization == quantization
    projections = weight_projections(loaded.model)
    # q/k/v and gate/up are fused: four projections a layer
    assert len(projections) == 4 * loaded.spec.num_layers
    assert _matmul_stack_seconds(loaded.model, 4, 4, loaded.dtype, "cpu", reps=1) > 0
