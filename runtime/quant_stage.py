"""Where a freshly built quantized model is first stored: shared memory, then the disk in the background.

The quantized model's file (runtime/quant_cache.py) is both how a host's workers share one copy of the
weights (each maps it) and how a restart skips the build. Written straight to the cache folder, an 8B
model's 4.4 GB waited on the disk: 35 s on a 126 MB/s disk, once the kernel's dirty-page limit was
reached, while llama.cpp's server (which maps its GGUF file as is) was long serving. So the builder
writes it to /dev/shm (memory speed), every worker maps it from there, and a process copies it to the
cache folder meanwhile; once the copy is recorded, the shared-memory file is unlinked: the workers
mapping it keep its pages until they exit, and later starts map the disk copy (page cache).

A worker killed before the copy finished leaves the staged file with its record: the next start maps
it and copies it again. Where /dev/shm is missing, not writable or too small (a container's default is
64 MB), the builder writes to the cache folder directly, as before.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

from pdserve.runtime import disk_cache

log = logging.getLogger(__name__)

SHM = "/dev/shm"


def staged_path(stored: str) -> str:
    """Where the file that belongs at `stored` (in a cache folder) is staged in shared memory: named by
    that path, so that two cache folders never share a staged file."""
    name = hashlib.sha256(os.path.abspath(stored).encode()).hexdigest()[:24]
    return os.path.join(SHM, f"pdserve-quantized-{os.getuid()}", f"{name}.safetensors")


def staging_path(stored: str, size: int) -> str | None:
    """`staged_path(stored)` where /dev/shm can hold `size` bytes with room to spare (a quarter of it
    left free), else None."""
    path = staged_path(stored)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        st = os.statvfs(os.path.dirname(path))
    except OSError:
        return None
    if size > st.f_bavail * st.f_frsize * 0.75 or not os.access(os.path.dirname(path), os.W_OK):
        return None
    return path


def persist_later(staged: str, stored: str, claims: disk_cache.Claims) -> subprocess.Popen[bytes]:
    """Copy the staged file to its place in the cache folder, then unlink the staged one, in a process of
    its own (its own session: the copy outlives a worker that exits or is killed meanwhile; a thread was
    cut short by the interpreter's exit)."""
    argv = [
        sys.executable,
        "-P",
        "-m",
        "pdserve.runtime.quant_stage",
        staged,
        stored,
        json.dumps(dict(claims)),
    ]
    return subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)


def _persist(staged: str, stored: str, claims: disk_cache.Claims) -> None:
    """The copy, by one process at a time (the workers mapping a staged file each offer to copy it)."""
    os.makedirs(os.path.dirname(stored), exist_ok=True)
    with open(stored + ".persist.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another worker is copying it
        if disk_cache.check(stored, claims):
            _unlink(staged)  # copied already
        elif os.path.exists(staged):
            _copy(staged, stored, claims)


def _copy(staged: str, stored: str, claims: disk_cache.Claims) -> None:
    t0 = time.monotonic()
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(stored), prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        shutil.copyfile(staged, tmp)
        disk_cache.commit(tmp, stored, claims)
        tmp = ""
        _unlink(staged)
        log.info("quantized weights copied to %s in %.1f s", stored, time.monotonic() - t0)
    except OSError as e:  # a full or read-only cache folder: the staged copy stays for this boot
        log.warning("could not copy the quantized weights to %s: %s", stored, e)
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)


def _unlink(staged: str) -> None:
    for path in (disk_cache.record_path(staged), staged, staged + ".record.lock"):
        if os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _persist(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
