"""Which order a decode-only step runs in, chosen by measuring both (pure: no MLX, no clock).

A step with nothing but decode rows can start the next step's forward before it reads its
own tokens (`ModelRunner._pipeline`, mlx-lm's own order) or read them first and start the
next forward as its result goes back (`ModelRunner.look_ahead`). Which is faster depends on
the machine and the model:
- where starting work returns at once (Metal), the first order hides the host's whole round
  trip (the step loop committing and planning) and leaves no gap on the device;
- on Linux's CPU backend, starting work returns only once it is nearly done, so the first
  order hides the graph building but not the round trip, and the second the other way
  round. Measured on a 2-core CPU: 7-10% faster for stepline-demo-large at batch 1 and 8,
  20-30% slower for the small hybrid demo, whose steps take a few milliseconds.

So each batch size tries both for `TRIAL_STEPS` steps, keeps the one with the shorter median
step period (the time from one step's start to the next's), and tries again after
`RETRY_STEPS` steps of that size (contexts grow, other load comes and goes).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

TRIAL_STEPS = 8
RETRY_STEPS = 512


@dataclass
class _Trial:
    periods: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    steps: int = 0  # steps of this batch size since the trial began


@dataclass
class DecodeOrder:
    """`pipelined(rows)`: whether the next decode-only step of `rows` rows starts the next
    forward before reading its tokens; `record` feeds back each such step's period. `fixed`
    pins the choice (tests)."""

    trial_steps: int = TRIAL_STEPS
    retry_steps: int = RETRY_STEPS
    fixed: bool | None = None
    _trials: dict[int, _Trial] = field(default_factory=dict)

    def pipelined(self, rows: int) -> bool:
        if self.fixed is not None:
            return self.fixed
        trial = self._trials.setdefault(rows, _Trial())
        if trial.steps >= self.retry_steps:
            trial = self._trials[rows] = _Trial()
        for order in (True, False):  # each order's trial first, pipelined first
            if len(trial.periods[order]) < self.trial_steps:
                return order
        return self._median(trial, True) <= self._median(trial, False)

    def record(self, rows: int, pipelined: bool, seconds: float) -> None:
        """A decode-only step of `rows` rows, run in the order `pipelined`, took `seconds`
        from its start to the next step's start."""
        trial = self._trials.setdefault(rows, _Trial())
        trial.steps += 1
        periods = trial.periods[pipelined]
        if len(periods) < self.trial_steps:
            periods.append(seconds)

    @staticmethod
    def _median(trial: _Trial, order: bool) -> float:
        return statistics.median(trial.periods[order])
