"""Every type that crosses a process, one module per channel, one codec and one version (codec.py).

gateway.py     gateway <-> worker control messages
block_hash.py  the chained page-block hashes that name cached prefixes in `KVEvents`
kv_control.py  prefill <-> decode control messages of the KV hand-off
kv_trailer.py  the trailer after a room's KV pages, and the first-token metadata it carries
records.py     event times and counters carried inside gateway messages

Tensors never travel through here: KV pages go over kv_transfer's pair groups (kv_transfer/layout.py).
"""

from pdserve.protocol.codec import (
    PROTOCOL_VERSION,
    MalformedFrame,
    ProtocolError,
    VersionMismatch,
)

__all__ = ["PROTOCOL_VERSION", "MalformedFrame", "ProtocolError", "VersionMismatch"]
