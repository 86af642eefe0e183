"""Pair handshake: what both sides must agree on before any KV moves between them.

The compared identity is the caller's compatibility record (pdserve/protocol/compat.py: model, weights,
KV dtype and layout, tokenizer, protocol, ...) plus what this package itself depends on: the pool's page
geometry and the transfer backend. A field that must be equal and differs refuses the pair on both
sides, naming every such field; one that may differ (compat.MAY_DIFFER) is logged with the reason it is
safe. The protocol version is checked before, on every frame (pdserve.protocol.codec).
"""

from __future__ import annotations

import logging

from pdserve.kv_transfer.layout import PoolGeometry
from pdserve.protocol import compat

log = logging.getLogger("pdserve.kv_transfer")


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
    """None when the pair may work together (differences that are safe are logged); else a message
    naming each differing field that must be equal, with both values."""
    refused, allowed = compat.compare(local, remote)
    if refused:
        return (
            "model fingerprint mismatch, pair refused ("
            + compat.describe(local, remote, refused, remote_name)
            + ")"
        )
    if allowed:
        log.info(
            "kv_transfer: pair with a %s node allowed: %s",
            remote_name,
            compat.allowed_note(local, remote, allowed, remote_name),
        )
    return None
