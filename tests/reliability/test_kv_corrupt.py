"""No client receives a token computed from corrupted KV (kv_transfer/checksum.py), with real processes
and the bundled model.

prefill-0 flips a bit of a page of each of its first hand-offs after hashing it (--test-corrupt-kv). Its
pages reach decode-2 over the pair group (a bad wire: decode-2 maps no segment) and decode-3 through its
shared-memory segment (a bad segment write, or a page reused before the decode copied it). The decode
worker catches each on arrival and fails the room as `kv_corrupt` without decoding from it; the gateway
runs the request again on the other pair (prefill-1 is clean): every client gets the greedy answer of an
untouched run.
"""

from __future__ import annotations

import pytest
from harness import start_roles
from reliability.calls import GATEWAY_FLAGS, WORKER_FLAGS, body, generate, metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

CORRUPT = "pdserve_kv_corrupt_total"
MISMATCH = "KV checksum mismatch"


def _prompt(i: int) -> str:
    return f"Question {i}: name {i + 2} rivers of Europe and the countries they cross, in order of length."


def test_every_corrupted_hand_off_is_caught_and_run_again(tmp_path):
    # Round-robin routing (ties alternate, retries included) makes the pairs below deterministic.
    rr = ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"]
    c = start_roles(
        tmp_path,
        [
            ("prefill", {}, [*WORKER_FLAGS, "--test-corrupt-kv", "2"]),
            ("prefill", {}, WORKER_FLAGS),
            ("decode", {}, [*WORKER_FLAGS, "--kv-transport", "dist"]),
            ("decode", {}, WORKER_FLAGS),
        ],
        gateway_flags=[*GATEWAY_FLAGS, *rr],
    )

    def caught(decode: int) -> int:
        with open(f"{c.log_dir}/decode-{decode}.log") as f:
            return f.read().count(MISMATCH)

    def ask(i: int, n: int = 8):
        return generate(c.url, body(n, text=_prompt(i)), 120)

    try:
        c.wait_healthy(workers=4)
        outs = {0: ask(0)}  # prefill-0 -> decode-2, corrupt on the pair group; again on prefill-1 -> decode-3
        assert caught(2) == 1 and caught(3) == 0
        assert ask(1, 1).ok  # prefill only (prefill-0): moves the prefill turn by one
        outs[2] = ask(2)  # prefill-1 -> decode-2: clean
        outs[3] = ask(3)  # prefill-0 -> decode-3, corrupt in shared memory; again on prefill-1 -> decode-2
        assert (caught(2), caught(3)) == (1, 1)
        assert metric(c.url, CORRUPT) == 2
        for i, o in outs.items():  # prefill-0's hook is spent: the same prompts again, untouched
            assert o.ok, o.error
            again = ask(i)
            assert again.ok and o.output_ids == again.output_ids, (i, o.output_ids, again.output_ids)
        assert metric(c.url, CORRUPT) == 2
    finally:
        c.stop()
