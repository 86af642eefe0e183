"""KV cache hand-off from prefill to decode nodes over per-pair torch.distributed groups, or through
shared memory between two nodes of one host.

Prefill: KVSender(kv, fingerprint, host, bootstrap_port, config).start(); send(); poll(); abort().
Decode:  KVReceiver(kv, fingerprint, config).start(); connect(); request(); poll(); abort().
Rooms, pairs and handshakes: sender_io.py, receiver_io.py (what both keep alike: rooms.py; state machine:
state.py), on the I/O loop both ends share (io_loop.py). The two transports, behind transport.py: the
pair group (dist_transport.py) and, on one host, the prefill's pool in shared memory copied by the decode
(shm_transport.py, shm.py; TransferConfig.transport). Tensor-parallel workers: the handshake carries both
TP sizes, and on one host each decode rank's pool takes its KV heads from the prefill rank holding them
(layout.kv_head_ranges, shm.copy_heads); the pair group carries every head from and to rank 0's pool.
Byte layout: layout.py. Wire messages: pdserve/protocol (kv_control.py, kv_trailer.py). Mailbox items:
mailbox.py.
"""

from pdserve.kv_transfer.config import TransferConfig, default_backend
from pdserve.kv_transfer.handshake import FingerprintMismatch
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.sender import KVSender
from pdserve.kv_transfer.state import TransferResult, TransferState

__all__ = [
    "FingerprintMismatch",
    "KVReceiver",
    "KVSender",
    "TransferConfig",
    "TransferResult",
    "TransferState",
    "default_backend",
]
