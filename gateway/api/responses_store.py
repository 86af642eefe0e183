"""Stored responses of /v1/responses (`store`, the default): what GET and DELETE /v1/responses/{id}
read, and what `previous_response_id` continues.

Each entry keeps the response object and the whole conversation up to it as chat messages (the
input of every earlier turn, then this turn's output), so a follow-up turn is that history plus its
own input. An entry belongs to the key its request came with (a hash of it: keys are never kept):
another key, even a valid one, finds nothing (404), as if the entry did not exist. With no API key
configured every request is the same owner. Entries live `ttl_s` seconds.

Size. An entry is kept as two compact JSON texts (UTF-8 bytes): the response, which GET answers
as is, and the conversation, parsed again only when a follow-up names it. Its size is the length of
those bytes plus `ENTRY_OVERHEAD` (the objects that hold them), so the byte bounds below bound the
memory the store holds. Counting a Python object tree's JSON length instead let 12 responses
counted as 64 MiB hold 1.09 GiB: an empty list is 2 bytes of JSON and 56 of memory.

Bounds, and who is evicted (the oldest first, always within one owner):
- per owner, at most `owner_count` entries and `owner_bytes`: an owner over its quota drops its own
  oldest entries, never another's;
- in all, at most `max_count` entries and `max_bytes`, a last resort (the defaults are two owners'
  quotas, and the gateway has at most two owners: the inference key and the admin key). Over it, the
  owner holding the most (entries, or bytes) drops its oldest, so an owner holding less than another
  is never touched: each of N busy owners keeps at least about 1/N of the store.
An entry bigger than an owner's whole byte quota is not kept (GET is then a 404).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pdserve.gateway.api.auth import request_key
from pdserve.json_types import Json

# Memory an entry holds besides its two JSON texts (about 450 bytes measured with tracemalloc): the two
# bytes objects' headers, the `Stored`, its id string and the two dicts' slots for it.
ENTRY_OVERHEAD = 512


@dataclass(frozen=True)
class StoreLimits:
    owner_count: int = 1000
    owner_bytes: int = 32 << 20
    max_count: int = 2000
    max_bytes: int = 64 << 20
    ttl_s: float = 3600.0


@dataclass(frozen=True)
class Stored:
    owner: str
    response_json: bytes  # the response object, as GET returns it
    messages_json: bytes  # the conversation up to and including this response, as chat messages
    size: int
    expires: float

    def messages(self) -> list[Json]:
        return list(json.loads(self.messages_json))


@dataclass
class _Owner:
    name: str  # its entries share this string
    rids: OrderedDict[str, None] = field(default_factory=OrderedDict)  # oldest first
    bytes: int = 0


def owner_of(headers: list[tuple[bytes, bytes]], keyed: bool) -> str:
    """Whom a stored response belongs to: the key the request carried (hashed), when keys are on."""
    key = request_key(headers) if keyed else None
    return "key:" + hashlib.sha256(key).hexdigest() if key else "open"


def _compact(value: Any) -> bytes:
    # "surrogatepass": json.loads(bytes) decodes with it too, so any str round-trips.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


class ResponseStore:
    def __init__(self, limits: StoreLimits = StoreLimits()) -> None:
        self.limits = limits
        self._entries: OrderedDict[str, Stored] = OrderedDict()  # oldest (first to expire) first
        self._owners: dict[str, _Owner] = {}
        self._bytes = 0
        # Parsing a request (which reads its previous response) may run on a thread.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def usage(self, owner: str) -> tuple[int, int]:
        """(entries, bytes) `owner` holds."""
        with self._lock:
            o = self._owners.get(owner)
            return (len(o.rids), o.bytes) if o else (0, 0)

    def put(self, rid: str, owner: str, response: Json, messages: list[Json]) -> None:
        resp, msgs = _compact(response), _compact(messages)
        size = len(resp) + len(msgs) + ENTRY_OVERHEAD
        lim = self.limits
        with self._lock:
            self._drop(rid)
            if size > lim.owner_bytes:
                return  # bigger than a whole quota: not kept (a GET is then a 404)
            now = time.monotonic()
            while self._entries and next(iter(self._entries.values())).expires <= now:
                self._drop(next(iter(self._entries)))
            mine = self._owners.setdefault(owner, _Owner(owner))
            self._entries[rid] = Stored(mine.name, resp, msgs, size, now + lim.ttl_s)
            mine.rids[rid] = None
            mine.bytes += size
            self._bytes += size
            while len(mine.rids) > lim.owner_count or mine.bytes > lim.owner_bytes:
                self._drop(next(iter(mine.rids)))
            while len(self._entries) > lim.max_count:
                self._drop_oldest_of(max(self._owners.values(), key=lambda o: len(o.rids)))
            while self._bytes > lim.max_bytes:
                self._drop_oldest_of(max(self._owners.values(), key=lambda o: o.bytes))

    def get(self, rid: str, owner: str) -> Stored | None:
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None or entry.owner != owner:
                return None
            if entry.expires <= time.monotonic():
                self._drop(rid)
                return None
            return entry

    def delete(self, rid: str, owner: str) -> bool:
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None or entry.owner != owner:
                return False
            self._drop(rid)
            return True

    def _drop_oldest_of(self, owner: _Owner) -> None:
        self._drop(next(iter(owner.rids)))

    def _drop(self, rid: str) -> None:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return
        self._bytes -= entry.size
        mine = self._owners[entry.owner]
        del mine.rids[rid]
        mine.bytes -= entry.size
        if not mine.rids:
            del self._owners[entry.owner]
