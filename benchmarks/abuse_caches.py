"""`pdserve bench abuse`, the caches on disk: bytes changed in a cache file a worker maps at its next start.

Each case reads a greedy answer, overwrites 1 MiB of one cache file with random bytes (in a copy renamed
over it, so the live workers' mappings keep the old bytes: only the next start reads the new ones), kills
the decode worker with SIGKILL and waits until the restarted one serves. Expected: the restarted worker
logs a warning naming the file, builds it again (runtime/disk_cache.py), and answers as before. Both
cases replace a worker on purpose (destructive); they need the cluster's cache folder (PDSERVE_CACHE_DIR,
as this process sees it) and its workers' logs (their stdout, a file under `pdserve up --log-dir`).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import time

from pdserve import env
from pdserve.bench.abuse_target import Target, live_decode_pid, post
from pdserve.runtime import disk_cache

GREEDY = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
RESTART_S = 600.0  # a GGUF conversion and a quantization on a loaded 2-core host: minutes


def _answer(t: Target) -> str:
    r = post(t, GREEDY)
    return str(r.json().get("text")) if r.status_code == 200 else f"<{r.status_code}>"


def _overwrite(path: str) -> None:
    """1 MiB of random bytes in the middle of `path`, through a copy renamed over it."""
    tmp = f"{path}.abuse-{os.getpid()}"
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 24):
            dst.write(chunk)
        dst.seek(max(0, os.path.getsize(path) // 2 - (1 << 19)))
        dst.write(os.urandom(1 << 20))
    os.replace(tmp, path)


def _sealed(entry: str) -> bool:
    """Whether the entry's files are those its record names (read only: runtime/disk_cache.py's check
    would delete a bad one)."""
    try:
        with open(disk_cache.record_path(entry)) as f:
            files = json.load(f)["files"]
        on_disk = disk_cache.content_digest(entry)
    except (OSError, ValueError, KeyError):
        return False
    return all(on_disk.get(name) == value for name, value in files.items())


def _kill_decode(t: Target, pid: int, until: str | None) -> tuple[str, float]:
    """SIGKILL the decode `pid`; wait until a new one serves (with the answer `until`, where given).
    Returns the last answer and the seconds it took."""
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    after = "<none>"
    while time.monotonic() - start < RESTART_S:
        time.sleep(2)
        new = live_decode_pid(t)
        if new is not None and new != pid and not (after := _answer(t)).startswith("<"):
            if until is None or after == until:
                break
    return after, time.monotonic() - start


def _corrupt_and_restart(
    t: Target, path: str | None, what: str, entry: str | None = None
) -> tuple[str, bool]:
    pid = live_decode_pid(t)
    if pid is None or path is None:
        return f"no decode worker or no {what} in {env.cache_dir()}", False
    before = _answer(t)
    log = os.path.realpath(f"/proc/{pid}/fd/1")
    offset = os.path.getsize(log) if os.path.isfile(log) else 0
    _overwrite(path)
    after, took = _kill_decode(t, pid, before)
    warned = False
    if os.path.isfile(log):
        with open(log, errors="replace") as f:
            f.seek(offset)
            warned = any("is not used" in line and os.path.basename(path) in line for line in f)
    rebuilt = _sealed(entry or path)
    answer = (
        f"{'warning logged' if warned else 'NO warning'}, {'rebuilt' if rebuilt else 'NOT rebuilt'}, "
        f"{'same answer' if after == before else f'answer {after[:30]!r} != {before[:30]!r}'} in {took:.0f} s"
    )
    return answer, warned and rebuilt and after == before


def _mapped_quant_file(pid: int | None) -> str | None:
    """The quantized-weights cache file the worker `pid` maps (runtime/quant_cache.py), if any."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "/quantized/" in line}
    except OSError:
        return None
    return next((p for p in sorted(paths) if p.endswith(".safetensors")), None)


def corrupt_quant_cache(t: Target) -> tuple[str, bool]:
    """1 MiB of random bytes in the quantized-weights file the decode maps, then kill -9 the decode. A
    decode that maps the builder's staged copy in shared memory (runtime/quant_stage.py) maps no file of
    the cache folder: it is restarted once first, to map the cache folder's copy."""
    pid = live_decode_pid(t)
    if pid is not None and _mapped_quant_file(pid) is None:
        _kill_decode(t, pid, None)
    return _corrupt_and_restart(t, _mapped_quant_file(live_decode_pid(t)), "quantized-weights file mapped")


def _gguf_cache_file(t: Target) -> str | None:
    """tokenizer.json of the served GGUF model's config-and-tokenizer folder (runtime/gguf_folder.py)."""
    from pdserve.model_source import resolve_model_source
    from pdserve.runtime.gguf_folder import gguf_digest

    source = resolve_model_source(t.model_path or None)
    if source.gguf_path is None:
        return None
    key = gguf_digest(source.gguf_path)[:20]
    found = glob.glob(os.path.join(env.cache_dir(), "gguf-meta", key, "tokenizer.json"))
    return found[0] if found else None


def corrupt_gguf_cache(t: Target) -> tuple[str, bool]:
    """1 MiB of random bytes in the GGUF model's cached tokenizer, then kill -9 the decode."""
    path = _gguf_cache_file(t)
    return _corrupt_and_restart(t, path, "GGUF config-and-tokenizer folder", path and os.path.dirname(path))
