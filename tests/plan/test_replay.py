"""`pdserve plan --replay`: a bench goodput run's own requests through the simulator."""

from __future__ import annotations

import json
import subprocess

import pytest

from pdserve.launch.supervisor import pdserve_command
from pdserve.plan.goodput import Capacity
from pdserve.plan.profile import Profile
from pdserve.plan.replay import (
    ReplayError,
    compare_capacity,
    fit_efficiency,
    fit_runs,
    load_many,
    load_runs,
    parse_split,
    predict,
)
from pdserve.plan.simulate import Arrival, simulate

pytestmark = pytest.mark.timeout(120)


def _profile(**kw) -> Profile:
    """Prefill 1 ms a token, a decode step 20 ms at any batch, a free hand-off."""
    base = dict(
        host="test", model="m", dtype="float32", quantization="none", threads=1,
        prefill_tokens=[1, 1000], prefill_s=[0.001, 1.0], decode_batch=[1, 64], decode_context=[1, 4096],
        decode_s=[[0.02, 0.02], [0.02, 0.02]], transfer_s_per_token=0.0,
    )  # fmt: skip
    return Profile(**{**base, **kw})


def _request(at: float, prompt: int, out: int, ttft: float, e2e: float, ok: bool = True) -> dict:
    return {"sent_at": at, "prompt_tokens": prompt, "max_tokens": out, "output_tokens": out if ok else 0,
            "ok": ok, "ttft": ttft, "e2e": e2e}  # fmt: skip


def _bench_json(path, results: dict, **config) -> str:
    doc = {"config": {"ttft_slo": 1.0, "tpot_slo": 0.05, "launch_pdserve": True, "pdserve_args": "",
                      "launch_pdserve_variant": [], **config}, "results": results}  # fmt: skip
    path.write_text(json.dumps(doc))
    return str(path)


def _row(rate: float, reqs: list[dict], goodput: float, attainment: float) -> dict:
    return {"rate": rate, "goodput": goodput, "attainment": attainment, "per_request": reqs}


def test_one_request_replays_to_the_hand_computed_times(tmp_path) -> None:
    # Sent 5 s into the run (the replay starts the clock at the first request): 200 prompt tokens prefill
    # in 0.2 s (the first token), then 3 more tokens at 20 ms a step.
    reqs = [_request(5.0, 200, 4, 0.25, 0.33)]
    path = _bench_json(tmp_path / "b.json", {"pdserve": [_row(1.0, reqs, 1 / 0.33, 1.0)]})
    _, (run,), skipped = load_runs(path)
    assert skipped == [] and (run.prefill, run.decode, run.arrivals) == (1, 1, [Arrival(0.0, 200, 4)])
    (o,) = predict(_profile(), run)
    assert o.ttft == pytest.approx(0.2) and o.done == pytest.approx(0.26)


def test_splits_come_from_the_launch_flags_and_elastic_or_foreign_servers_are_left_out(tmp_path) -> None:
    reqs = [_request(0.0, 100, 2, 0.1, 0.2)]
    rows = [_row(1.0, reqs, 1.0, 1.0)]
    results = {"pdserve": rows, "2p1d": rows, "el": rows, "llama-server": rows, "server": rows}
    variants = ["2p1d=--num-prefill 2", "el=--num-decode 2 --elastic --elastic-ttft-slo 2"]
    path = _bench_json(
        tmp_path / "b.json", results, launch_pdserve_variant=variants, pdserve_args="--num-decode 2"
    )
    _, runs, skipped = load_runs(path, dict([parse_split("server=3p1d")]))
    assert [(r.server, r.split) for r in runs] == [("pdserve", "1P2D"), ("2p1d", "2P2D"), ("server", "3P1D")]
    assert [s.split(":")[0] for s in skipped] == ["el", "llama-server"]
    with pytest.raises(ReplayError, match="NAME=PxD"):
        parse_split("server=1x1")
    (tmp_path / "old.json").write_text(json.dumps({"config": {"launch_pdserve": True, "ttft_slo": 1, "tpot_slo": 1}, "results": {
        "pdserve": [{"rate": 1.0, "goodput": 1.0, "attainment": 1.0}]}}))  # fmt: skip
    with pytest.raises(ReplayError, match="carry no requests"):
        load_runs(str(tmp_path / "old.json"))


