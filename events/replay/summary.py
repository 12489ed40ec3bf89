"""Replay's summary: outcomes, latencies, scheduling figures and time, in one streaming pass.

A log of several runs is summarised run by run (requests, steps and sequence numbers start
afresh in each run) and in total; requests a run left unfinished before a restart are
`interrupted`, those unfinished when the log ends `in-flight`. A log several models share is
summarised model by model (`summarize_models`), each with its loads and unloads; each model's
events read as a log of that model alone.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from stepline.events.fold import Status
from stepline.events.log import (
    LogRun,
    log_files,
    read_header,
    read_models,
    read_runs,
)
from stepline.events.models import (
    Admitted,
    ChunkPrefilled,
    ImageEncoded,
    LogHeader,
    ModelLoaded,
    ModelLoadFailed,
    ModelUnloaded,
    StepFinished,
    StepPlanned,
    Terminal,
    TokensSampled,
)
from stepline.events.replay.describe import InFlight, resolve_model, resolve_run
from stepline.events.replay.stalls import DecodingRows, StallBook, StallCause
from stepline.events.replay.stats import Distribution, Percentiles, Report, TopK
from stepline.events.replay.timeline import StepSpan, step_span
from stepline.events.replay.why import Focus, RequestWhy, explain
from stepline.events.scan import scan_run_events

Progress = Callable[[int], None]
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


class SlowStep(Report):
    step: int
    seconds: float  # the executor's measured time (or, estimated, until the next plan)
    num_tokens: int
    num_seqs: int
    estimated: bool = False  # the log has no step-finished events (written before schema 2)
    run: int = 1
    predicted_s: float | None = None  # the scheduler's cost-model prediction
    warming_up: bool = False  # the engine was warming up
    cpu_share: float | None = None  # the process's CPU seconds per wall second in it
    load_avg: float | None = None  # the machine's load average when it ended


class IdleGap(Report):
    """Time the engine had nothing to run: from a step's end to the next step's plan."""

    after_step: int
    seconds: float
    run: int = 1


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


class ModelLoads(Report):
    """A model's loads and unloads, in a log several models share."""

    path: str | None  # what its latest load loaded
    config: dict  # the engine config it serves with (its first load's, resolved)
    num_loads: int
    load_s: Percentiles  # how long each load took
    # its latest load's sizes (None: never loaded)
    weights_bytes: int | None
    kv_bytes: int | None
    prefix_cache_bytes: int | None
    unloads: dict[str, int]  # reason -> how many
    bytes_freed: int  # by its unloads, in total
    num_load_failures: int
    load_failures: dict[str, int]  # message -> how many (the most frequent few)


_FAILURES_KEPT = 5  # distinct load-failure messages a summary names


class _LoadTracker:
    """Folds a model's `model-loaded`, `model-load-failed` and `model-unloaded` events."""

    def __init__(self) -> None:
        self.first: ModelLoaded | None = None
        self.latest: ModelLoaded | None = None
        self.num_loads = 0
        self.load_s = Distribution()
        self.unloads: Counter[str] = Counter()
        self.bytes_freed = 0
        self.failures: Counter[str] = Counter()
        self.seen = False

    def add(self, event: ModelLoaded | ModelLoadFailed | ModelUnloaded) -> None:
        self.seen = True
        if isinstance(event, ModelLoaded):
            self.first = self.first or event
            self.latest = event
            self.num_loads += 1
            self.load_s.add(event.load_seconds)
        elif isinstance(event, ModelUnloaded):
            self.unloads[event.reason] += 1
            self.bytes_freed += event.bytes_freed
        else:
            self.failures[event.message] += 1

    def report(self) -> ModelLoads | None:
        if not self.seen:
            return None
        latest = self.latest
        return ModelLoads(
            path=latest.path if latest is not None else None,
            config=self.first.config if self.first is not None else {},
            num_loads=self.num_loads,
            load_s=self.load_s.percentiles(),
            weights_bytes=latest.weights_bytes if latest is not None else None,
            kv_bytes=latest.kv_bytes if latest is not None else None,
            prefix_cache_bytes=latest.prefix_cache_bytes if latest is not None else None,
            unloads=dict(self.unloads.most_common()),
            bytes_freed=self.bytes_freed,
            num_load_failures=self.failures.total(),
            load_failures=dict(self.failures.most_common(_FAILURES_KEPT)),
        )


