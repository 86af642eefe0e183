"""Pair handshake: what both sides must agree on before any KV moves between them.

The compared identity is the caller's model fingerprint (architecture, layers, kv heads, head dim,
dtype, page size, weights hash) plus what this package itself depends on: the pool's page geometry and
the transfer backend. A mismatch refuses the pair on both sides, naming every differing field. The
protocol version is checked before, on every frame (pdserve.protocol.codec).
"""

from __future__ import annotations

from pdserve.kv_transfer.layout import PoolGeometry


class FingerprintMismatch(RuntimeError):
    """The two nodes of a pair disagree on the model or KV layout; the pair is refused."""


def pair_identity(
    fingerprint: dict[str, str | int], geometry: PoolGeometry, backend: str
) -> dict[str, str | int]:
    ident: dict[str, str | int] = {str(k): v for k, v in fingerprint.items()}
    ident["kv_transfer.backend"] = backend
    ident["kv_transfer.page_shape"] = "x".join(str(s) for s in geometry.page_shape)
    ident["kv_transfer.dtype"] = str(geometry.dtype).removeprefix("torch.")
    return ident


def compare_identities(
    local: dict[str, str | int], remote: dict[str, str | int], remote_name: str
) -> str | None:
    """None when equal; else a message naming each differing field with both values."""
    diffs = []
    for key in sorted(set(local) | set(remote)):
        mine, theirs = local.get(key, "<missing>"), remote.get(key, "<missing>")
        if mine != theirs:
            diffs.append(f"{key}: local={mine!r} {remote_name}={theirs!r}")
    if not diffs:
        return None
    return "model fingerprint mismatch, pair refused (" + "; ".join(diffs) + ")"
