"""Which order a decode-only step runs in, chosen by measuring both (pure: no MLX, no clock).

A step with nothing but decode rows builds the next step's forward on its own tokens before
it reads them (`LookAhead.pipeline`, as mlx-lm's own loop does), and then either starts
it before reading them too, or starts it as its result goes back (`LookAhead.start`).
Which is faster depends on the machine and the model:
- where starting work returns at once (Metal), the first order hides the host's whole round
  trip (the step loop committing and planning) and leaves no gap on the device;
- on Linux's CPU backend, starting work returns only once it is nearly done, and the first
  order exposes the round trip. Measured on a 2-core CPU (3 runs each, tokens/s against
  mlx-lm's BatchGenerator at batch 1/8/32), when the second order still read the tokens
  before building the next forward: stepline-demo-large 0.96/0.97/0.87 with the first
  order, 0.83/0.87/0.72 with the second; the small hybrid demo, whose steps take a few
  milliseconds, 0.77/0.61/0.60 and 0.95/0.66/0.66. Building before reading made the
  second order 7%, 16-18% and 7% faster on stepline-demo at batch 1, 8 and 32 (the
  building overlaps the last of the tokens' computation), and changed nothing beyond the
  noise on the hybrid demo (paired runs in one process, 5 of each).

So each batch size tries both, in blocks of `BLOCK_STEPS` steps in the order first, second,
second, first (a context that grows, or a neighbour's load that rises, then slows both
alike), leaving out each block's first step (it inherits the other order's pipeline). It
keeps the order with the shorter median step period (from one step's start to the next's)
and tries again after `RETRY_STEPS` steps of that size.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

BLOCK_STEPS = 8
RETRY_STEPS = 512
_TRIAL = (True, False, False, True)  # each block's order: pipelined or not


@dataclass
class _Trial:
    periods: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    steps: int = 0  # steps of this batch size since the trial began
    choice: bool | None = None  # the faster order, once the trial is over


@dataclass
class DecodeOrder:
    """`pipelined(rows)`: whether the next decode-only step of `rows` rows starts the next
    forward before reading its tokens; `record` feeds back each such step's period. The
    runner calls `start` as each such step starts (it does both), and `interrupt` for any
    other step. `fixed` pins the choice (tests)."""

    block_steps: int = BLOCK_STEPS
    retry_steps: int = RETRY_STEPS
    fixed: bool | None = None
    _trials: dict[int, _Trial] = field(default_factory=dict)
    _last: tuple[float, int, bool] | None = None  # the last step's (start, rows, order)

    def start(self, rows: int, now: float) -> bool:
        """A decode-only step of `rows` rows starts at `now` (seconds): record the last
        step's period if it was one too, and choose this one's order."""
        if self._last is not None:
            start, last_rows, last_order = self._last
            self.record(last_rows, last_order, now - start)
        pipelined = self.pipelined(rows)
        self._last = (now, rows, pipelined)
        return pipelined

    def interrupt(self) -> None:
        """A step that is not a decode-only one: the last one's period is not measured."""
        self._last = None

    @property
    def trial_steps(self) -> int:
        return self.block_steps * len(_TRIAL)

    def pipelined(self, rows: int) -> bool:
        if self.fixed is not None:
            return self.fixed
        trial = self._trials.setdefault(rows, _Trial())
        if trial.steps >= self.retry_steps:
            trial = self._trials[rows] = _Trial()
        if trial.steps < self.trial_steps:
            return _TRIAL[trial.steps // self.block_steps]
        if trial.choice is None:
            trial.choice = self._median(trial, True) <= self._median(trial, False)
        return trial.choice

    def record(self, rows: int, pipelined: bool, seconds: float) -> None:
        """A decode-only step of `rows` rows, run in the order `pipelined`, took `seconds`
        from its start to the next step's start."""
        trial = self._trials.setdefault(rows, _Trial())
        position, trial.steps = trial.steps, trial.steps + 1
        if position < self.trial_steps and position % self.block_steps:
            trial.periods[pipelined].append(seconds)

    @staticmethod
    def _median(trial: _Trial, order: bool) -> float:
        periods = trial.periods[order]
        return statistics.median(periods) if periods else float("inf")