class Summary(Report):
    files: tuple[str, ...]
    header: LogHeader  # the first run's
    model: str | None = None  # in a log several models share: whose summary this is
    loads: ModelLoads | None = None  # that model's loads and unloads (None: none logged)
    runs: tuple[RunOverview, ...]
    num_events: int
    num_steps: int
    first_step: int | None
    last_step: int | None
    duration_s: float  # first event -> last event
    busy_s: float | None  # executor time of every step (None: the log does not measure it)
    idle_s: float | None  # time between a step's end and the next plan, in total
    num_requests: int
    # finish reason -> requests; "interrupted" for those a restart cut off, "in-flight" for
    # those without a terminal when the log ends
    outcomes: dict[str, int]
    num_prompt_tokens: int  # admitted prompts, in total
    num_cached_tokens: int  # of which served from the prefix cache
    num_prefilled_tokens: int  # prompt tokens computed by chunks
    num_output_tokens: int
    ttft_s: Percentiles
    itl_s: Percentiles
    queueing_s: Percentiles
    e2e_s: Percentiles
    budget_utilisation: Percentiles  # per step: tokens / max_step_tokens
    seqs_per_step: Percentiles
    longest_stalls: tuple[Stall, ...]
    stall_threshold_s: float = 0.0  # a wait between two tokens over this is a stall
    # stalls added up per causing request (the biggest prompt work of the slowest step in
    # the wait), most stalled seconds first
    stall_causes: tuple[StallCause, ...] = ()
    step_time: StepTimes | None = None  # steps against the step-time target
    # what sized the prompt chunks (limit -> chunks), and why runnable requests sat a step
    # out (reason -> times); empty for logs before schema 7
    chunk_limits: dict[str, int] = Field(default_factory=dict)
    held_reasons: dict[str, int] = Field(default_factory=dict)
    # why requests' prefix-cache hits stopped short (`events.models.PrefixMiss` -> requests);
    # empty for logs before schema 8, or with no prefix cache
    prefix_misses: dict[str, int] = Field(default_factory=dict)
    drafts: Drafts | None = None  # speculative decoding's drafts (None: nothing drafted)
    # the engine's own requests (`Admitted.origin`: next turns prefilled), apart from the
    # clients': their percentiles and misses are not in the figures above; None: there were none
    next_turns: NextTurns | None = None
    slowest_steps: tuple[SlowStep, ...]
    longest_idle: tuple[IdleGap, ...]
    in_flight: tuple[InFlight, ...]  # unfinished when the log ends
    interrupted: tuple[InFlight, ...]  # unfinished when a run ended and another began


class ModelSummaries(Report):
    """The summary of a log several models share: one per model, in the order the log's
    headers list them."""

    files: tuple[str, ...]
    models: tuple[Summary, ...]


@dataclass(slots=True)
class _Track:
    num_prompt_tokens: int
    num_computed: int
    admitted_step: int
    admitted_ts: float
    first_scheduled_ts: float | None = None
    chunked: bool = False
    ours: bool = False  # the engine's own (`Admitted.origin`)

    def status(self, num_output: int) -> Status:
        if self.num_computed >= self.num_prompt_tokens:
            return Status.DECODING
        return Status.PREFILLING if self.chunked else Status.WAITING


class NextTurns(Report):
    """The engine's own prefills of chats' next turns (api/pipeline/next_turn.py): how many,
    how they ended (a client's request needing the seat cancels one), the prompt tokens they
    computed. Counted in the summary's token totals; left out of its requests, outcomes,
    latency percentiles and prefix misses (a client waits for none of them)."""

    num_requests: int
    outcomes: dict[str, int]
    num_prefilled_tokens: int


