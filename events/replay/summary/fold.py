"""The summary's fold: one pass over a log's events, each handed to the parts it concerns.

Each part is the one owner of its figures (and of the report it makes of them):
- `Requests` (requests.py): outcomes, latencies, the requests left unfinished, next turns;
- `TokenTotals` (requests.py): token totals and prefix-cache misses;
- `Waits` (waits.py): the waits between tokens, stalls and their causes;
- `StepShapes` and `StepClock` (steps.py): what the steps held and how long they took;
- `DraftTally` (drafts.py) and `LoadTracker` (loads.py): drafts, and a model's loads;
- for `request_why`, the `Focus` that follows one request (why.py).

The fold itself keeps the log's own counts (events, steps, runs, first and last times) and a
run's decoding rows (stalls.py's `DecodingRows`), which requests and waits both read. Each
run starts afresh (requests, steps and sequence numbers start again in a run).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from stepline.events.log import LogRun
from stepline.events.models import (
    Admitted,
    ChunkPrefilled,
    ImageEncoded,
    LogHeader,
    ModelLoaded,
    StepFinished,
    StepPlanned,
    Terminal,
    TokensSampled,
)
from stepline.events.replay.stalls import DecodingRows
from stepline.events.replay.stats import Report
from stepline.events.replay.summary.drafts import DraftTally
from stepline.events.replay.summary.loads import LoadTracker
from stepline.events.replay.summary.requests import Requests, TokenTotals
from stepline.events.replay.summary.steps import StepClock, StepShapes
from stepline.events.replay.summary.waits import Waits
from stepline.events.replay.timeline import step_span
from stepline.events.replay.why import Focus

Progress = Callable[[int], None]


class RunOverview(Report):
    index: int
    run_id: str | None
    created: float
    model: str | None
    log_prompts: bool
    log_outputs: bool
    num_events: int
    num_steps: int
    num_requests: int
    outcomes: dict[str, int]


class Summariser:
    """Accumulates over the whole log; per-run state is reset at each run's start. Takes
    validated events or scan.py's light ones (it reads fields and dispatches on `type`)."""

    def __init__(self, top: int, focus: Focus | None = None) -> None:
        self.top = top
        self.focus = focus  # a request to note the why of (`request_why`)
        self.requests = Requests()
        self.tokens = TokenTotals()
        self.waits = Waits(top)
        self.shapes = StepShapes()
        self.clock = StepClock(top)
        self.drafts = DraftTally()
        self.loads = LoadTracker()
        self.num_events = self.num_steps = 0
        self.first_ts: float | None = None
        self.last_ts: float | None = None
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.runs: list[RunOverview] = []
        self.run: LogRun | None = None
        self.first_header: LogHeader | None = None
        self._handlers: dict[str, Callable] = {
            "decoding": self.decoding,
            "step": self.step_planned,
            "step-finished": self.step_finished,
            "chunk-prefilled": self.chunk,
            "image-encoded": self.encoded,
            "admitted": self.admitted,
            "terminal": self.terminal,
            "model-loaded": self.model_loaded,
            "model-load-failed": self.loads.add,
            "model-unloaded": self.loads.add,
        }

    # -- runs and events ------------------------------------------------------------------

    def start_run(self, run: LogRun) -> None:
        self.end_run(last=False)
        self.run = run
        self.first_header = self.first_header or run.header
        self.clock.start_run(run.header.config)
        self.requests.start_run()
        self.waits.start_run()
        self.rows = DecodingRows()
        self.run_events = self.run_steps = 0

    def end_run(self, *, last: bool) -> None:
        if self.run is None:
            return
        outcomes: Counter[str] = self.requests.end_run(self.run.index, self.rows, last=last)
        h = self.run.header
        self.runs.append(
            RunOverview(
                index=self.run.index,
                run_id=h.run_id,
                created=h.created,
                model=h.model,
                log_prompts=h.log_prompts,
                log_outputs=h.log_outputs,
                num_events=self.run_events,
                num_steps=self.run_steps,
                num_requests=sum(outcomes.values()),
                outcomes=dict(outcomes.most_common()),
            )
        )
        self.run = None

    def feed(self, run: LogRun, event) -> None:  # an Event or a light one
        """`event` of `run`: a new run starts afresh."""
        if self.run is None or self.run.index != run.index:
            self.start_run(run)
        self.add(event)

    def consume(self, items: Iterable[tuple[LogRun, Any]], progress: Progress | None) -> None:
        """`feed` every (run, event) of `items`, calling `progress` every 10,000 events."""
        handlers = self._handlers
        run: LogRun | None = None
        n = first = 0  # events read; the number of the current run's first
        event = None
        for n, (log_run, event) in enumerate(items, start=1):  # noqa: B007 (read below)
            if log_run is not run:
                self._count(n - 1 - first)  # the run before: `feed` counted its first event
                self.feed(log_run, event)
                run, first = log_run, n
            else:
                handler = handlers.get(event.type)
                if handler is not None:
                    handler(event)
            if progress is not None and n % 10_000 == 0:
                progress(n)
        if event is not None:
            self.last_ts = event.ts
            self._count(n - first)

    def _count(self, events: int) -> None:
        """`events` more events of the current run, handled without `add`."""
        if events > 0:
            self.num_events += events
            self.run_events += events

    def add(self, event) -> None:  # an Event or a light one
        self.num_events += 1
        self.run_events += 1
        if self.first_ts is None:
            self.first_ts = event.ts
        self.last_ts = event.ts
        handler = self._handlers.get(event.type)
        if handler is not None:
            handler(event)

    # -- the events, each handed to its parts ---------------------------------------------

    def admitted(self, event: Admitted) -> None:
        if not self.requests.admitted(event):
            return
        self.tokens.admitted(event)
        focus = self.focus
        if focus is not None and event.request_id == focus.request_id:
            focus.admitted_ts = event.ts

    def chunk(self, event: ChunkPrefilled) -> None:
        self.tokens.chunk(event, ours=self.requests.chunk(event))

    def encoded(self, event: ImageEncoded) -> None:
        self.tokens.encoded(event)
        self.requests.encoded(event)

    def terminal(self, event: Terminal) -> None:
        self.rows.end(event.request_id)
        self.requests.terminal(event)

    def model_loaded(self, event: ModelLoaded) -> None:
        self.loads.add(event)
        self.clock.loaded(event.config)

    def step_planned(self, event: StepPlanned) -> None:
        assert self.run is not None
        span = step_span(event, event.ts)
        self.waits.planned(span)
        self.num_steps += 1
        self.run_steps += 1
        if self.first_step is None:
            self.first_step = event.step
        self.last_step = event.step
        n_decode = span.num_decode_rows
        if n_decode < len(event.request_ids):
            self.requests.scheduled(event.request_ids[n_decode:], event.ts)
        if n_decode and span.num_tokens > n_decode + span.num_chunk_tokens:  # drafting rows
            self.drafts.planned(event.request_ids, event.num_tokens, n_decode)
        if self.focus is not None:
            self.focus.planned(event, event.ts)
        self.shapes.planned(event, span)
        self.clock.planned(event, span, self.run.index)

    def step_finished(self, event: StepFinished) -> None:
        assert self.run is not None
        span = self.waits.finished(event)
        if self.focus is not None:
            self.focus.finished(event.step, event.seconds, event.ts)
        self.clock.finished(event, span, self.run.index)

    def decoding(self, event: TokensSampled) -> None:
        ids, ts, step = event.request_ids, event.ts, event.step
        if self.drafts.pending:
            self._drafts_decoded(ids)
        rows = self.rows
        before = (rows.prev_set, rows.prev_ts, rows.prev_step)
        firsts, resumed, n_on = rows.feed(ids, ts, step)
        self.tokens.sampled(len(ids))
        self.requests.first_tokens(firsts, ts)
        assert self.run is not None
        self.waits.sampled(self.run.index, ids, step, ts, before, n_on, resumed)
        focus = self.focus
        if focus is not None and focus.request_id in ids:
            rid = focus.request_id
            prev_set, prev_ts, prev_step = before
            if rid in prev_set:
                focus.waits.append((ts - prev_ts, self.waits.slowest(prev_step, step)))
            for other, gap, last_step in resumed:
                if other == rid:
                    focus.waits.append((gap, self.waits.slowest(last_step, step)))

    def _drafts_decoded(self, ids: tuple[str, ...]) -> None:
        """The kept drafts of the step's drafting rows (and of the request followed)."""
        proposed = self.drafts.pending
        kept = self.drafts.decoded(ids)
        focus = self.focus
        if focus is not None and focus.request_id in kept:
            focus.drafted(proposed[focus.request_id], kept[focus.request_id])
