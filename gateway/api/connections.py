"""HTTP connections that cannot be held open for nothing.

uvicorn times out a keep-alive connection between requests, but not a new one that never completes
its request headers (a "slowloris" client trickling a header a minute holds its socket for ever).
`IdleTimeoutProtocol` closes any connection that has no request in progress for `idle_timeout_s`:
a fresh connection without complete headers, a keep-alive one between requests, or a next request's
headers arriving too slowly. A request in progress is left to the handlers' own limits (the body
timeout, the request timeout).

It also turns off Nagle's algorithm on every connection. asyncio does that only for sockets whose
protocol number is IPPROTO_TCP, and the gateway's listening socket (`socket.create_server`) has 0, as
its accepted sockets then do. uvicorn writes a response's headers and its body separately, so on a
keep-alive connection the body waited for the client's delayed ACK: 44 ms for `/v1/models` on the
second request of a connection, 1.5 ms on the first.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


class IdleTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with the idle timer armed from the first byte; the timeout is the
    config's `timeout_keep_alive`."""

    _idle_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = self.loop.call_later(self.timeout_keep_alive, self._idle)

    def _idle(self) -> None:
        self._idle_timer = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if not busy and not self.transport.is_closing():
            self.transport.close()


def raise_open_files_limit() -> int:
    """Lift the soft limit on open files to the hard one (every connection is a file); the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit from %d: %s", soft, e)
    return soft
