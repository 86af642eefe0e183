"""The child process of `GrammarChecker` (checker.py): compiles constraints to tell whether they compile.

Protocol, one JSON object a line: it reads `{"info": <xgrammar TokenizerInfo JSON>}` first and answers
`{"ready": true}`; then each `{"kind": ..., "text": ...}` is answered `{"error": null}` (it compiles)
or `{"error": "<message>"}`. The compiled grammar is dropped at once: the parent only needs the verdict,
and a compile that runs too long is ended by killing this process, which frees whatever it held.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    import xgrammar as xgr

    from pdserve.runtime.grammar.backend import InvalidGrammar, compile_constraint

    try:
        os.nice(10)  # the forwards on the same cores come first
    except OSError:
        pass
    first = json.loads(sys.stdin.readline())
    info = xgr.TokenizerInfo.deserialize_json(first["info"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_constraint(compiler, "regex", "a")  # the first compile sets up the vocabulary (~0.5 s)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        try:
            compile_constraint(compiler, ask["kind"], ask["text"])
            error = None
        except InvalidGrammar as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - a compiler fault is this constraint's error, not the child's end
            error = f"invalid {ask['kind']}: the compiler failed ({type(e).__name__})"
        print(json.dumps({"error": error}), flush=True)


if __name__ == "__main__":
    main()
