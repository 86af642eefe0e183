"""The cluster secret and the CurveZMQ keys derived from it: who may speak on the internal zmq ports.

One secret, shared by the gateway and every worker (`--cluster-secret-file`, or the environment
variable PDSERVE_CLUSTER_SECRET), configures every process: each Curve key pair is derived from it
with a keyed hash (HMAC-SHA256(secret, label) -> 32 bytes -> a Curve secret key; its public key via
`zmq.curve_public`), so no key files are handed around.

  server pair  the gateway's control ROUTER and every prefill's KV bootstrap ROUTER
  client pair  every worker's DEALER (the control link, and the decode's KV links)

A server socket runs Curve (every frame encrypted and authenticated) and a ZAP handler (pyzmq's
`zmq.auth`) that admits only the client public key derived from the same secret. A peer without
the secret fails the handshake: it cannot send a frame that reaches our code, and receives none.
Without a secret, the sockets run as before (plain TCP, anyone who reaches the port may speak) and
the process logs a warning at startup.

What Curve cannot cover: the gloo (or NCCL) data sockets of the KV pair groups (torch.distributed has
no authentication); they bind to the worker's own --host only (docs/reliability.md). Their rendezvous
keys travel on the Curve channel (kv_transfer/pair_store.py), so no store port is open.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth.asyncio
import zmq.auth.thread
from zmq.utils import z85

from pdserve import env

log = logging.getLogger(__name__)

# Long enough that a guess is hopeless, short enough to paste into a Kubernetes Secret.
MIN_SECRET_BYTES = 16
# A peer that connects and never finishes its Curve handshake is dropped after this.
HANDSHAKE_S = 5.0
ZAP_DOMAIN = "pdserve"  # the one domain our ZAP handlers answer for


class ClusterSecretError(ValueError):
    pass


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # z85, 40 bytes
    secret: bytes  # z85, 40 bytes

    def __repr__(self) -> str:  # never print a secret key
        return f"KeyPair(public={self.public!r})"


def _derive(secret: bytes, label: str) -> KeyPair:
    raw = hmac.new(secret, f"pdserve curve {label}".encode(), hashlib.sha256).digest()  # 32 bytes
    sk = z85.encode(raw)
    return KeyPair(public=zmq.curve_public(sk), secret=sk)


@dataclass(frozen=True)
class ClusterKeys:
    server: KeyPair
    client: KeyPair

    @classmethod
    def from_secret(cls, secret: bytes) -> ClusterKeys:
        secret = secret.strip()
        if len(secret) < MIN_SECRET_BYTES:
            raise ClusterSecretError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
        return cls(server=_derive(secret, "server"), client=_derive(secret, "client"))


def load_keys(secret_file: str | None) -> ClusterKeys | None:
    """The keys of the secret in `secret_file`, else in PDSERVE_CLUSTER_SECRET; None when neither
    is set (an unauthenticated cluster). The secret itself is never logged."""
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                secret = f.read()
        except OSError as e:
            raise ClusterSecretError(
                f"cannot read the cluster secret file {secret_file}: {e.strerror}"
            ) from None
        return ClusterKeys.from_secret(secret)
    value = env.cluster_secret()
    return ClusterKeys.from_secret(value.encode()) if value is not None else None


def warn_if_open(keys: ClusterKeys | None, what: str) -> None:
    if keys is None:
        log.warning(
            "no cluster secret (--cluster-secret-file or PDSERVE_CLUSTER_SECRET): %s accepts any peer "
            "that reaches it",
            what,
        )


class _AllowClient:
    """ZAP credentials provider: only the client key of our secret."""

    def __init__(self, public: bytes) -> None:
        self._public = public

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self._public)
        if not ok:
            log.warning("refused a zmq peer with an unknown Curve key")
        return ok


def start_authenticator(ctx: zmq.Context[Any], keys: ClusterKeys) -> zmq.auth.base.Authenticator:
    """The ZAP handler of `ctx` (one per context): a thread for a plain context, a task on the running
    loop for an asyncio one. Stop it before the context is terminated."""
    auth: zmq.auth.base.Authenticator
    if isinstance(ctx, zmq.asyncio.Context):
        auth = zmq.auth.asyncio.AsyncioAuthenticator(ctx)
    else:
        auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_AllowClient(keys.client.public))
    return auth


def secure_server(sock: zmq.Socket[Any], keys: ClusterKeys | None, max_frame_bytes: int) -> None:
    """Options of a server (bind) socket, set before bind: Curve when keyed; always a frame size
    limit (a bigger frame drops the connection) and a handshake deadline."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server.public)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def secure_client(sock: zmq.Socket[Any], keys: ClusterKeys | None, max_frame_bytes: int) -> None:
    """Options of a client (connect) socket, set before connect."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server.public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client.secret)


SECRET_FILE_HELP = (
    "file holding the cluster secret shared by the gateway and every worker (CurveZMQ on the "
    "control and KV bootstrap ports); default: env PDSERVE_CLUSTER_SECRET; neither: unauthenticated"
)
