"""The waits between two tokens of a stream, as the summary reads them: their percentiles (the
inter-token latency), the longest (stalls), and what caused them (stalls.py's `StallBook`).

A wait is laid at the slowest step in it: each step's span (timeline.py) is kept, for the
latest steps only, until the waits that ran through it are seen.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence, Set

from stepline.events.models import StepFinished
from stepline.events.replay.stalls import StallBook, StallCause
from stepline.events.replay.stats import Percentiles, Report, TopK
from stepline.events.replay.timeline import StepSpan

_STALL_WINDOW = 4096  # steps looked back through for a stall's cause


class Stall(Report):
    """A long wait between two consecutive tokens of one request."""

    request_id: str
    seconds: float
    from_step: int
    to_step: int
    run: int = 1
    cause_step: int | None = None  # the slowest step in the wait
    cause: str | None = None  # what that step held and how long it took
    num_requests: int = 1  # requests that waited the same wait (`request_id` the first)


class Waits:
    """Every wait between two tokens (into `book`, with its cause), and the `top` longest."""

    def __init__(self, top: int) -> None:
        self.book = StallBook()
        # (request, seconds, from step, to step, run, slowest span, requests): made `Stall`s
        # at the end, when every span's time is known
        self.longest = TopK(top)
        self.start_run()

    def start_run(self) -> None:
        # The latest steps, to name the cause of a stall as it is seen (bounded memory).
        self.recent: deque[StepSpan] = deque(maxlen=_STALL_WINDOW)

    def planned(self, span: StepSpan) -> None:
        """A step planned: the one before, if unmeasured, took until this plan."""
        recent = self.recent
        if recent and recent[-1].estimated:  # no measurement: until this plan
            recent[-1].seconds = max(0.0, span.start - recent[-1].start)
        recent.append(span)

    def finished(self, event: StepFinished) -> StepSpan | None:
        """A step's measured time; returns its span (None: not the latest step planned)."""
        recent = self.recent
        span = recent[-1] if recent and recent[-1].step == event.step else None
        if span is not None:
            span.seconds, span.predicted, span.estimated = (
                event.seconds,
                event.predicted_seconds,
                False,
            )
        return span

    def sampled(
        self,
        run: int,
        ids: Sequence[str],
        step: int,
        ts: float,
        before: tuple[Set[str], float, int],
        num_on: int,
        resumed: Sequence[tuple[str, float, int]],
    ) -> None:
        """The waits of a decoding event (`ids` sampled at `ts`, in `step` of `run`), as
        `DecodingRows.feed` folded it: `num_on` requests of the decoding event `before` (its
        requests, ts and step) waited since it; each of `resumed` (request, wait, step of its
        token before) waited its own wait."""
        book, longest = self.book, self.longest
        prev_set, prev_ts, prev_step = before
        if num_on:
            gap = ts - prev_ts
            span = self.slowest(prev_step, step)
            book.wait(gap, num_on, self._cause(run, span), span.step if span else step)
            if longest.would_take(gap):  # one wait, named by its first request
                rid = next(r for r in ids if r in prev_set)
                longest.offer(gap, (rid, gap, prev_step, step, run, span, num_on))
        for rid, gap, last_step in resumed:
            span = self.slowest(last_step, step)
            book.wait(gap, 1, self._cause(run, span), span.step if span else step)
            if longest.would_take(gap):
                longest.offer(gap, (rid, gap, last_step, step, run, span, 1))

    def slowest(self, after: int, upto: int) -> StepSpan | None:
        """The slowest step in (after, upto] that the recent steps hold."""
        best = None
        for span in reversed(self.recent):
            if span.step <= after:
                break
            if span.step <= upto and (best is None or span.seconds > best.seconds):
                best = span
        return best

    def _cause(self, run: int, span: StepSpan | None) -> int:
        if span is None or span.cause is None:
            return -1
        return self.book.cause_index(run, span.cause)

    def percentiles(self) -> Percentiles:
        """Of every wait: the inter-token latency."""
        return self.book.percentiles()

    def threshold(self) -> float:
        """Waits over this are stalls (`StallBook.threshold`)."""
        return self.book.threshold()

    def by_cause(self, top: int, *, only: tuple[int, str] | None = None) -> list[StallCause]:
        """Stalls added up per cause (`StallBook.by_cause`)."""
        return self.book.by_cause(top, only=only)

    def stalls(self) -> tuple[Stall, ...]:
        """The longest waits, longest first."""
        return tuple(_stall(*item) for item in self.longest.items())


def _stall(
    rid: str, seconds: float, a: int, b: int, run: int, cause: StepSpan | None, n: int
) -> Stall:
    return Stall(
        request_id=rid,
        num_requests=n,
        seconds=seconds,
        from_step=a,
        to_step=b,
        run=run,
        cause_step=None if cause is None else cause.step,
        cause=None if cause is None else cause.describe(),
    )
