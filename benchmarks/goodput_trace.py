"""`pdserve bench goodput --trace FILE`: a recorded trace's arrivals and lengths, replayed.

Two public formats are read, by the file's suffix:
- JSON lines (`.jsonl`), Mooncake's trace: one request a line, `timestamp` (milliseconds),
  `input_length` and `output_length` (tokens); other fields (`hash_ids`) are ignored;
- CSV (`.csv`), the Azure LLM inference trace (Splitwise, DistServe): `TIMESTAMP` (a date and time, or
  seconds), `ContextTokens`, `GeneratedTokens`.

A replay keeps the trace's shape (its bursts and gaps, its lengths in order) and scales its clock so that
the mean arrival rate is the one asked for: each of `--rates` replays the same rows, faster or slower.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float  # from the trace's first request
    input_len: int
    output_len: int


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file, the line and the problem."""


def _positive_int(value: object, what: str, where: str) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        raise TraceError(f"{where}: {what} {value!r} is not a whole number") from None
    if n < 1:
        raise TraceError(f"{where}: {what} must be >= 1, got {n}")
    return n


def _seconds(stamp: str, where: str) -> float:
    """Seconds from a number, or from a date and time (the Azure trace's, with up to 7 fraction digits)."""
    text = stamp.strip()
    try:
        return float(text)
    except ValueError:
        pass
    head, _, frac = text.partition(".")
    try:
        t = datetime.fromisoformat(head).timestamp()
    except ValueError:
        raise TraceError(f"{where}: TIMESTAMP {stamp!r} is neither seconds nor a date and time") from None
    return t + (float("0." + frac) if frac.isdigit() else 0.0)


def _jsonl(path: str) -> list[tuple[float, int, int]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for k, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{k}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not {"timestamp", "input_length", "output_length"} <= rec.keys():
                raise TraceError(f"{where}: a line needs timestamp, input_length and output_length")
            try:
                ms = float(rec["timestamp"])
            except (TypeError, ValueError):
                raise TraceError(f"{where}: timestamp {rec['timestamp']!r} is not a number") from None
            rows.append(
                (
                    ms / 1000.0,
                    _positive_int(rec["input_length"], "input_length", where),
                    _positive_int(rec["output_length"], "output_length", where),
                )
            )
    return rows


def _csv(path: str) -> list[tuple[float, int, int]]:
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not need <= set(reader.fieldnames or ()):
            raise TraceError(f"{path}: the header needs {', '.join(sorted(need))}")
        for k, rec in enumerate(reader, 2):
            where = f"{path}:{k}"
            rows.append(
                (
                    _seconds(rec["TIMESTAMP"], where),
                    _positive_int(rec["ContextTokens"], "ContextTokens", where),
                    _positive_int(rec["GeneratedTokens"], "GeneratedTokens", where),
                )
            )
    return rows


def load_trace(path: str, limit: int | None = None) -> list[TraceRow]:
    """The trace's first `limit` requests (all by default), in arrival order, times from the first."""
    if path.endswith(".csv"):
        raw = _csv(path)
    elif path.endswith((".jsonl", ".json")):
        raw = _jsonl(path)
    else:
        raise TraceError(f"{path}: a trace is .jsonl (Mooncake's format) or .csv (the Azure trace's)")
    raw.sort(key=lambda r: r[0])
    raw = raw[:limit] if limit else raw
    if len(raw) < 2:
        raise TraceError(f"{path}: a trace needs at least 2 requests to have a rate, found {len(raw)}")
    t0 = raw[0][0]
    if raw[-1][0] <= t0:
        raise TraceError(f"{path}: every request arrives at the same time; a trace needs a time span")
    return [TraceRow(t - t0, i, o) for t, i, o in raw]


def mean_rate(rows: list[TraceRow]) -> float:
    """Arrivals per second over the trace's span (n - 1 gaps)."""
    return (len(rows) - 1) / rows[-1].arrival_s


def arrivals_at(rows: list[TraceRow], rate: float) -> list[float]:
    """The rows' arrival times, the clock scaled so that the mean rate is `rate`."""
    scale = mean_rate(rows) / rate
    return [r.arrival_s * scale for r in rows]