class Drafts(Report):
    """Speculative decoding (actors/scheduler/drafter.py): drafted tokens the steps verified and
    how many the target model kept."""

    num_proposed: int  # drafted tokens, over every drafting decode row
    num_accepted: int  # of which kept
    num_rows: int  # decode rows that carried drafts
    num_requests: int  # requests that drafted

    @property
    def acceptance(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0


class _DraftTally:
    """Drafts per decode row from a step's plan (its tokens past the row's one), kept ones
    from the step's decoding event (the row's tokens past one)."""

    def __init__(self) -> None:
        self.pending: dict[str, int] = {}  # this step's drafting rows -> drafts
        self.proposed = self.accepted = self.rows = 0
        self.requests: set[str] = set()

    def planned(self, ids: Sequence[str], tokens: Sequence[int], num_decode: int) -> None:
        pending = self.pending = {}
        for i in range(num_decode):
            if tokens[i] > 1:
                pending[ids[i]] = tokens[i] - 1
        if pending:
            self.proposed += sum(pending.values())
            self.rows += len(pending)
            self.requests.update(pending)

    def decoded(self, ids: Sequence[str]) -> dict[str, int]:
        """This step's kept drafts per drafting row ({} where none drafted)."""
        pending, self.pending = self.pending, {}
        if not pending:
            return {}
        counts = Counter(rid for rid in ids if rid in pending)
        kept = {rid: min(n, max(0, counts[rid] - 1)) for rid, n in pending.items()}
        self.accepted += sum(kept.values())
        return kept

    def report(self) -> Drafts | None:
        if not self.rows:
            return None
        return Drafts(
            num_proposed=self.proposed,
            num_accepted=self.accepted,
            num_rows=self.rows,
            num_requests=len(self.requests),
        )


class StepTimes(Report):
    """Steps against the step-time target (the engine config's `max_step_ms`), which holds
    for steps with decode rows; and what the host was doing."""

    target_s: float | None  # None: the run has no target (tokens only)
    num_steps: int  # steps measured (with a step-finished event)
    num_decode_steps: int  # of which with decode rows: those the target is for
    num_over: int  # decode steps over the target
    worst_s: float | None  # the longest decode step
    worst_step: int | None
    # measured / predicted time, per step with a prediction (1.0: the cost model was right)
    over_prediction: Percentiles
    num_warming_up: int  # steps the engine ran while warming up
    cpu_share: Percentiles  # the process's CPU seconds per wall second, per step
    load_avg: Percentiles  # the machine's 1-minute load average, per step


def _target_s(config: dict) -> float | None:
    ms = config.get("max_step_ms")
    return ms / 1e3 if isinstance(ms, int | float) and ms > 0 else None


class _Summariser:
    """Accumulates over the whole log; per-run state is reset at each run's start. Takes
    validated events or scan.py's light ones (it reads fields and dispatches on `type`)."""

    def __init__(self, top: int, focus: Focus | None = None) -> None:
        self.top = top
        self.focus = focus  # a request to note the why of (`request_why`)
        self.outcomes: Counter[str] = Counter()
        self.ttft, self.queueing, self.e2e = (Distribution() for _ in range(3))
        self.utilisation, self.seqs = Distribution(), Distribution()
        self.over_prediction, self.cpu_share, self.load_avg = (Distribution() for _ in range(3))
        self.stalls, self.slow_steps, self.idle_gaps = TopK(top), TopK(top), TopK(top)
        self.book = StallBook()
        self.limits: Counter[str] = Counter()
        self.held: Counter[str] = Counter()
        self.prefix_misses: Counter[str] = Counter()
        self.ours: set[str] = set()  # the engine's own requests (next turns), live
        self.ours_outcomes: Counter[str] = Counter()
        self.ours_prefilled = 0
        self.drafts = _DraftTally()
        self.num_events = self.num_steps = 0
        self.num_prompt = self.num_cached = self.num_prefilled = self.num_output = 0
        self.num_measured = self.num_decode_steps = self.num_over = self.num_warming = 0
        self.worst: tuple[float, int] | None = None
        self.target_s: float | None = None
        self.first_ts: float | None = None
        self.last_ts: float | None = None
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.busy = 0.0
        self.idle = 0.0
        self.measured = False
        self.runs: list[RunOverview] = []
        self.interrupted: list[InFlight] = []
        self.in_flight: list[InFlight] = []
        self.run: LogRun | None = None
        self.first_header: LogHeader | None = None
        self.loads = _LoadTracker()
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

    def start_run(self, run: LogRun) -> None:
        self.end_run(last=False)
        self.run = run
        self.first_header = self.first_header or run.header
        self.target_s = _target_s(run.header.config)
        self.tracks: dict[str, _Track] = {}
        self.rows = DecodingRows()
        self.run_outcomes: Counter[str] = Counter()
        self.run_events = self.run_steps = 0
        self.prev_step: StepPlanned | None = None
        # The latest steps, to name the cause of a stall as it is seen (bounded memory).
        self.recent: deque[StepSpan] = deque(maxlen=_STALL_WINDOW)
        self.prev_tokens = 0
        self.prev_finished: StepFinished | None = None

    def end_run(self, *, last: bool) -> None:
        if self.run is None:
            return
        left = [
            InFlight(
                request_id=rid,
                status=t.status(0),
                num_prompt_tokens=t.num_prompt_tokens,
                num_computed_tokens=t.num_computed,
                num_output_tokens=self.rows.num_tokens(rid),
                admitted_step=t.admitted_step,
                run=self.run.index,
            )
            for rid, t in self.tracks.items()
        ]
        (self.in_flight if last else self.interrupted).extend(left)
        if left:
            self.run_outcomes["in-flight" if last else "interrupted"] += len(left)
        self.outcomes.update(self.run_outcomes)
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
                num_requests=sum(self.run_outcomes.values()),
                outcomes=dict(self.run_outcomes.most_common()),
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

    def next_turns(self) -> NextTurns | None:
        """The engine's own requests' figures (None: it sent none)."""
        if not self.ours_outcomes:
            return None
        return NextTurns(
            num_requests=sum(self.ours_outcomes.values()),
            outcomes=dict(self.ours_outcomes.most_common()),
            num_prefilled_tokens=self.ours_prefilled,
        )

    def admitted(self, event: Admitted) -> None:
        if event.request_id in self.tracks:
            return
        self.tracks[event.request_id] = _Track(
            num_prompt_tokens=event.num_prompt_tokens,
            num_computed=event.num_cached_tokens,
            admitted_step=event.step,
            admitted_ts=event.ts,
            ours=getattr(event, "origin", "client") != "client",
        )
        self.num_prompt += event.num_prompt_tokens
        self.num_cached += event.num_cached_tokens
        focus = self.focus
        if focus is not None and event.request_id == focus.request_id:
            focus.admitted_ts = event.ts

    def chunk(self, event: ChunkPrefilled) -> None:
        t = self.tracks.get(event.request_id)
        if t is not None and t.ours:
            self.ours_prefilled += event.end - event.start
        elif event.prefix_miss is not None:
            self.prefix_misses[event.prefix_miss] += 1
        self.num_prefilled += event.end - event.start
        self.num_cached += event.num_cached_tokens  # the first chunk says what it reused
        if t is not None:
            t.num_computed = max(t.num_computed, event.end)
            t.chunked = True

    def encoded(self, event: ImageEncoded) -> None:
        if event.prefix_miss is not None:
            self.prefix_misses[event.prefix_miss] += 1
        self.num_cached += event.num_cached_tokens  # the first step says what it reused
        t = self.tracks.get(event.request_id)
        if t is not None:
            t.num_computed = max(t.num_computed, event.num_cached_tokens)
            t.chunked = True

    def terminal(self, event: Terminal) -> None:
        t = self.tracks.pop(event.request_id, None)
        self.rows.end(event.request_id)
        if t is None:
            if event.status is not None:  # refused at a door: never admitted
                self.run_outcomes[str(event.reason)] += 1
            return  # else a second terminal, or an unknown request: verify's business
        if t.ours:
            self.ours_outcomes[str(event.reason)] += 1
        else:
            self.run_outcomes[str(event.reason)] += 1
            self.e2e.add(event.ts - t.admitted_ts)

    def model_loaded(self, event: ModelLoaded) -> None:
        self.loads.add(event)
        self.target_s = _target_s(event.config)

    def decoding(self, event: TokensSampled) -> None:
        ids, ts, step = event.request_ids, event.ts, event.step
        if self.drafts.pending:
            proposed = self.drafts.pending
            kept = self.drafts.decoded(ids)
            focus = self.focus
            if focus is not None and focus.request_id in kept:
                focus.drafted(proposed[focus.request_id], kept[focus.request_id])
        rows = self.rows
        prev_set = rows.prev_set
        prev_ts, prev_step = rows.prev_ts, rows.prev_step
        firsts, resumed, n_on = rows.feed(ids, ts, step)
        self.num_output += len(ids)
        tracks = self.tracks
        for rid in firsts:
            t = tracks.get(rid)
            if t is not None and not t.ours:
                self.ttft.add(ts - t.admitted_ts)
        assert self.run is not None
        run = self.run.index
        if n_on:
            gap = ts - prev_ts
            span = self._slowest(prev_step, step)
            self.book.wait(gap, n_on, self._cause(span), span.step if span else step)
            if self.stalls.would_take(gap):  # one wait, named by its first request
                rid = next(r for r in ids if r in prev_set)
                self.stalls.offer(gap, (rid, gap, prev_step, step, run, span, n_on))
        for rid, gap, last_step in resumed:
            span = self._slowest(last_step, step)
            self.book.wait(gap, 1, self._cause(span), span.step if span else step)
            if self.stalls.would_take(gap):
                self.stalls.offer(gap, (rid, gap, last_step, step, run, span, 1))
        focus = self.focus
        if focus is not None and focus.request_id in ids:
            rid = focus.request_id
            if rid in prev_set:
                focus.waits.append((ts - prev_ts, self._slowest(prev_step, step)))
            for other, gap, last_step in resumed:
                if other == rid:
                    focus.waits.append((gap, self._slowest(last_step, step)))

    def _slowest(self, after: int, upto: int) -> StepSpan | None:
        """The slowest step in (after, upto] that the recent steps hold."""
        best = None
        for span in reversed(self.recent):
            if span.step <= after:
                break
            if span.step <= upto and (best is None or span.seconds > best.seconds):
                best = span
        return best

    def _cause(self, span: StepSpan | None) -> int:
        if span is None or span.cause is None:
            return -1
        assert self.run is not None
        return self.book.cause_index(self.run.index, span.cause)

    def step_planned(self, event: StepPlanned) -> None:
        assert self.run is not None
        if self.recent and self.recent[-1].estimated:  # no measurement: until this plan
            self.recent[-1].seconds = max(0.0, event.ts - self.recent[-1].start)
        span = step_span(event, event.ts)
        self.recent.append(span)
        self.num_steps += 1
        self.run_steps += 1
        if self.first_step is None:
            self.first_step = event.step
        self.last_step = event.step
        used = span.num_tokens
        n_decode = span.num_decode_rows
        if n_decode < len(event.request_ids):
            tracks = self.tracks
            for rid in event.request_ids[n_decode:]:
                t = tracks.get(rid)
                if t is not None and t.first_scheduled_ts is None:
                    t.first_scheduled_ts = event.ts
                    if not t.ours:
                        self.queueing.add(event.ts - t.admitted_ts)
            if event.limits:
                self.limits.update(filter(None, event.limits[n_decode:]))
        if event.held_reasons:
            self.held.update(event.held_reasons)
        if n_decode and used > n_decode + span.num_chunk_tokens:  # drafting decode rows
            self.drafts.planned(event.request_ids, event.num_tokens, n_decode)
        if self.focus is not None:
            self.focus.planned(event, event.ts)
        self.utilisation.add(used / event.max_step_tokens)
        self.seqs.add(len(event.request_ids))
        prev, done = self.prev_step, self.prev_finished
        if prev is not None and done is None:  # no measurement: until the next plan
            gap = event.ts - prev.ts
            if self.slow_steps.would_take(gap):
                self.slow_steps.offer(gap, self._slow(prev, gap, self.prev_tokens, estimated=True))
        elif prev is not None and done is not None:
            idle = max(0.0, event.ts - done.ts)
            self.idle += idle
            if self.idle_gaps.would_take(idle):
                gap_ = IdleGap(after_step=prev.step, seconds=idle, run=self.run.index)
                self.idle_gaps.offer(idle, gap_)
        self.prev_step, self.prev_tokens, self.prev_finished = event, used, None

    def step_finished(self, event: StepFinished) -> None:
        self.measured = True
        self.num_measured += 1
        seconds = event.seconds
        span = self.recent[-1] if self.recent and self.recent[-1].step == event.step else None
        if span is not None:
            span.seconds, span.predicted, span.estimated = seconds, event.predicted_seconds, False
        self.busy += seconds
        if self.focus is not None:
            self.focus.finished(event.step, seconds, event.ts)
        if event.predicted_seconds:
            self.over_prediction.add(seconds / event.predicted_seconds)
        if event.warming_up:
            self.num_warming += 1
        if event.cpu_share is not None:
            self.cpu_share.add(event.cpu_share)
        if event.load_avg is not None:
            self.load_avg.add(event.load_avg)
        if span is not None and span.num_decode_rows:
            self.num_decode_steps += 1
            if self.target_s is not None and seconds > self.target_s:
                self.num_over += 1
            if self.worst is None or seconds > self.worst[0]:
                self.worst = (seconds, event.step)
        prev = self.prev_step
        if prev is not None and prev.step == event.step:
            self.prev_finished = event
            if self.slow_steps.would_take(seconds):
                slow = self._slow(prev, seconds, self.prev_tokens, estimated=False)
                self.slow_steps.offer(
                    seconds,
                    slow.model_copy(
                        update={
                            "predicted_s": event.predicted_seconds,
                            "warming_up": event.warming_up,
                            "cpu_share": event.cpu_share,
                            "load_avg": event.load_avg,
                        }
                    ),
                )

    def step_times(self) -> StepTimes | None:
        if not self.num_measured:
            return None
        return StepTimes(
            target_s=self.target_s,
            num_steps=self.num_measured,
            num_decode_steps=self.num_decode_steps,
            num_over=self.num_over,
            worst_s=self.worst[0] if self.worst else None,
            worst_step=self.worst[1] if self.worst else None,
            over_prediction=self.over_prediction.percentiles(),
            num_warming_up=self.num_warming,
            cpu_share=self.cpu_share.percentiles(),
            load_avg=self.load_avg.percentiles(),
        )

    def _slow(self, step: StepPlanned, seconds: float, tokens: int, *, estimated: bool) -> SlowStep:
        assert self.run is not None
        return SlowStep(
            step=step.step,
            seconds=seconds,
            num_tokens=tokens,
            num_seqs=len(step.request_ids),
            estimated=estimated,
            run=self.run.index,
        )


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


def summarize(
    path: str | Path,
    *,
    top: int = 5,
    run: int | str | None = None,
    model: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> Summary:
    """Outcomes, latencies, scheduling figures and time of the log (or of one `run`; of one
    `model`, in a log several models share: with its loads and unloads).

    Tolerant: events that break the invariants are counted as they come (verify reports
    them). `progress`, if given, is called with the number of events read every 10,000
    events. Raises what `read_events` raises, UnknownRunError and UnknownModelError.
    """
    index = resolve_run(path, run)
    model = resolve_model(path, model, run=index)
    summariser = _Summariser(top)
    summariser.consume(scan_run_events(path, run=index, model=model), progress)
    return _summary(path, index, summariser, model, len(read_runs(path)))


def summarize_models(
    path: str | Path,
    *,
    top: int = 5,
    run: int | str | None = None,
    progress: Callable[[int], None] | None = None,
) -> ModelSummaries:
    """The summary of each model of a log several models share (of one `run`), in one pass:
    what `summarize` says of each. A model the headers list but that has no event gets an
    empty summary. Raises what `summarize` raises."""
    index = resolve_run(path, run)
    summarisers = {name: _Summariser(top) for name in read_models(path, run=index)}
    for num_events, (log_run, event) in enumerate(scan_run_events(path, run=index), start=1):
        name = log_run.header.model_of(event)
        summariser = summarisers.get(name) if name is not None else None
        if summariser is None:  # an event of a model no header lists: verify's business
            summariser = summarisers.setdefault(name or "?", _Summariser(top))
        summariser.feed(log_run, event)
        if progress is not None and num_events % 10_000 == 0:
            progress(num_events)
    num_runs = len(read_runs(path))
    return ModelSummaries(
        files=tuple(str(p) for p in log_files(path)),
        models=tuple(_summary(path, index, s, name, num_runs) for name, s in summarisers.items()),
    )


def _summary(
    path: str | Path, index: int | None, s: _Summariser, model: str | None, num_runs: int
) -> Summary:
    header = read_header(path)
    if s.run is not None:
        s.end_run(last=s.run.index == num_runs)
    if index is not None and s.runs:
        header = s.first_header or header
    return Summary(
        files=tuple(str(p) for p in log_files(path)),
        header=header,
        model=model,
        loads=s.loads.report(),
        runs=tuple(s.runs),
        num_events=s.num_events,
        num_steps=s.num_steps,
        first_step=s.first_step,
        last_step=s.last_step,
        duration_s=(s.last_ts - s.first_ts) if s.first_ts is not None and s.last_ts else 0.0,
        busy_s=s.busy if s.measured else None,
        idle_s=s.idle if s.measured else None,
        num_requests=sum(s.outcomes.values()),
        outcomes=dict(s.outcomes.most_common()),
        num_prompt_tokens=s.num_prompt,
        num_cached_tokens=s.num_cached,
        num_prefilled_tokens=s.num_prefilled,
        num_output_tokens=s.num_output,
        ttft_s=s.ttft.percentiles(),
        itl_s=s.book.percentiles(),
        queueing_s=s.queueing.percentiles(),
        e2e_s=s.e2e.percentiles(),
        budget_utilisation=s.utilisation.percentiles(),
        seqs_per_step=s.seqs.percentiles(),
        longest_stalls=tuple(_stall(*item) for item in s.stalls.items()),
        stall_threshold_s=s.book.threshold(),
        stall_causes=tuple(s.book.by_cause(s.top)),
        step_time=s.step_times(),
        chunk_limits=dict(s.limits.most_common()),
        held_reasons=dict(s.held.most_common()),
        prefix_misses=dict(s.prefix_misses.most_common()),
        drafts=s.drafts.report(),
        next_turns=s.next_turns(),
        slowest_steps=tuple(s.slow_steps.items()),
        longest_idle=tuple(s.idle_gaps.items()),
        in_flight=tuple(s.in_flight),
        interrupted=tuple(s.interrupted),
    )


def request_why(
    path: str | Path, request_id: str, *, run: int | None = None, model: str | None = None
) -> RequestWhy:
    """Why `request_id` (of `run`, 1-based, None for a log of one run; of `model`) took the
    time it took (why.py): one pass over its run with this summary's fold, following it.
    Raises what `summarize` raises."""
    s = _Summariser(0, Focus(request_id))
    s.consume(scan_run_events(path, run=run, model=model), None)
    assert s.focus is not None
    caused = s.book.by_cause(1, only=(s.run.index if s.run else 1, request_id))
    return explain(s.focus, s.book.threshold(), caused[0] if caused else None)
