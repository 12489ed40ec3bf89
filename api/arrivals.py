"""Requests on their way to an engine: counted from when a caller starts preparing one
(parsing, tokenizing) until `Engine.submit` hands it to the step loop, so that an idle
engine waits briefly for a burst before its first step (actors/step_loop.py, `Arriving`).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

from stepline.actors.messages import Arrived, Arriving


class Arrival:
    """A request on its way to the engine (`Engine.arriving`): the step loop counts it from
    here (an `Arriving` message) until `submit` hands it over or `done()` (`Arrived`)."""

    def __init__(self, post: Callable[[Any], None]):
        self._post = post
        self.open = True
        post(Arriving())

    def done(self) -> None:
        """End the count (once); `submit` does, once the request is in the step loop's inbox."""
        if self.open:
            self.open = False
            self._post(Arrived())


class TaskArrivals:
    """The arrivals of callers that do not hold their count (`Engine.arriving` then
    `arrived()`, api/pool.py), by the task that counted it: `submit` in that task ends it."""

    def __init__(self, post: Callable[[Any], None]):
        self._post = post
        self._by_task: weakref.WeakKeyDictionary[asyncio.Task, Arrival] = (
            weakref.WeakKeyDictionary()
        )

    def arriving(self) -> Arrival:
        arrival = Arrival(self._post)
        if (task := asyncio.current_task()) is not None:
            self._by_task[task] = arrival
        return arrival

    def take(self) -> Arrival | None:
        """This task's open count, no longer this task's to end."""
        task = asyncio.current_task()
        arrival = self._by_task.pop(task, None) if task is not None else None
        return arrival if arrival is not None and arrival.open else None
