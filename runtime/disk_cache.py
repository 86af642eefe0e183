"""The one rule every on-disk cache of pdserve follows: nothing read back is trusted until checked.

An entry is a file or a folder in the cache folder (the quantized weights `quantized/<key>.pt`, a GGUF
model's dequantized folder `gguf/<key>/`), and beside it a record, `<entry>.record.json`, written when the
entry is: a digest of every byte of the entry's files (xxh3-128, streamed from a mapping of each file: the
bundled model's quantized file, 421 MB at w4a16/bf16, digests in ~20 ms from the page cache, where sha256
took 220 ms) and what the content claims to be (a quantization mode, a dtype, the fingerprint of its
source, a format version: the caller's `claims`).

Writing (`commit`): the content is written under a temporary name by the caller, digested there, then under
the entry's lock the old record goes, the content is renamed into place and the record is written last,
itself through a temporary file and a rename. A writer that dies halfway leaves an entry without a record.

Reading (`check`, before anything of the entry is used): the record must be there and readable, claim
exactly what the caller expects, and name files whose sizes and digests are those on disk. Anything else
(no record, a torn or truncated file, bytes changed since, a file of another mode or source put under the
key's name, an error while reading any of it) is logged as a WARNING naming the entry and the reason, the
entry and its record are deleted, and the caller hears "absent": it builds the entry again, as on a first
start. A broken entry therefore costs one rebuild, never a crash-loop nor wrong weights served at every
restart; `reject` does the same for what the caller finds wrong after the check (a file that would not
load).

The KV tiers to come, which keep KV pages on disk, follow the same rule with the same functions.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping

import xxhash

log = logging.getLogger(__name__)

RECORD_FORMAT = 1  # bump when the record's own shape changes
ALGORITHM = "xxh3_128"
Claims = Mapping[str, str | int | bool]


def record_path(entry: str) -> str:
    return entry + ".record.json"


def _lock_path(entry: str) -> str:
    return entry + ".record.lock"


def file_digest(path: str) -> str:
    """xxh3-128 of every byte of `path`, read in 16 MiB chunks into one buffer: a mapping would count the
    whole file in the process's resident peak (an 8B model's 4.6 GB beside the model it just built)."""
    h = xxhash.xxh3_128()
    buf = bytearray(1 << 24)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _files(entry: str) -> list[str]:
    """The entry's files, relative to it ("" for an entry that is one file)."""
    if not os.path.isdir(entry):
        return [""]
    found = []
    for root, _, names in os.walk(entry):
        found += [os.path.relpath(os.path.join(root, n), entry) for n in names]
    return sorted(found)


def content_digest(entry: str) -> dict[str, list[int | str]]:
    """{relative name: [size, digest]} of the entry's files."""
    out: dict[str, list[int | str]] = {}
    for rel in _files(entry):
        path = os.path.join(entry, rel) if rel else entry
        out[rel] = [os.path.getsize(path), file_digest(path)]
    return out


@contextlib.contextmanager
def _locked(entry: str) -> Iterator[None]:
    """The entry's lock: a reader never digests a file a writer is replacing under it. A cache folder
    this process cannot write to is read unlocked (nothing of this process replaces anything there)."""
    try:
        os.makedirs(os.path.dirname(entry) or ".", exist_ok=True)
        lock = open(_lock_path(entry), "a")  # noqa: SIM115 - held across the yield
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _discard(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):  # gone already, or a read-only cache folder
            os.unlink(path)


def _remove(entry: str) -> None:
    for path in (record_path(entry), entry):
        _discard(path)


def _problem(entry: str, claims: Claims) -> str | None:
    """Why the entry cannot be trusted, or None when it can (the entry is known to exist)."""
    try:
        with open(record_path(entry), encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return "it has no record (written by an older pdserve, or its writer died before finishing)"
    if not isinstance(record, dict):
        return "its record is not a JSON object"
    if record.get("format") != RECORD_FORMAT or record.get("algorithm") != ALGORITHM:
        return f"its record is of format {record.get('format')!r} ({record.get('algorithm')!r})"
    want = json.loads(json.dumps(dict(claims), sort_keys=True))
    have = record.get("claims")
    if have != want:
        diff = sorted(k for k in set(want) | set(have or {}) if (have or {}).get(k) != want.get(k))
        said = ", ".join(f"{k}={(have or {}).get(k)!r} (expected {want.get(k)!r})" for k in diff)
        return f"it claims {said}"
    files = record.get("files")
    if not isinstance(files, dict) or not files:
        return "its record names no files"
    for rel, (size, digest) in sorted(files.items()):
        path = os.path.join(entry, rel) if rel else entry
        name = rel or os.path.basename(entry)
        if not os.path.isfile(path):
            return f"{name} is missing"
        on_disk = os.path.getsize(path)
        if on_disk != size:
            return f"{name} holds {on_disk} bytes, {size} were written (truncated or replaced)"
        if file_digest(path) != digest:
            return f"{name} does not match its digest (bytes changed since it was written)"
    return None


def check(entry: str, claims: Claims) -> bool:
    """True when `entry` is there and is what it was written as, claiming `claims`; else False, the
    entry deleted (with a WARNING naming it and the reason) where anything of it was on disk."""
    with _locked(entry):
        there = os.path.lexists(entry)
        if not there and not os.path.lexists(record_path(entry)):
            return False
        try:
            why = _problem(entry, claims) if there else "its content is missing"
        except Exception as exc:  # noqa: BLE001 - whatever a bad entry raises, it is rebuilt
            why = f"it could not be read ({type(exc).__name__}: {exc})"
        if why is None:
            return True
        log.warning("cache entry %s is not used: %s; deleting it, it is built again", entry, why)
        _remove(entry)
        return False


def reject(entry: str, why: str) -> None:
    """The caller found the entry unusable after `check` passed (it would not load): log, delete."""
    log.warning("cache entry %s is not used: %s; deleting it, it is built again", entry, why)
    with _locked(entry):
        _remove(entry)


def commit(written: str, entry: str, claims: Claims) -> None:
    """Move `written` (a file or folder the caller wrote in the entry's folder) to `entry`, with its record
    written last. `written` is removed where this fails."""
    tmp = ""
    try:
        record = {
            "format": RECORD_FORMAT,
            "algorithm": ALGORITHM,
            "claims": dict(claims),
            "files": content_digest(written),
        }
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(entry), prefix=".tmp-", suffix=".record.json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, sort_keys=True)
        with _locked(entry):
            _remove(entry)  # the old record first: from here until the rename below, no record
            os.replace(written, entry)
            os.replace(tmp, record_path(entry))
    finally:
        for path in (written, tmp):
            if path:
                _discard(path)
