"""One kB field of a Linux /proc file (`MemAvailable:` of /proc/meminfo, `Pss:` of smaps_rollup, `VmRSS:`
of status), in bytes: the runtime's pool sizing and the benchmarks' memory readings share it."""

from __future__ import annotations


def kb_field_bytes(path: str, key: str) -> int | None:
    """The value of the line `key: N kB` of `path` in bytes; None where the file or the line cannot be read."""
    prefix = key + ":"
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
