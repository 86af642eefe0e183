"""The gateway's grammar checker: verdicts from child processes, a compile past the timeout ended by
killing its child (nothing of it goes on), a fresh child for the next check."""

from __future__ import annotations

import os

import pytest

from pdserve.gateway.text.tokenizer import Tokenizer
from pdserve.runtime.grammar.backend import CompileTimeout, InvalidGrammar, tokenizer_info
from pdserve.runtime.grammar.checker import GrammarChecker


def chain(n: int) -> str:
    """An EBNF of `n` character classes in a row: about 0.5 ms a class to compile on one core."""
    return "root ::= " + " ".join(f"[a-{chr(98 + i % 24)}]" for i in range(n)) + "\n"


@pytest.fixture(scope="module")
def info_json() -> str:
    tok = Tokenizer.load(None)
    return str(tokenizer_info(tok.hf, tok.vocab_size, [tok.eos_token_id or 0]).serialize_json())


def test_verdicts_and_a_killed_compile(info_json):
    checker = GrammarChecker(info_json, timeout_s=0.5, processes=1)
    try:
        checker.check("regex", "(19|20)[0-9]{2}")
        checker.check("json_schema", '{"type": "object"}')
        with pytest.raises(InvalidGrammar, match="invalid regex"):
            checker.check("regex", "(unclosed")
        with pytest.raises(InvalidGrammar, match="not valid JSON"):
            checker.check("json_schema", "{nope")
        (child,) = checker._idle
        pid = child.proc.pid
        with pytest.raises(CompileTimeout, match="--grammar-compile-timeout"):
            checker.check("ebnf", chain(20_000))  # ~10 s of compiling
        assert checker.killed == 1
        with pytest.raises(ProcessLookupError):  # killed and reaped: the compile does not go on
            os.kill(pid, 0)
        # The next check gets the replacement and is answered; a repeated verdict comes from the cache.
        checker.check("regex", "[a-z]+")
        with pytest.raises(InvalidGrammar, match="invalid regex"):
            checker.check("regex", "(unclosed")
        assert checker.killed == 1
    finally:
        checker.close()
    assert not checker._idle


def test_a_dead_child_is_replaced(info_json):
    checker = GrammarChecker(info_json, timeout_s=5.0, processes=1)
    try:
        checker.check("regex", "a+")
        (child,) = checker._idle
        child.proc.kill()
        child.proc.wait()
        checker.check("regex", "b+")  # a new child answers
        (fresh,) = checker._idle
        assert fresh.proc.pid != child.proc.pid
    finally:
        checker.close()
