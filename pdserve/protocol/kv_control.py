"""Prefill <-> decode channel: the KV hand-off's control messages (pyzmq; codec and version: codec.py).

A receiver (decode) connects one DEALER to a sender's (prefill) bootstrap ROUTER. r = receiver, s = sender:
  Hello     r->s  the receiver's id and pair identity; s compares identities and the protocol version
  HelloAck  s->r  ok, or the reason of the refusal; on success the store port and the group generation
  PageList  r->s  the decode's pre-allocated page list for a room
  Announce  s->r  data for `room` follows on the pair group: staged chunks, or pool-to-pool runs if given
  Build     s->r  rebuild the pair group under generation `gen`
  PairDead  r->s  the receiver discarded generation `gen`
  Abort     both  the other side gave up on `room`
  Bye       both  the pair is closed (eviction, shutdown)
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from pdserve.protocol.codec import Codec, Msg


class Hello(Msg):
    kind: Literal["hello"] = "hello"
    receiver_id: str
    # Model fingerprint plus the pool's page geometry and the backend (kv_transfer.handshake).
    identity: dict[str, str | int]


class HelloAck(Msg):
    kind: Literal["hello_ack"] = "hello_ack"
    ok: bool
    error: str = ""
    # The refusal is for a model, layout or protocol mismatch (not a full node): retrying will not help.
    mismatch: bool = False
    store_port: int = 0
    gen: int = 0


class PageList(Msg):
    kind: Literal["page_list"] = "page_list"
    room: str
    pages: list[int]
    num_tokens: int


class Announce(Msg):
    kind: Literal["announce"] = "announce"
    room: str
    seq: int  # per-pair transfer number: selects the tags of the data operations
    gen: int  # the pair group generation the data travels on
    num_pages: int
    chunk_pages: int
    runs: list[int] | None = None  # pool-to-pool pieces (kv_transfer.layout.direct_runs)
    trailer_len: int
    num_tokens: int

    @model_validator(mode="after")
    def _runs_cover_the_pages(self) -> Announce:
        if self.runs is not None and (any(n < 1 for n in self.runs) or sum(self.runs) != self.num_pages):
            raise ValueError(f"announced runs {self.runs[:8]}... do not cover {self.num_pages} pages")
        return self


class Build(Msg):
    kind: Literal["build"] = "build"
    gen: int


class PairDead(Msg):
    kind: Literal["pair_dead"] = "pair_dead"
    gen: int
    reason: str = ""


class Abort(Msg):
    kind: Literal["abort"] = "abort"
    room: str
    reason: str = ""
    # Sender -> receiver: a page list came before any handshake (this prefill node restarted);
    # the receiver handshakes again and resends its page lists.
    unknown_pair: bool = False


class Bye(Msg):
    kind: Literal["bye"] = "bye"
    reason: str = ""


Message = Annotated[
    Union[Hello, HelloAck, PageList, Announce, Build, PairDead, Abort, Bye],
    Field(discriminator="kind"),
]

CODEC: Codec[Message] = Codec("kv control", Message)
encode = CODEC.encode
decode = CODEC.decode