def test_the_fit_recovers_the_efficiency_that_made_the_measurement(tmp_path) -> None:
    # Overlapping requests (prefill and decode forwards share the host): the "measured" times are the
    # simulator's at e = 0.55; the fit over those requests finds it again.
    arrivals = [Arrival(0.15 * i, 300 + 40 * (i % 5), 6 + i % 4) for i in range(16)]
    truth = _profile(sharing="turns", layers=4, offer_min_tokens=256, shared_efficiency=0.55)
    outs = simulate(truth, 1, 1, arrivals)
    reqs = [
        _request(a.at + 2.0, a.prompt, a.output, o.ttft, o.done - o.arrival) for a, o in zip(arrivals, outs)
    ]
    path = _bench_json(tmp_path / "b.json", {"pdserve": [_row(4.0, reqs, 1.0, 0.5)]})
    _, (run,), _ = load_runs(path)
    guess = _profile(sharing="turns", layers=4, offer_min_tokens=256)
    assert fit_efficiency(guess, run) == pytest.approx(0.55, abs=0.01)
    # Through the CLI: the refitted profile saved for the searches to come.
    guess.shared_efficiency = 1.0
    guess.save(str(tmp_path / "guess.json"))
    cmd = ["plan", "--profile", str(tmp_path / "guess.json"), "--replay", path]
    out = subprocess.run(pdserve_command(*cmd, "--replay-fit", "pdserve@4", "--profile-out", str(tmp_path / "fit.json")),
                         capture_output=True, text=True, timeout=100)  # fmt: skip
    assert out.returncode == 0, out.stderr
    fitted = Profile.load(str(tmp_path / "fit.json"))
    assert fitted.shared_efficiency == pytest.approx(0.55, abs=0.01)
    assert fitted.notes[-1].startswith("shared_efficiency fitted to pdserve@4 of b.json")
    bad = subprocess.run(pdserve_command(*cmd, "--profile-out", str(tmp_path / "x.json")),
                         capture_output=True, text=True, timeout=100)  # fmt: skip
    assert bad.returncode == 2 and "give both" in bad.stderr
    # No request succeeded: nothing to fit to.
    failed = [dict(r, ok=False) for r in reqs]
    _, (run,), _ = load_runs(_bench_json(tmp_path / "f.json", {"pdserve": [_row(4.0, failed, 0.0, 0.0)]}))
    with pytest.raises(ReplayError, match="no request succeeded"):
        fit_efficiency(guess, run)


def test_a_pooled_fit_weighs_every_run_and_names_what_it_fitted(tmp_path) -> None:
    # Two rates "measured" at different efficiencies (a noisy host): fitted alone, each finds its own;
    # pooled (pdserve@* or both named), one efficiency between them, weighted by the requests' times.
    truth = {0.5: 0.45, 0.8: 0.7}
    rows = []
    for k, (rate, e) in enumerate(truth.items()):
        arrivals = [Arrival(i / (rate * 4), 300 + 40 * (i % 5), 6 + i % 4) for i in range(16 + k)]
        outs = simulate(_profile(sharing="turns", layers=4, shared_efficiency=e), 1, 1, arrivals)
        reqs = [
            _request(a.at, a.prompt, a.output, o.ttft, o.done - o.arrival) for a, o in zip(arrivals, outs)
        ]
        rows.append(_row(rate, reqs, 1.0, 1.0))
    path = _bench_json(tmp_path / "b.json", {"pdserve": rows})
    _, runs, _ = load_runs(path)
    guess = _profile(sharing="turns", layers=4)
    alone = {run.rate: fit_efficiency(guess, run) for run in runs}
    assert alone == {r: pytest.approx(e, abs=0.01) for r, e in truth.items()}
    assert fit_runs(runs, "pdserve@*") == runs and fit_runs(runs, "pdserve@0.8, pdserve@0.5") == runs[::-1]
    pooled = fit_efficiency(guess, runs)
    assert 0.46 < pooled < 0.69
    with pytest.raises(
        ReplayError, match=r"pdserve@1: no such run \(the runs are pdserve@0.5, pdserve@0.8\)"
    ):
        fit_runs(runs, "pdserve@0.5,pdserve@1")
    guess.save(str(tmp_path / "guess.json"))
    out = subprocess.run(pdserve_command("plan", "--profile", str(tmp_path / "guess.json"), "--replay", path,
                                         "--replay-fit", "pdserve@*"),
                         capture_output=True, text=True, timeout=100)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"shared efficiency fitted to pdserve@0.5, pdserve@0.8 (2 runs pooled): {pooled:g}" in out.stdout


