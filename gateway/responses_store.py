"""Stored responses of /v1/responses (`store`, the default): what GET and DELETE /v1/responses/{id}
read, and what `previous_response_id` continues.

Each entry keeps the response object and the whole conversation up to it as chat messages (the
input of every earlier turn, then this turn's output), so a follow-up turn is that history plus its
own input. The store is bounded: at most `max_count` entries and `max_bytes` of them (the oldest go
first), each for `ttl_s` seconds. An entry belongs to the key its request came with (a hash of it:
keys are never kept): another key, even a valid one, finds nothing (404), as if the entry did not
exist. With no API key configured every request is the same owner.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pdserve.gateway.auth import request_key

MAX_RESPONSES = 1000
MAX_BYTES = 64 << 20
TTL_S = 3600.0

Json = dict[str, Any]


@dataclass(frozen=True)
class Stored:
    owner: str
    response: Json
    messages: list[Json]  # the conversation up to and including this response, as chat messages
    size: int
    expires: float


def owner_of(headers: list[tuple[bytes, bytes]], keyed: bool) -> str:
    """Whom a stored response belongs to: the key the request carried (hashed), when keys are on."""
    key = request_key(headers) if keyed else None
    return "key:" + hashlib.sha256(key).hexdigest() if key else "open"


class ResponseStore:
    def __init__(self, max_count: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES, ttl_s: float = TTL_S):
        self.max_count, self.max_bytes, self.ttl_s = max_count, max_bytes, ttl_s
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        # Parsing a request (which reads its previous response) may run on a thread.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, rid: str, owner: str, response: Json, messages: list[Json]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(messages))
        if size > self.max_bytes:
            return  # bigger than the whole store: not kept (a GET is then a 404)
        with self._lock:
            now = time.monotonic()
            while self._entries and next(iter(self._entries.values())).expires <= now:  # oldest first
                self._drop(next(iter(self._entries)))
            self._drop(rid)
            self._entries[rid] = Stored(owner, response, messages, size, now + self.ttl_s)
            self._bytes += size
            while len(self._entries) > self.max_count or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

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

    def _drop(self, rid: str) -> None:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self._bytes -= entry.size
