"""Turns on the one executor thread for the step loops of several models (a server of several
models, api/pool.py): a loop runs its executor work (a step, housekeeping, a warm-up turn)
only in its turn, and turns go round robin between the loops that wait for one
(`model_policy.next_turn`). One loop alone never waits."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio

from stepline.actors.scheduler.model_policy import next_turn


class Turns:
    def __init__(self, order: Sequence[str] = ()):
        self.order = tuple(order)  # the configured models, in order
        self._waiting: dict[str, anyio.Event] = {}  # model -> set when its turn comes
        self._holder: str | None = None  # whose work runs now
        self._last: str | None = None  # whose work ran last

    def others_waiting(self, model: str) -> bool:
        """Whether another model waits for a turn (read by a warm-up on the executor thread,
        which then ends its turn at its next step)."""
        return any(m != model for m in tuple(self._waiting))

    @asynccontextmanager
    async def turn(self, model: str) -> AsyncIterator[None]:
        """Hold the executor's turn for `model` in the block: wait while another model holds
        it or comes before it."""
        if self._holder is None and not self._waiting:
            self._holder = model
        else:
            granted = self._waiting[model] = anyio.Event()
            try:
                await granted.wait()
            except BaseException:
                self._waiting.pop(model, None)
                if self._holder == model:  # granted as it was cancelled: pass it on
                    self._pass_on()
                raise
        try:
            yield
        finally:
            self._pass_on()

    def _pass_on(self) -> None:
        self._last, self._holder = self._holder, None
        following = next_turn(self._waiting.keys(), self.order, self._last)
        if following is not None:
            self._holder = following
            self._waiting.pop(following).set()
