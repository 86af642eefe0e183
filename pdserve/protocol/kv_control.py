"""Prefill <-> decode channel: the KV hand-off's control messages (pyzmq; codec and version: codec.py).

A receiver (decode) connects one DEALER to a sender's (prefill) bootstrap ROUTER. r = receiver, s = sender:
  Hello     r->s  the receiver's id, pair identity and TP size; s compares identities and the protocol
                  version, and checks that its TP layout maps onto the receiver's
  HelloAck  s->r  ok, or the reason of the refusal; on success the group generation to build, the
                  sender's TP size, and its shared-memory segments if it has them (`shm`: one per rank,
                  kv_transfer/shm.py)
  PageList  r->s  the decode's pre-allocated page list for a room; with `skip_pages`, the decode already
                  holds the room's first pages (its prefix cache) and lists pages for the rest only
  PrefixMismatch  s->r  the skipped prefix's hash is not this prompt's: send a full page list instead
  Announce  s->r  data for `room` follows on the pair group: staged chunks, or pool-to-pool runs if given;
                  or (`shm_pages`) the receiver copies these pages out of the sender's segment itself
  Copied    r->s  a shared-memory room is copied (or why not): the sender may free its pages
  Build     s->r  rebuild the pair group under generation `gen`
  StoreSet  both  a key of the pair group's rendezvous store (kv_transfer/pair_store.py)
  PairDead  r->s  the receiver discarded generation `gen`
  Abort     both  the other side gave up on `room`
  Bye       both  the pair is closed (eviction, shutdown)
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from pdserve.protocol.codec import Codec, Msg

MAX_TP = 64  # ranks of one worker a peer may announce


class Hello(Msg):
    kind: Literal["hello"] = "hello"
    receiver_id: str
    # Model fingerprint plus the pool's page geometry and the backend (kv_transfer.handshake).
    identity: dict[str, str | int]
    # The receiver's TP size: its ranks' pools hold kv_head_ranges(kv_heads, tp_size) (kv_transfer.layout).
    tp_size: int = Field(1, ge=1, le=MAX_TP)


class ShmSegmentRef(Msg):
    """One more rank's pool of a TP sender, in its own segment."""

    path: str = Field(max_length=512)
    token: str = Field(pattern=r"^[0-9a-f]{64}$")


class ShmOffer(Msg):
    """The sender's KV pool in shared memory: the receiver maps `path` if it holds `token` (hex). A TP
    sender offers each rank's pool: `path` is rank 0's (its header holds the fence), `ranks` the others'
    in rank order, each of num_pages pages of that rank's KV heads."""

    path: str = Field(max_length=512)
    token: str = Field(pattern=r"^[0-9a-f]{64}$")
    num_pages: int = Field(ge=1)
    ranks: list[ShmSegmentRef] = Field(default_factory=list, max_length=MAX_TP - 1)


class HelloAck(Msg):
    kind: Literal["hello_ack"] = "hello_ack"
    ok: bool
    error: str = ""
    # The refusal is for a model, layout or protocol mismatch (not a full node): retrying will not help.
    mismatch: bool = False
    gen: int = 0
    shm: ShmOffer | None = None
    tp_size: int = Field(1, ge=1, le=MAX_TP)  # the sender's, as Hello.tp_size

    @model_validator(mode="after")
    def _a_segment_per_rank(self) -> HelloAck:
        if self.shm is not None and len(self.shm.ranks) != self.tp_size - 1:
            raise ValueError(f"a TP-{self.tp_size} sender offers {len(self.shm.ranks) + 1} segments")
        return self


class PageList(Msg):
    kind: Literal["page_list"] = "page_list"
    room: str
    # Destination pages of the room's pages `skip_pages`, `skip_pages + 1`, ... (all of them: 0 skipped).
    pages: list[int]
    num_tokens: int
    # Incremental transfer: the receiver holds the KV of the first `skip_pages` whole pages already;
    # `prefix_hash` is the chained block hash (block_hash.py) of the last of them, which the sender
    # checks against its own prompt before it sends only the pages after them.
    skip_pages: int = Field(0, ge=0)
    prefix_hash: int | None = None
    # The receiver mapped the sender's segment: announce this room's pages for it to copy.
    shm: bool = False

    @model_validator(mode="after")
    def _skip_has_a_hash(self) -> PageList:
        if self.skip_pages and self.prefix_hash is None:
            raise ValueError("a page list that skips pages must give the prefix hash")
        return self


class PrefixMismatch(Msg):
    """Sender -> receiver: the skipped prefix is not this room's; the room waits for a full page list."""

    kind: Literal["prefix_mismatch"] = "prefix_mismatch"
    room: str
    reason: str = ""


class Announce(Msg):
    kind: Literal["announce"] = "announce"
    room: str
    seq: int  # per-pair transfer number: selects the tags of the data operations
    gen: int  # the pair group generation the data travels on
    num_pages: int
    chunk_pages: int
    runs: list[int] | None = None  # pool-to-pool pieces (kv_transfer.layout.direct_runs)
    trailer_len: int = Field(ge=1, le=1 << 20)
    num_tokens: int
    # Shared memory: no data follows on the pair group; the receiver copies these pages of the sender's
    # segment, checks the segment's fence against `shm_fence` before and after, and reads the trailer
    # (base64) from here.
    shm_pages: list[int] | None = None
    shm_fence: int = 0
    trailer: str | None = Field(None, max_length=1 << 20)

    @model_validator(mode="after")
    def _runs_cover_the_pages(self) -> Announce:
        if self.runs is not None and (any(n < 1 for n in self.runs) or sum(self.runs) != self.num_pages):
            raise ValueError(f"announced runs {self.runs[:8]}... do not cover {self.num_pages} pages")
        if self.shm_pages is not None and (
            len(self.shm_pages) != self.num_pages or self.trailer is None or self.runs is not None
        ):
            raise ValueError("a shared-memory announcement lists num_pages pages and carries the trailer")
        return self


class Copied(Msg):
    """Receiver -> sender: the shared-memory room is copied (`error` empty) or failed; free its pages."""

    kind: Literal["copied"] = "copied"
    room: str
    seq: int
    error: str = ""
    corrupt: bool = False  # the error is a checksum mismatch (FailCode.KV_CORRUPT), not a failed copy


class Build(Msg):
    kind: Literal["build"] = "build"
    gen: int


class StoreSet(Msg):
    """One key the sending side set in generation `gen`'s rendezvous store (value base64-encoded)."""

    kind: Literal["store_set"] = "store_set"
    gen: int = Field(ge=0)
    key: str = Field(max_length=512)
    value: str = Field(max_length=8192)


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
    Union[Hello, HelloAck, PageList, PrefixMismatch, Announce, Copied, Build, StoreSet, PairDead, Abort, Bye],
    Field(discriminator="kind"),
]

CODEC: Codec[Message] = Codec("kv control", Message)
encode = CODEC.encode
decode = CODEC.decode
