"""Progress off a terminal: plain lines at the start, along the way (throttled) and at the end."""

from __future__ import annotations

from pdserve import progress as pr


def test_plain_lines_off_a_terminal(monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(pr, "on_terminal", lambda: False)
    assert list(pr.progress(range(50), 50, "loading", lines.append, unit="tensors")) == list(range(50))
    assert lines[0] == "loading: started (50 tensors)"
    assert lines[-1].startswith("loading: done, 50 tensors in ")
    assert len(lines) == 2  # a fast loop: no line in between (at most one every 2 s)
    c = pr.Counter(4, "bench", lines.append)
    for _ in range(4):
        c.update()
    c.close()
    assert c.n == 4 and len(lines) == 2
