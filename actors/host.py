"""What a step ran under, for its `step-finished` event: whether the engine was still warming
up, and how busy the host was, so that a reader of the log can tell a busy machine from a
bad plan.

`cpu_share` is the process's CPU seconds (every thread's: the executor's, where the forward
runs, and the event loop's, where the request actors run) over the wall seconds the step
loop waited for the step: about 1 for one busy core; more where BLAS or MLX threads run
beside it; well under 1 where the machine's other processes took the cores. `load_avg` is
the machine's 1-minute load average, read at most every LOAD_EVERY_S (the kernel updates
it every 5 s; a read is a syscall, and steps come every few milliseconds).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

LOAD_EVERY_S = 0.5


@dataclass(frozen=True)
class StepConditions:
    """What one step ran under (`StepFinished`'s fields of the same names)."""

    # the step-time warm-up still had steps to measure (the engine's `warming_up`), or the
    # step-time model had no fit to plan by (the plan has no prediction)
    warming_up: bool = False
    cpu_share: float | None = None  # the process's CPU seconds over the step's wall seconds
    load_avg: float | None = None  # the machine's 1-minute load average when it ended


def _load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not on every platform
        return None


class HostMeter:
    """Measures the process's CPU share over a step (`start`, then `stop`) and reads the
    load average. One per step loop; not thread-safe."""

    def __init__(
        self,
        *,
        wall: Callable[[], float] = time.perf_counter,
        cpu: Callable[[], float] = time.process_time,
        load_avg: Callable[[], float | None] = _load_avg,
    ) -> None:
        self._wall, self._cpu, self._read_load = wall, cpu, load_avg
        self._started = (0.0, 0.0)  # wall and CPU clocks at `start`
        self._load: float | None = None  # the last load average read ...
        self._load_at = -LOAD_EVERY_S  # ... and when (wall clock)

    def start(self) -> None:
        """A step starts now."""
        self._started = (self._wall(), self._cpu())

    def stop(self, *, warming_up: bool) -> StepConditions:
        """The step that `start` began ended now: what it ran under."""
        wall, cpu = self._wall(), self._cpu()
        seconds = wall - self._started[0]
        if wall - self._load_at >= LOAD_EVERY_S:
            self._load, self._load_at = self._read_load(), wall
        return StepConditions(
            warming_up=warming_up,
            cpu_share=round((cpu - self._started[1]) / seconds, 3) if seconds > 0 else None,
            load_avg=self._load,
        )
