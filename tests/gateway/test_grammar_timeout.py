"""A constraint whose grammar takes longer than --grammar-compile-timeout to compile is a 400 naming the
flag, answered at the timeout, off the event loop; the compile's child process is killed then."""

from __future__ import annotations

import time

from .conftest import gateway_client

HEAVY = 6000  # character classes in a row: about 3 s to compile on one core here


def chain(n: int, tag: str) -> str:
    classes = " ".join(f"[a-{chr(98 + i % 24)}]" for i in range(n))
    return f'root ::= "{tag}" {classes}\n'


def test_a_slow_grammar_is_a_400_naming_the_flag(tokenizer):
    with gateway_client(tokenizer, grammar_compile_timeout_s=0.3) as c:
        c.post("/generate", json={"text": "a", "sampling_params": {"regex": "a"}})  # backend built
        t0 = time.perf_counter()
        r = c.post("/generate", json={"text": "a", "sampling_params": {"ebnf": chain(HEAVY, "gateway")}})
        waited = time.perf_counter() - t0
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "sampling_params.ebnf"
        assert "--grammar-compile-timeout" in err["message"], err["message"]
        assert waited < 2.0, f"answered after {waited:.2f} s with a 0.3 s timeout"
        assert c.app.state.gw.constraints.checker().killed == 1  # nothing of that compile goes on
        # The event loop kept serving while the compile ran.
        t0 = time.perf_counter()
        assert c.get("/health").status_code in (200, 503)
        assert time.perf_counter() - t0 < 0.5
