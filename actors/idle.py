"""What a step loop does while it has nothing to run: the step-time model's warm-up
(actors/scheduler/warmup.py), in turns that end as soon as work arrives, and giving the C
heap's free memory back to the system (engine/heap.py). Both run on the executor, through
the loop's `call` (None once the executor failed: the loop is dead then)."""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog

from stepline.actors.scheduler.core import SchedulerCore
from stepline.actors.scheduler.warmup import Warmup
from stepline.engine import heap

log = structlog.get_logger(__name__)

# A loop that never goes idle gives the C heap's free memory back this often (`trim_heap`).
TRIM_EVERY_S = 60.0

Call = Callable[..., Awaitable[Any]]


class IdleWork:
    def __init__(self, warmup: Warmup | None):
        self.warmup = warmup  # None: none to run (or no more)
        self.warming = False  # a turn of the warm-up is on the executor
        self._turn_over = threading.Event()  # set: the executor ends the turn at its next step
        self._trimmed_at = time.monotonic()  # when `trim_heap` last trimmed ...
        self._trimmed_at_seq = 0  # ... and the core's last event then

    async def warm_up(self, core: SchedulerCore, call: Call, wanted: Callable[[], bool]) -> None:
        """A turn of the warm-up, until it is done or `wanted()` (read on the executor thread,
        between two of its steps: a message for the loop, another model's turn). Its samples
        seed the cost model it was made for; all of them are kept for the next start."""
        warmup = self.warmup
        assert warmup is not None
        model = core.cost_model
        over = self._turn_over = threading.Event()

        def stop() -> bool:  # on the executor thread: reads counters only
            return over.is_set() or wanted()

        self.warming = True
        try:
            samples = await call(warmup.run, stop)
        finally:
            over.set()  # cancelled: the executor's turn ends at its next step
            self.warming = False
        if samples is None:  # the executor died (the loop is dead now)
            self.warmup = None
            return
        for report in warmup.take_prefix_reports():  # a disk write that ended meanwhile
            core.apply_prefix_report(report)
        if model is None or model is not core.cost_model:  # replaced: not its seed
            self.warmup = None
            return
        for sample in samples:
            model.seed(sample.features, sample.seconds)
        if warmup.done:
            self.warmup = None
            await anyio.to_thread.run_sync(warmup.keep)
            log.info("warmup_measured", samples=len(warmup.samples), turns=warmup.num_turns)

    def end_warm_up(self) -> None:
        """No more warm-up: a turn on the executor ends at its next step, none starts again."""
        self.warmup = None
        self._turn_over.set()

    async def trim_heap(self, seq: int, call: Call, *, idle: bool) -> bool:
        """Give the C heap's free memory back, on the executor's thread, if the core's events
        moved on (to `seq`) since the last time: once when the loop goes `idle` after work,
        and every TRIM_EVERY_S while it never does. Without it RSS stays at a burst's
        high-water mark. Returns whether it trimmed."""
        now = time.monotonic()
        if seq == self._trimmed_at_seq or not (idle or now - self._trimmed_at >= TRIM_EVERY_S):
            return False
        self._trimmed_at, self._trimmed_at_seq = now, seq
        return bool(await call(heap.trim))
