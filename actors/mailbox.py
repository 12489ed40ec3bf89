"""An actor's inbox for messages that come every step.

anyio's memory object streams (the step loop's own inbox) yield to the event loop on
every `receive`, before looking for a message: two event-loop turns per message, ~27 µs
of the asyncio thread per token where a step loop feeds 32 request actors and their
clients, against ~5.5 µs through `asyncio.Queue`, which this wraps (measured on a 2-core
x86 box). Unbounded: the step loop must never wait on an actor, and gets at most one
message per request per step to it; an actor never waits on anything but its inbox.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

import anyio

T = TypeVar("T")

_END = object()  # what `close` leaves in the queue: nothing follows


class Mailbox(Generic[T]):
    """`put` never waits, and says whether the mailbox is still open; `get` waits for the
    next message and raises anyio.EndOfStream once the mailbox is closed and empty. Either
    side closes it: the receiver when its actor is gone (puts then fail), the sender when
    nothing more will come."""

    __slots__ = ("_queue", "closed")

    def __init__(self) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    def put(self, msg: T) -> bool:
        if self.closed:
            return False
        self._queue.put_nowait(msg)
        return True

    async def get(self) -> T:
        msg = await self._queue.get()
        return self._unwrap(msg)

    def get_nowait(self) -> T:
        """The next message if there is one; raises anyio.WouldBlock if none has come yet."""
        try:
            msg = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            raise anyio.WouldBlock from None
        return self._unwrap(msg)

    def empty(self) -> bool:
        """Whether no message is waiting (then `get_nowait` would raise)."""
        return self._queue.empty()

    def _unwrap(self, msg: object) -> T:
        if msg is _END:
            self._queue.put_nowait(_END)  # every later `get` ends too
            raise anyio.EndOfStream
        return msg  # type: ignore[return-value]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait(_END)
