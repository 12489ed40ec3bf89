"""Turns on the one executor thread for the step loops of several models (a server of several
models, api/pool.py): a loop runs its executor work (a step, housekeeping, a warm-up turn)
only in its turn, and turns go round robin between the loops that wait for one
(`model_policy.next_turn`). One loop alone never waits.

A model loading beside others takes turns too: its load's MLX work is a generator of short
steps (api/engine_parts.py), and `steps_for_turn` runs as many of them in one turn as fit a
budget while another model waits, all of them while none does."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio

from stepline.actors.scheduler.model_policy import next_turn

# A load's turn runs its steps for about this long while another model waits for a turn
# (`steps_for_turn`): the other model's streams pause for one turn (issue 54: a load may
# stall them 0.3 s at most), and each turn costs the load one of their steps, so a turn of
# one short step (~50 ms) would leave a load waiting most of its time.
LOAD_TURN_S = 0.15


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


class Seat:
    """One step loop's way to the executor: its jobs run in its model's turn where several
    models share the executor (`Turns`; alone, or with no model name, it takes none)."""

    def __init__(self, executor: Any, turns: Turns | None, model: str | None):
        self.executor = executor
        self._turns = turns if model is not None else None
        self._model = model or ""
        self._held = False  # this loop holds its turn (`turn`)

    @property
    def shared(self) -> bool:
        """Whether other models' loops take turns on the executor with this one."""
        return self._turns is not None

    def others_waiting(self) -> bool:
        """Whether another model waits for its turn (read on the executor thread too)."""
        return self._turns is not None and self._turns.others_waiting(self._model)

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """This model's turn in the block (a step and its housekeeping: another model's step
        never comes between them); `call` then takes none of its own."""
        if self._turns is None or self._held:
            yield
            return
        async with self._turns.turn(self._model):
            self._held = True
            try:
                yield
            finally:
                self._held = False

    async def call(self, fn: Callable, *args: Any, after: Callable[[], None] | None = None) -> Any:
        """`fn(*args)` on the executor, in this model's turn (`Executor.call`, which raises
        ExecutorDeadError once it failed)."""
        async with self.turn():
            return await self.executor.call(fn, *args, after=after)

    def look_ahead(self, ahead: Callable[[], None] | None) -> Callable[[], None] | None:
        """What the executor runs after a step (`Executor.call`'s `after`): the runner's
        look-ahead `ahead`. Where several models share the executor, none while another
        model waits for its turn when the step ends (read on the executor thread): its step
        goes first, and this model's next step computes its own forward (on the CPU backend
        the look-ahead's forward runs before the turn passes)."""
        if ahead is None or self._turns is None:
            return ahead

        def ahead_unless_waited_for() -> None:
            if not self.others_waiting():
                ahead()

        return ahead_unless_waited_for


def steps_for_turn(
    steps: Generator[None, None, Any],
    others_waiting: Callable[[], bool],
    budget_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[bool, Any]:
    """One turn of generator `steps` (a load's MLX work, on the executor thread): its next
    step, then the next while no other model waits for a turn (`others_waiting`) or while
    the turn, with one more step as long as the last, stays within `budget_s`. Returns
    (True, what it returned) once it ended, else (False, None)."""
    start = clock()
    while True:
        began = clock()
        try:
            next(steps)
        except StopIteration as done:
            return True, done.value
        now = clock()
        if others_waiting() and now - start + (now - began) > budget_s:
            return False, None
