"""A load's peak memory (runtime/stream_load.py): at most the model as kept plus the float copy of its
largest tensor (here the embedding table; elsewhere a layer's fused gate and up), measured on a GGUF file big enough to tell (4 layers of SmolLM2-1.7B's
shape in Q4_K_M, random weights: a whole-model float copy would be 1.5 GB more than the bound).

The load runs in a process of its own, which resets its resident high-water mark (/proc/self/clear_refs)
after its imports (transformers' config classes among them) and the GGUF's config-and-tokenizer folder,
so the peak is the load's alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

MEASURE = r"""
import json, sys
import torch
from pdserve.model_source import resolve_model_source
from pdserve.runtime import gguf_folder
from pdserve.runtime.loader import load_model

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

folder = gguf_folder.meta_folder(resolve_model_source(sys.argv[1]))
from pdserve.runtime.loader import load_hf_config
load_hf_config(folder)  # transformers' config classes imported (~80 MB of code, not the load's)
from pdserve.kernels import cpu_library
cpu_library.load()  # the kernels built (or found built) before the measured part
with open(sys.argv[1], "rb") as f:
    while f.read(1 << 24):  # the file in the page cache, as a restart finds it
        pass
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark starts again from here
base = status("VmRSS")
loaded = load_model(sys.argv[1], "float32", "cpu", "w4a16", "off")
peak = status("VmHWM")
seen, size = set(), 0
for t in [*loaded.model.parameters(), *loaded.model.buffers()]:
    key = t.untyped_storage().data_ptr()
    if key not in seen:
        seen.add(key)
        size += t.untyped_storage().nbytes()
print(json.dumps({"base": base, "peak": peak, "model": size}))
"""


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> str:
    from pdserve.bench.model_shapes import SHAPES
    from pdserve.bench.model_writer import write_gguf

    shape = dataclasses.replace(SHAPES["smollm2-1.7b"], layers=4)
    return write_gguf(str(tmp_path_factory.mktemp("gguf") / "m.gguf"), shape, "q4_k_m")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cache", ["0", "1"], ids=["built", "built-stored-and-mapped"])
def test_a_load_peaks_at_the_model_plus_one_projection(gguf_file, tmp_path, cache) -> None:
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path), "PDSERVE_QUANT_CACHE": cache}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, gguf_file],
        env=env,
        cwd=tmp_path,  # the checkout's top-level folders would shadow the installed packages
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    # the largest float copy a load makes: the embedding table (49152 x 2048, float32), which the
    # int8 head is rounded from; a layer's gate and up together are 2 x 8192 x 2048
    largest_part = 49152 * 2048 * 4
    slack = 96 << 20  # allocator pages, the reader's index, one layer's small tensors
    grew = m["peak"] - m["base"]
    assert grew <= m["model"] + largest_part + slack, m
    assert m["model"] > 200 << 20, m  # big enough for a whole-model float copy to show (1.5 GB)
