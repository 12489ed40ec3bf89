"""Replay's summary: outcomes, latencies, scheduling figures and time, in one streaming pass.

A log of several runs is summarised run by run (requests, steps and sequence numbers start
afresh in each run) and in total; requests a run left unfinished before a restart are
`interrupted`, those unfinished when the log ends `in-flight`. A log several models share is
summarised model by model (`summarize_models`), each with its loads and unloads; each model's
events read as a log of that model alone.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stepline.events.fold import Status
from stepline.events.log import (
    LogRun,
    log_files,
    read_header,
    read_models,
    read_run_events,
    read_runs,
)
from stepline.events.models import (
    Admitted,
    ChunkPrefilled,
    Decoding,
    Event,
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
from stepline.events.replay.stats import Distribution, Percentiles, Report, TopK
from stepline.events.replay.timeline import StepSpan, step_span

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


class SlowStep(Report):
    step: int
    seconds: float  # the executor's measured time (or, estimated, until the next plan)
    num_tokens: int
    num_seqs: int
    estimated: bool = False  # the log has no step-finished events (written before schema 2)
    run: int = 1


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
    num_output: int = 0
    first_token_ts: float | None = None
    last_token_ts: float = 0.0
    last_token_step: int = 0
    chunked: bool = False

    @property
    def status(self) -> Status:
        if self.num_computed >= self.num_prompt_tokens:
            return Status.DECODING
        return Status.PREFILLING if self.chunked else Status.WAITING


def _unfinished(tracks: dict[str, _Track], run: int) -> list[InFlight]:
    return [
        InFlight(
            request_id=rid,
            status=t.status,
            num_prompt_tokens=t.num_prompt_tokens,
            num_computed_tokens=t.num_computed,
            num_output_tokens=t.num_output,
            admitted_step=t.admitted_step,
            run=run,
        )
        for rid, t in tracks.items()
    ]


class _Summariser:
    """Accumulates over the whole log; per-run state is reset at each run's start."""

    def __init__(self, top: int) -> None:
        self.outcomes: Counter[str] = Counter()
        self.ttft, self.itl, self.queueing, self.e2e = (Distribution() for _ in range(4))
        self.utilisation, self.seqs = Distribution(), Distribution()
        self.stalls, self.slow_steps, self.idle_gaps = TopK(top), TopK(top), TopK(top)
        self.num_events = self.num_steps = 0
        self.num_prompt = self.num_cached = self.num_prefilled = self.num_output = 0
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

    def start_run(self, run: LogRun) -> None:
        self.end_run(last=False)
        self.run = run
        self.first_header = self.first_header or run.header
        self.tracks: dict[str, _Track] = {}
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
        left = _unfinished(self.tracks, self.run.index)
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

    def feed(self, run: LogRun, event: Event) -> None:
        """`event` of `run`: a new run starts afresh."""
        if self.run is None or self.run.index != run.index:
            self.start_run(run)
        self.add(event)

    def add(self, event) -> None:  # an Event
        self.num_events += 1
        self.run_events += 1
        if self.first_ts is None:
            self.first_ts = event.ts
        self.last_ts = event.ts
        kind = type(event)
        if kind is TokensSampled:
            for one in event.decodings():
                self.decoding(one)
        elif kind is StepPlanned:
            self.step_planned(event)
        elif kind is StepFinished:
            self.step_finished(event)
        elif kind is ChunkPrefilled:
            self.num_prefilled += event.end - event.start
            self.num_cached += event.num_cached_tokens  # the first chunk says what it reused
            t = self.tracks.get(event.request_id)
            if t is not None:
                t.num_computed = max(t.num_computed, event.end)
                t.chunked = True
        elif kind is Admitted:
            if event.request_id in self.tracks:
                return
            self.tracks[event.request_id] = _Track(
                num_prompt_tokens=event.num_prompt_tokens,
                num_computed=event.num_cached_tokens,
                admitted_step=event.step,
                admitted_ts=event.ts,
            )
            self.num_prompt += event.num_prompt_tokens
            self.num_cached += event.num_cached_tokens
        elif kind is Terminal:
            t = self.tracks.pop(event.request_id, None)
            if t is None:
                if event.status is not None:  # refused at a door: never admitted
                    self.run_outcomes[event.reason.value] += 1
                return  # else a second terminal, or an unknown request: verify's business
            self.run_outcomes[event.reason.value] += 1
            self.e2e.add(event.ts - t.admitted_ts)
        elif kind is ModelLoaded or kind is ModelLoadFailed or kind is ModelUnloaded:
            self.loads.add(event)

    def decoding(self, event: Decoding) -> None:
        t = self.tracks.get(event.request_id)
        if t is None:
            return
        self.num_output += event.num_tokens
        if t.first_token_ts is None:
            t.first_token_ts = event.ts
            self.ttft.add(event.ts - t.admitted_ts)
        else:
            gap = event.ts - t.last_token_ts
            self.itl.add(gap)
            assert self.run is not None  # models are built at the end: this runs per token
            if self.stalls.would_take(gap):
                a, b = t.last_token_step, event.step
                # Spans are kept, not described: an estimated step's time is known only at
                # the next plan.
                spans = [span for span in self.recent if a < span.step <= b]
                self.stalls.offer(gap, (event.request_id, gap, a, b, self.run.index, spans))
        t.last_token_ts = event.ts
        t.last_token_step = event.step
        t.num_output += event.num_tokens

    def step_planned(self, event: StepPlanned) -> None:
        assert self.run is not None
        if self.recent and self.recent[-1].estimated:  # no measurement: until this plan
            self.recent[-1].seconds = max(0.0, event.ts - self.recent[-1].start)
        self.recent.append(step_span(event, event.ts))
        self.num_steps += 1
        self.run_steps += 1
        if self.first_step is None:
            self.first_step = event.step
        self.last_step = event.step
        used = sum(event.num_tokens)
        for rid in event.request_ids:
            t = self.tracks.get(rid)
            if t is not None and t.first_scheduled_ts is None:
                t.first_scheduled_ts = event.ts
                self.queueing.add(event.ts - t.admitted_ts)
        self.utilisation.add(used / event.max_step_tokens)
        self.seqs.add(len(event.request_ids))
        prev, done = self.prev_step, self.prev_finished
        if prev is not None and done is None:  # no measurement: until the next plan
            gap = event.ts - prev.ts
            self.slow_steps.offer(gap, self._slow(prev, gap, self.prev_tokens, estimated=True))
        elif prev is not None and done is not None:
            idle = max(0.0, event.ts - done.ts)
            self.idle += idle
            self.idle_gaps.offer(
                idle, IdleGap(after_step=prev.step, seconds=idle, run=self.run.index)
            )
        self.prev_step, self.prev_tokens, self.prev_finished = event, used, None

    def step_finished(self, event: StepFinished) -> None:
        self.measured = True
        if self.recent and self.recent[-1].step == event.step:
            span = self.recent[-1]
            span.seconds, span.predicted, span.estimated = (
                event.seconds,
                event.predicted_seconds,
                False,
            )
        self.busy += event.seconds
        prev = self.prev_step
        if prev is not None and prev.step == event.step:
            self.prev_finished = event
            self.slow_steps.offer(
                event.seconds, self._slow(prev, event.seconds, self.prev_tokens, estimated=False)
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


def _stall(rid: str, seconds: float, a: int, b: int, run: int, spans: list[StepSpan]) -> Stall:
    cause = max(spans, key=lambda span: span.seconds, default=None)
    return Stall(
        request_id=rid,
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
    for num_events, (log_run, event) in enumerate(
        read_run_events(path, run=index, model=model), start=1
    ):
        summariser.feed(log_run, event)
        if progress is not None and num_events % 10_000 == 0:
            progress(num_events)
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
    for num_events, (log_run, event) in enumerate(read_run_events(path, run=index), start=1):
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
        itl_s=s.itl.percentiles(),
        queueing_s=s.queueing.percentiles(),
        e2e_s=s.e2e.percentiles(),
        budget_utilisation=s.utilisation.percentiles(),
        seqs_per_step=s.seqs.percentiles(),
        longest_stalls=tuple(_stall(*item) for item in s.stalls.items()),
        slowest_steps=tuple(s.slow_steps.items()),
        longest_idle=tuple(s.idle_gaps.items()),
        in_flight=tuple(s.in_flight),
        interrupted=tuple(s.interrupted),
    )
