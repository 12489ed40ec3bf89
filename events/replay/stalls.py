"""Decoding rows in bulk, and stalls added up per causing request.

A busy engine's log holds a row per decoding request per step, yet from one step to the next
most rows belong to the same requests. `DecodingRows` folds a run's `decoding` events a step
at a time by what changed: a request sampled in this step and the one before it waited
exactly the time between them, so those rows are counted, not visited; only requests that
start, resume or stop a streak are handled one by one. What it folds agrees with `apply`
(tests/test_replay_bulk.py checks it on every log the tests write).

`StallBook` keeps, per wait between two tokens, the wait and the step that caused it; at the
end, with the run's gaps known, the waits over the stall threshold (timeline.py's: three times
the median gap, at least a millisecond) are added up per cause: the request whose prompt
chunk (or image) was the biggest in the slowest step of the wait. Memory: a few bytes per
step, not per row.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field

from stepline.events.replay.stats import Percentiles, Report, TopK, weighted_percentiles
from stepline.events.replay.timeline import DEFAULT_STALL_FACTOR, MIN_STALL_S

NO_CAUSE = ""  # the cause of a wait whose slowest step ran no prompt work


@dataclass(slots=True)
class Streak:
    """A request's tokens so far: what `DecodingRows` knows of it."""

    num_tokens: int = 0  # in its ended streaks (and extra rows of any step)
    start: int = -1  # the decoding event its current streak began at (-1: none)
    first_ts: float | None = None
    last_ts: float = 0.0  # its last token, as of its last ended streak
    last_step: int = 0


class DecodingRows:
    """One run's decoding rows, folded a step at a time by what changed since the step
    before (see the module's docstring)."""

    def __init__(self) -> None:
        self.streaks: dict[str, Streak] = {}
        self.index = -1  # decoding events seen, minus one
        self.prev_ids: tuple[str, ...] = ()
        self.prev_set: frozenset[str] | set[str] = frozenset()
        self.prev_ts = 0.0
        self.prev_step = 0
        self.prev_extra: list[tuple[str, int]] = []  # its requests with several rows: extra
        self.num_rows = 0

    def feed(
        self, ids: tuple[str, ...], ts: float, step: int
    ) -> tuple[list[str], list[tuple[str, float, int]], int]:
        """Fold one decoding event's rows. Returns (the requests whose first token this is, in
        log order; those that resume after a pause, each with its wait and the step of its
        token before; how many requests go on from the decoding event before, each having
        waited `ts - prev_ts`). Read `prev_ts` and `prev_step` before calling."""
        self.index += 1
        self.num_rows += len(ids)
        streaks = self.streaks
        if ids == self.prev_ids:
            for rid, extra in self.prev_extra:
                streaks[rid].num_tokens += extra
            self.prev_ts, self.prev_step = ts, step
            return [], [], len(self.prev_set)
        cur = set(ids)
        self.prev_extra = []
        if len(cur) != len(ids):  # a request with several tokens in one step
            self.prev_extra = [(rid, n - 1) for rid, n in Counter(ids).items() if n > 1]
            for rid, extra in self.prev_extra:
                streaks.setdefault(rid, Streak()).num_tokens += extra
        prev = self.prev_set
        started = cur - prev
        for rid in prev - cur:
            s = streaks[rid]
            s.num_tokens += self.index - s.start
            s.start = -1
            s.last_ts, s.last_step = self.prev_ts, self.prev_step
        firsts: list[str] = []
        resumed: list[tuple[str, float, int]] = []
        if started:
            for rid in dict.fromkeys(ids):
                if rid not in started:
                    continue
                s = streaks.get(rid) or streaks.setdefault(rid, Streak())
                if s.first_ts is None:
                    s.first_ts = ts
                    firsts.append(rid)
                else:
                    resumed.append((rid, ts - s.last_ts, s.last_step))
                s.start = self.index
        self.prev_ids, self.prev_set, self.prev_ts, self.prev_step = ids, cur, ts, step
        return firsts, resumed, len(cur) - len(started)

    def num_tokens(self, rid: str) -> int:
        """The request's tokens so far."""
        s = self.streaks.get(rid)
        if s is None:
            return 0
        return s.num_tokens + (self.index - s.start + 1 if s.start >= 0 else 0)

    def last(self, rid: str) -> tuple[float, int] | None:
        """(ts, step) of the request's last token; None before its first."""
        s = self.streaks.get(rid)
        if s is None or s.first_ts is None:
            return None
        return (self.prev_ts, self.prev_step) if s.start >= 0 else (s.last_ts, s.last_step)

    def end(self, rid: str) -> Streak | None:
        """Forget the request (it ended), returning its streak with `num_tokens` its total
        and `last_ts`/`last_step` its last token's."""
        s = self.streaks.pop(rid, None)
        if s is None:
            return None
        if s.start >= 0:
            s.num_tokens += self.index - s.start + 1
            s.last_ts, s.last_step = self.prev_ts, self.prev_step
            s.start = -1
            self.prev_set = set(self.prev_set) - {rid}
            self.prev_ids = ()  # the next event is compared by sets
        return s


