"""Errors that repeat, logged at most once an interval with a count of those left out: an
accept error at the open-file limit repeats for every connection attempt, a prefix-cache
write on a full disk for every entry (147 warnings in 40 s), and logged each time they fill
the disk they complain about. MLX-free."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable


class Throttle:
    """Says whether an error of a kind (`key`) may be logged now: at most once per
    `interval_s` for each kind. Not thread-safe: one owner (a thread, an event loop)."""

    def __init__(self, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[Hashable, float] = {}  # kind -> when it was last logged
        self._left_out: dict[Hashable, int] = {}  # kind -> how many since then

    def admit(self, key: Hashable) -> int | None:
        """None: leave this one out (it is counted). Else log it, with the returned count of
        those of its kind left out since the last one logged."""
        now = self._clock()
        if now - self._last.get(key, -float("inf")) < self.interval_s:
            self._left_out[key] = self._left_out.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._left_out.pop(key, 0)
