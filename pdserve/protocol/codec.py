"""The one codec of every channel that crosses a process, and the one protocol version.

A frame is the JSON of {"v": PROTOCOL_VERSION, "msg": <pydantic message with a literal `kind`>}.
Each channel (gateway.py, kv_control.py) declares its messages as a discriminated union and gets a
`Codec` for it. `decode` raises `ProtocolError` (never anything else) for a frame it refuses:
`VersionMismatch` when the sender speaks another version, `MalformedFrame` for any other body.
Receivers log and drop such frames; at a handshake they answer with a refusal naming both versions.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

# 3: incremental KV transfer (PageList.skip_pages, prefix_hash; PrefixMismatch); local prefill.
# 4: SamplingParams carries min_new_tokens, logit_bias and no_stop_trim, and the output constraints
#    json_schema, regex and ebnf.
# 5: RegisterAck.retry (a worker id still held by a live connection).
# 9: same-host KV hand-off through shared memory (HelloAck.shm, PageList.shm, Announce.shm_pages,
#    shm_fence and trailer; Copied).
# 10: PrefillDone.first (the first token reaches the gateway from the prefill node, before its KV lands).
# 11: requests without a decode leg (max_new_tokens 0 or 1): GenerateRequest.decode_worker "" (validated),
#     PrefillDone.first finished with no token for max_new_tokens 0.
# 12: role switching in place (SwitchRole; Register.epoch).
# 13: KV checksums (Trailer.checksums, Announce.trailer_len bounded), the compatibility record's fields,
#     GenerateRequest.use_prefix_cache (canaries).
PROTOCOL_VERSION = 14

M = TypeVar("M", bound=BaseModel)


class Msg(BaseModel):
    """Base of every wire message: unknown fields are refused, not ignored."""

    model_config = ConfigDict(extra="forbid")


class ProtocolError(ValueError):
    """A frame this node refuses to read."""


class VersionMismatch(ProtocolError):
    """`kind`: the refused message's kind when readable, so a handshake can be answered with a refusal."""

    def __init__(self, channel: str, received: int, kind: str | None = None) -> None:
        self.received, self.kind = received, kind
        super().__init__(
            f"{channel} {kind or 'frame'} of protocol version {received} refused: "
            f"this node speaks {PROTOCOL_VERSION}"
        )


class MalformedFrame(ProtocolError):
    pass


class _Kind(BaseModel):
    kind: str | None = None


class _Header(BaseModel):
    """Read only when a frame fails validation, to tell a version mismatch from a broken body."""

    v: int
    msg: _Kind | None = None


class Codec(Generic[M]):
    """Encodes and decodes the messages of one channel; `union` is their discriminated union."""

    def __init__(self, channel: str, union: Any) -> None:
        self.channel = channel

        class Envelope(Msg):
            v: int
            msg: union

        self._envelope = TypeAdapter(Envelope)

    def encode(self, msg: M) -> bytes:
        return b'{"v":%d,"msg":%s}' % (PROTOCOL_VERSION, msg.model_dump_json().encode())

    def decode(self, frame: bytes) -> M:
        try:
            env = self._envelope.validate_json(frame)
        except ValidationError as e:
            try:
                header = _Header.model_validate_json(frame)
            except ValidationError:
                header = _Header(v=PROTOCOL_VERSION)
            if header.v != PROTOCOL_VERSION:
                kind = header.msg.kind if header.msg else None
                raise VersionMismatch(self.channel, header.v, kind) from None
            first = e.errors()[0] if e.errors() else {"loc": (), "msg": str(e)}
            where = ".".join(str(p) for p in first["loc"]) or "frame"
            raise MalformedFrame(
                f"malformed {self.channel} frame ({where}: {first['msg']}): {frame[:200]!r}"
            ) from None
        if env.v != PROTOCOL_VERSION:
            raise VersionMismatch(self.channel, env.v, env.msg.kind)
        # The envelope validated it against this channel's union, which is M.
        return cast(M, env.msg)
