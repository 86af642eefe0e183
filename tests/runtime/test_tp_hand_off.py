"""The prefill loop's `runner.hand_off` (runtime/tensor_parallel.py): at TP 1 it does nothing (the pool
is what transfers read); a TP worker whose ranks' pools are not shared gathers their heads on the loop's
thread; once they are shared it leaves the gather to the sender's `prepare` (`before_send`)."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import RuntimeConfig
from pdserve.runtime.batch import ForwardMode
from pdserve.runtime.request import Request
from pdserve.runtime.runner import ModelRunner
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 17, 99, 3, 42, 8] * 5


def _prefilled(folder: str, tp: int) -> tuple[ModelRunner, list[int]]:
    runner = ModelRunner(
        RuntimeConfig(model_path=folder, device="cpu", dtype="float32", max_total_tokens=1024, tp_size=tp)
    )
    req = Request("r", PROMPT, SamplingParams(max_new_tokens=1))
    assert runner.reserve(req, len(PROMPT))
    runner.forward(ForwardMode.EXTEND, [req], [PROMPT])
    return runner, req.pages


def test_hand_off_gathers_only_where_the_group_must(tiny_folders, tmp_path) -> None:
    one, pages = _prefilled(tiny_folders["llama-untied"], 1)
    two, pages2 = _prefilled(tiny_folders["llama-untied"], 2)
    try:
        assert pages == pages2 and one.transfer_kv is one.pool.kv
        want = one.pool.kv[pages].clone()
        one.hand_off(pages)
        assert torch.equal(one.pool.kv[pages], want)
        assert one.tp.share_rank_pools(lambda: pytest.fail("a single process shares nothing")) == []

        two.hand_off(pages)  # not shared: over the group, now
        torch.testing.assert_close(two.transfer_kv[pages], want, atol=1e-5, rtol=1e-5)
        assert len(two.share_pools(str(tmp_path))) == 2 and two.rank_kv is not None
        two.transfer_kv[pages] = 0
        two.hand_off(pages)  # shared: the sender gathers per room as it goes
        assert not two.transfer_kv[pages].any()
        two.before_send(pages)
        torch.testing.assert_close(two.transfer_kv[pages], want, atol=1e-5, rtol=1e-5)
    finally:
        one.close()
        two.close()
