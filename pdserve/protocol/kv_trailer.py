"""What travels after the KV pages on a pair group: the trailer, and the first-token metadata in it.

The trailer is UTF-8 JSON sent as raw bytes after a room's pages (kv_transfer.layout); the receiver
commits the pages only if its room equals the room announced on the control channel. It travels on a
pair that already passed the versioned handshake, so it carries no version of its own.

`metadata`: the prefill node's `FirstToken`. `checksums`: [index in the room's page list, xxh3-64 of that
page's bytes] for the pages the sender hashed (kv_transfer/checksum.py); the receiver checks each.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, ValidationError

from pdserve.protocol.codec import MalformedFrame, Msg


class FirstToken(Msg):
    """Prefill -> decode with the KV: the token sampled at the end of the prompt."""

    first_token: int
    logprob: float | None = None
    # [(token_id, logprob), ...] when top_logprobs_num > 0.
    top_logprobs: list[tuple[int, float]] | None = None
    cached_tokens: int = 0
    # The prefill node's weights when it sampled the first token.
    weight_version: str = "default"


class Trailer(Msg):
    room: str
    num_tokens: int
    metadata: FirstToken
    checksums: list[tuple[int, Annotated[int, Field(ge=0, lt=1 << 64)]]] = []


def encode_trailer(
    room: str, num_tokens: int, metadata: FirstToken, checksums: list[tuple[int, int]]
) -> bytes:
    t = Trailer(room=room, num_tokens=num_tokens, metadata=metadata, checksums=checksums)
    return t.model_dump_json().encode()


def decode_trailer(data: bytes) -> Trailer:
    try:
        return Trailer.model_validate_json(data)
    except ValidationError as e:
        raise MalformedFrame(f"malformed KV trailer: {str(e).splitlines()[0]}: {data[:200]!r}") from None