def test_the_cli_prints_predicted_against_measured(tmp_path) -> None:
    profile = tmp_path / "p.json"
    _profile().save(str(profile))
    # Two requests, the second 1 s later: each alone, 0.2 s to the first token and 0.26 s to the last.
    reqs = [_request(0.0, 200, 4, 0.25, 0.33), _request(1.0, 200, 4, 0.3, 2.0)]
    path = _bench_json(tmp_path / "b.json", {"pdserve": [_row(1.0, reqs, 0.5, 0.5)]})

    def plan(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(pdserve_command("plan", "--profile", str(profile), *args),
                              capture_output=True, text=True, timeout=100)  # fmt: skip

    out = plan("--replay", path)
    assert out.returncode == 0, out.stderr
    assert "targets (the run's): TTFT 1 s, TPOT 0.05 s" in out.stdout
    (row,) = [line.split() for line in out.stdout.splitlines() if line.split()[:2] == ["pdserve", "1P1D"]]
    # Predicted: both within the targets over 1.26 s (1.59 req/s) against the measured 0.5: +217%.
    assert row[3:8] == ["0.50", "(50%)", "1.59", "(100%)", "+217%"], row
    # Requests that never overlap cannot tell an efficiency: the fit says so instead of returning a bound.
    bad = plan("--replay", path, "--replay-fit", "pdserve@1")
    assert bad.returncode == 2 and "at any shared efficiency" in bad.stderr, bad.stderr
    bad = plan("--replay", path, "--replay-fit", "pdserve@2")
    assert bad.returncode == 2 and "no such run (the runs are pdserve@1)" in bad.stderr
    bad = plan("--replay", str(tmp_path / "missing.json"))
    assert bad.returncode == 2 and "not a bench goodput JSON" in bad.stderr
    no_targets = _bench_json(tmp_path / "n.json", {"pdserve": [_row(1.0, reqs, 0.5, 0.5)]}, ttft_slo=None)
    bad = plan("--replay", no_targets)
    assert bad.returncode == 2 and "not a bench goodput JSON" in bad.stderr, bad.stderr


def test_capacity_measured_and_predicted_from_the_same_rates(capsys) -> None:
    def row(server: str, rate: float, measured: float, predicted: float) -> dict:
        return {"server": server, "split": "1P1D", "rate": rate, "measured_attainment": measured,
                "predicted_attainment": predicted}  # fmt: skip

    rows = [row("pdserve", 0.5, 1.0, 1.0), row("pdserve", 1.0, 0.8, 0.95), row("pdserve", 1.5, 0.2, 0.5),
            row("once", 1.0, 1.0, 1.0)]  # fmt: skip
    caps = compare_capacity(rows, 0.9)
    # Measured: 90% crossed half way from 0.5/s (100%) to 1/s (80%); predicted: from 1/s (95%) to 1.5/s
    # (50%), a ninth of the way. A server run at one rate has no capacity to tell.
    assert caps == {"pdserve 1P1D": (Capacity(pytest.approx(0.75)), Capacity(pytest.approx(1 + 0.5 / 9)))}
    out = capsys.readouterr().out
    assert "highest rate with 90% of requests within both targets" in out
    assert out.splitlines()[-1].split() == ["pdserve", "1P1D", "0.75", "1.06", "+41%"]


def test_a_sweep_run_in_parts_replays_as_one_and_a_rerun_replaces_its_rate(tmp_path) -> None:
    one = [_request(0.0, 100, 2, 0.1, 0.2)]
    two = [_request(0.0, 100, 2, 0.1, 0.2), _request(0.5, 100, 2, 0.1, 0.2)]
    first = _bench_json(
        tmp_path / "a.json", {"pdserve": [_row(0.5, one, 0.5, 0.5), _row(1.0, one, 1.0, 1.0)]}
    )
    rerun = _bench_json(tmp_path / "b.json", {"pdserve": [_row(0.5, two, 0.9, 1.0)]})
    config, runs, skipped = load_many([first, rerun])
    assert skipped == [] and config["ttft_slo"] == 1.0
    assert [(r.rate, len(r.arrivals), r.measured["attainment"]) for r in runs] == [
        (1.0, 1, 1.0),
        (0.5, 2, 1.0),
    ]
    other = _bench_json(tmp_path / "c.json", {"pdserve": [_row(2.0, one, 1.0, 1.0)]}, tpot_slo=0.2)
    with pytest.raises(ReplayError, match="differ from the first file's"):
        load_many([first, other])
