"""What both ends' I/O threads keep alike: their rooms, what the caller sees of them, and closing pairs.

`RoomBook` is the base of the sender's and the receiver's I/O state (sender_io.py, receiver_io.py):
every room enters, moves and finishes through it, so that `Endpoint.state()` and `Endpoint.poll()`
always agree with the rooms. Only the I/O thread calls it.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from typing_extensions import Unpack

from pdserve.kv_transfer.endpoint import Endpoint
from pdserve.kv_transfer.io_loop import EndpointIO, P
from pdserve.kv_transfer.pair_thread import PairThread
from pdserve.kv_transfer.state import Outcome, TransferResult, TransferRoom, TransferState

R = TypeVar("R", bound=TransferRoom)


class RoomBook(EndpointIO[P], Generic[R, P]):
    """An endpoint's I/O state: its rooms of type R, keyed by room id, and its peers named by P."""

    def __init__(self, owner: Endpoint) -> None:
        super().__init__(owner._mailbox)
        self._owner = owner
        self.cfg = owner._config
        self.rooms: dict[str, R] = {}
        # Closed pairs whose threads may still be finishing; joined at shutdown so that no pair thread
        # is torn down inside a process group's destructor at interpreter exit.
        self.closing: list[PairThread[Any]] = []

    def enter(self, room: R) -> None:
        self.rooms[room.room] = room
        self._owner._states[room.room] = room.state

    def move(self, room: R, state: TransferState, timeout_s: float | None = None) -> None:
        room.transition(state, timeout_s)
        self._owner._states[room.room] = state

    def finish(
        self, room: R, state: TransferState, error: str | None = None, **outcome: Unpack[Outcome]
    ) -> None:
        """End `room` in `state` (SUCCESS or FAILED) and queue its result for poll()."""
        room.transition(state)
        self.rooms.pop(room.room, None)
        self._owner._states.pop(room.room, None)
        self._owner._publish(room.result(error, **outcome))

    def refuse(self, name: str, error: str) -> None:
        """A call for room `name` that cannot enter (a duplicate): its FAILED result, at once."""
        self._owner._publish(TransferResult(name, TransferState.FAILED, None, error, 0, 0.0))

    def retire(self, pair: PairThread[Any]) -> None:
        """Stop `pair`'s thread; it is joined at shutdown."""
        pair.close()
        self.closing = [p for p in self.closing if p.alive] + [pair]

    def join_closing(self) -> None:
        for pair in self.closing:
            pair.join(timeout_s=2.0)