class StallCause(Report):
    """A request whose prompt work made other requests' streams stall, added up."""

    request_id: str | None  # None: slow steps with no prompt work (a busy host?)
    run: int = 1
    num_stalls: int  # waits over the threshold it caused (one per stalled request and wait)
    seconds: float  # those waits, in total
    num_steps: int  # distinct steps of its that were the slowest of a stalled wait
    worst_step: int | None = None  # its step behind the longest of those waits
    worst_s: float = 0.0


@dataclass(slots=True)
class _Cause:
    name: str
    run: int
    steps: set[int] = field(default_factory=set)


class StallBook:
    """Every wait between two tokens, with its cause; added up per cause at the end."""

    def __init__(self) -> None:
        self.waits = array("d")  # per recorded wait: seconds,
        self.counts = array("q")  # how many requests waited it,
        self.causes = array("l")  # its cause (index into `names`; -1: unknown),
        self.cause_steps = array("l")  # and the step that caused it
        self.names: list[_Cause] = []
        self._percentiles: Percentiles | None = None  # once the run is read
        self._index: dict[tuple[int, str], int] = {}

    def cause_index(self, run: int, name: str) -> int:
        key = (run, name)
        i = self._index.get(key)
        if i is None:
            i = self._index[key] = len(self.names)
            self.names.append(_Cause(name, run))
        return i

    def wait(self, seconds: float, count: int, cause: int, step: int) -> None:
        """`count` requests waited `seconds` between two tokens, for `cause` (at `step`)."""
        if count <= 0:
            return
        self.waits.append(seconds)
        self.counts.append(count)
        self.causes.append(cause)
        self.cause_steps.append(step)

    def threshold(self, stall_s: float | None = None) -> float:
        """The stall threshold: `stall_s`, else three times the median wait (at least 1 ms)."""
        if stall_s is not None:
            return stall_s
        median = self.percentiles().p50
        return max(MIN_STALL_S, DEFAULT_STALL_FACTOR * median) if median is not None else 0.0

    def percentiles(self) -> Percentiles:
        """Of every wait (the inter-token gaps), each counted as often as it was waited: as
        `Distribution` gives them (interpolated between samples), from the recorded waits."""
        if self._percentiles is None:
            self._percentiles = weighted_percentiles(self.waits, self.counts)
        return self._percentiles

    def by_cause(
        self, top: int, stall_s: float | None = None, *, only: tuple[int, str] | None = None
    ) -> list[StallCause]:
        """The `top` causes by stalled seconds, biggest first (with `only`: that (run, request
        id)'s, if it caused any)."""
        limit = self.threshold(stall_s)
        wanted = None
        if only is not None:
            wanted = self._index.get(only)
            if wanted is None:
                return []
        num: Counter[int] = Counter()
        total: dict[int, float] = {}
        worst: dict[int, tuple[float, int]] = {}
        steps: dict[int, set[int]] = {}
        for seconds, count, cause, step in zip(
            self.waits, self.counts, self.causes, self.cause_steps, strict=True
        ):
            if seconds < limit or limit <= 0 or (wanted is not None and cause != wanted):
                continue
            num[cause] += count
            total[cause] = total.get(cause, 0.0) + seconds * count
            steps.setdefault(cause, set()).add(step)
            if seconds > worst.get(cause, (0.0, 0))[0]:
                worst[cause] = (seconds, step)
        best = TopK(top)
        for cause, seconds in total.items():
            best.offer(seconds, cause)
        out = []
        for cause in best.items():
            c = self.names[cause] if cause >= 0 else None
            name = c.name if c is not None else NO_CAUSE
            out.append(
                StallCause(
                    request_id=name or None,
                    run=c.run if c is not None else 1,
                    num_stalls=num[cause],
                    seconds=total[cause],
                    num_steps=len(steps[cause]),
                    worst_step=worst[cause][1],
                    worst_s=worst[cause][0],
                )
            )
        return out
