"""Incremental detokenization and stop strings, on the bundled tokenizer and real text."""

from __future__ import annotations

import os

import pytest

from pdserve.gateway.text.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "The capital of France is Paris. Ça va? Naïve café — “quotes” …",
    "日本語のテキストと中文混合, 한국어도 있어요. Emoji: 🚀🔥👍🏽 and 🇫🇷 flags.",
    "Code:\n\tdef f(x):\n\t\treturn x ** 2  # ünïcödé\n\n\n  spaces   here",
]


def _stream(tokenizer, prompt_ids: list[int], ids: list[int]) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t), prompt_ids)
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    return pieces, "".join(pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Say something:")
    ids = tokenizer.encode(text)
    pieces, streamed = _stream(tokenizer, prompt, ids)
    assert streamed == tokenizer.decode(ids)
    # Multi-byte characters span several byte-level tokens: no piece may show half of one.
    assert all("\ufffd" not in p for p in pieces)


def test_multibyte_split_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1  # the emoji needs several byte tokens, or this test proves nothing
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t), tokenizer.encode("Go"))
    out = [detok.add(t) for t in ids]
    assert out[:-1] == [""] * (len(ids) - 1)
    assert out[-1] == "🚀"


def test_incomplete_character_flushes_as_replacement(tokenizer):
    ids = tokenizer.encode("🚀")[:-1]
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t), [])
    assert "".join(detok.add(t) for t in ids) == ""
    assert detok.flush() == tokenizer.decode(ids)


def test_special_tokens_skipped(tokenizer):
    ids = tokenizer.encode("Hello") + [tokenizer.eos_token_id]
    _, streamed = _stream(tokenizer, [], ids)
    assert streamed == "Hello"


# ---- stop strings ------------------------------------------------------------------------------


def _feed_chars(m: StopStringMatcher, text: str, step: int) -> str:
    out = ""
    for i in range(0, len(text), step):
        out += m.feed(text[i : i + step])
        if m.matched is not None:
            return out
    return out + m.finish()


@pytest.mark.parametrize("step", [1, 2, 3, 7, 100])
def test_stop_string_cuts_before_match(step):
    m = StopStringMatcher(["\n\n", "END"])
    out = _feed_chars(m, "first line\nsecond END third\n\nmore", step)
    assert out == "first line\nsecond "
    assert m.matched == "END"


@pytest.mark.parametrize("step", [1, 2, 5])
def test_earliest_stop_wins(step):
    m = StopStringMatcher(["cd", "bcx", "b"])
    assert _feed_chars(m, "aabcdx", step) == "aa"
    assert m.matched == "b"


def test_hold_back_only_possible_prefixes():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "  # "ST" could start STOP
    assert m.feed("x") == "STx"  # no longer can
    assert m.feed("S") == ""
    assert m.feed("TOP tail") == ""
    assert m.matched == "STOP"
    assert m.text == "abc STx"


def test_no_stop_strings_release_everything():
    m = StopStringMatcher([])
    assert m.feed("abc") == "abc"
    assert m.finish() == ""


def test_held_text_released_at_finish():
    m = StopStringMatcher(["</end>"])
    assert m.feed("value </e") == "value "
    assert m.finish() == "</e"
    assert m.matched is None


def test_stop_on_real_tokens(tokenizer):
    text = "One. Two. Three. Four."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t), [])
    m = StopStringMatcher(["Three"])
    out, used = "", 0
    for t in ids:
        used += 1
        out += m.feed(detok.add(t))
        if m.matched:
            break
    assert out == "One. Two. "
    assert tokenizer.decode(ids[:used]).endswith("Three")


def test_cached_tokenizer_matches_gguf_build(tmp_path, monkeypatch, tokenizer):
    from pdserve.gateway.text.tokenizer import Tokenizer

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    built = Tokenizer.load(None)  # from GGUF metadata, then saved
    assert any(tmp_path.rglob("tokenizer_config.json"))
    cached = Tokenizer.load(None)  # from the saved copy
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[1]}]
    assert cached.encode_chat(msgs) == built.encode_chat(msgs)
    for t in TEXTS:
        assert cached.encode(t) == built.encode(t)
        assert cached.decode(built.encode(t)) == t
    assert (cached.vocab_size, cached.eos_token_id) == (built.vocab_size, built.eos_token_id)


@pytest.mark.timeout(120)
def test_a_fresh_process_loads_the_tokenizer_without_torch(tmp_path, tokenizer):
    """A process without torch (the gateway's) builds a missing cache entry in a child process and loads
    the saved copy without importing torch; the tokens are the same as with torch."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys; from pdserve.gateway.text.tokenizer import Tokenizer; t = Tokenizer.load(None); "
        "print(json.dumps(['torch' in sys.modules, [t.encode(x) for x in sys.argv[1:]]]))"
    )
    for _ in ("cold", "warm"):
        out = subprocess.run(
            [sys.executable, "-P", "-c", code, *TEXTS],
            env={**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=110,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        torch_loaded, ids = json.loads(out.stdout.splitlines()[-1])
        assert not torch_loaded
        assert ids == [tokenizer.encode(t) for t in TEXTS]
        assert any(tmp_path.rglob("tokenizer_config.json"))


def _reference_stop(stops: list[str], text: str) -> tuple[str, str | None]:
    """Char by char: the first stop string to complete (the longest of those completing together)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            hit = max(done, key=len)
            return text[: end - len(hit)], hit
    return text, None


@pytest.mark.parametrize("seed", range(8))
def test_stop_matcher_agrees_with_a_char_by_char_reference(seed):
    """Random stop strings over a small alphabet (overlaps and self-overlaps are common), random feed
    sizes: the released text and the match are the reference's, however the text is split."""
    import random

    rng = random.Random(seed)
    for _ in range(200):
        stops = [
            "".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))
        ]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        want_text, want_hit = _reference_stop(stops, text)
        m = StopStringMatcher(stops)
        got, i = "", 0
        while i < len(text) and m.matched is None:
            step = rng.randint(1, 6)
            got += m.feed(text[i : i + step])
            assert want_text.startswith(got), (stops, text, got)
            i += step
        got += m.finish()
        assert (got, m.matched) == (want_text, want_hit), (stops, text)


def test_keep_stop_ends_after_the_match():
    m = StopStringMatcher(["END"], keep_stop=True)
    assert m.feed("abc EN") == "abc "
    assert m.feed("D more") == "END"
    assert m.text == "abc END" and m.matched == "END"


def test_long_stop_strings_cost_linear_time():
    """16 stop strings of 1,024 characters that almost match everywhere: the characters of the stop
    strings the matcher reads stay within a small multiple of (text + stop strings) x their number
    (counted, not timed; searching every suffix on every feed would read ~10^9 here)."""

    class Counted(str):
        reads = 0

        def __getitem__(self, i):  # type: ignore[override]
            Counted.reads += 1
            return str.__getitem__(self, i)

    stops = [Counted("a" * 1023 + chr(ord("b") + i)) for i in range(16)]
    m = StopStringMatcher(stops)
    text = "a" * 20_000
    released = "".join(m.feed(text[i : i + 4]) for i in range(0, len(text), 4))
    assert released == "a" * (20_000 - 1023)  # the last 1,023 could still start a stop string
    assert Counted.reads < 4 * (len(text) + 1024) * len(stops), Counted.reads
    assert m.finish() == "a" * 1023
