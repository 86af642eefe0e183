"""A trainer process for tests/cluster/test_weight_update.py: rank 0 of a weights group over gloo.

argv: master_port folder name...; joins the group (world size 3: itself and two workers), reads the
bundled model's tensors `name...`, prints "joined", broadcasts them once a line arrives on stdin, prints
"done"."""

from __future__ import annotations

import os
import sys

from safetensors import safe_open

from pdserve.runtime.weights_group import WeightsGroup


def main() -> None:
    port, folder, names = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        tensors = [f.get_tensor(n).float().contiguous() for n in names]
    g = WeightsGroup(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=3, group_name="wg", backend="gloo"
    )
    print("joined", flush=True)
    sys.stdin.readline()
    for t in tensors:
        g.broadcast(t)
    print("done", flush=True)
    g.close()


if __name__ == "__main__":
    main()
