"""A run laid out in time: every step's span, every request's life, and the stalls between.

What the picture (svg.py) and the trace export (trace.py) draw, collected in one streaming
pass over one run of the log (of one model, in a log several share). Memory grows with the
steps and the tokens of the run (a few bytes a token, in arrays), not with the events' text.

Times are seconds from the run's first event. A step starts when it was planned and lasts
what the executor measured (`step-finished`); in logs without those, until the next plan.

A **stall** is a wait between two consecutive tokens of one request longer than a threshold
(by default three times the run's median inter-token gap). Its **cause** is the slowest step in
the wait: the step that made the request's stream freeze.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from stepline.events.models import (
    ModelLoaded,
    StepPlanned,
    Terminal,
)
from stepline.events.replay.describe import resolve_model
from stepline.events.replay.stats import Distribution
from stepline.events.scan import scan_run_events

if TYPE_CHECKING:
    import numpy as np

_NAMED_PREFILLS = 3  # requests named in a step's description; the rest are counted
DEFAULT_STALL_FACTOR = 3.0  # a stall: a gap over this many times the median gap
MIN_STALL_S = 0.001  # never call a gap under a millisecond a stall


@dataclass(slots=True)
class StepSpan:
    """One step: when it ran, what it held."""

    step: int
    start: float  # seconds from the run's first event
    seconds: float  # measured by the executor, or estimated (see `estimated`)
    predicted: float | None  # the scheduler's cost-model prediction
    estimated: bool  # no step-finished event: the time until the next plan, idle included
    num_tokens: int
    max_step_tokens: int
    num_decode_rows: int
    num_chunk_tokens: int
    prefills: list[tuple[str, int]]  # (request id, tokens): the first few prefill entries
    num_prefills: int
    encodes: tuple[str, ...] = ()  # requests whose image's encoder ran units in it
    # the request whose prompt work was the biggest in it (its largest chunk; else the first
    # image it encoded): what a stall in this step is laid at; None: no prompt work
    cause: str | None = None

    @property
    def end(self) -> float:
        return self.start + self.seconds

    def describe(self) -> str:
        """'step 57 took 141.0 ms (predicted 30.2 ms): r9 prefill 2048 tokens, 3 decode rows'."""
        predicted = "" if self.predicted is None else f" (predicted {format_ms(self.predicted)})"
        took = ("estimated " if self.estimated else "") + format_ms(self.seconds)
        return f"step {self.step} took {took}{predicted}: {self.contents()}"

    def contents(self) -> str:
        parts = [f"{rid} prefill {n} tokens" for rid, n in self.prefills]
        if self.num_prefills > len(self.prefills):
            parts.append(f"{self.num_prefills - len(self.prefills)} more prefills")
        parts += [f"{rid} image encoder" for rid in self.encodes]
        if self.num_decode_rows:
            parts.append(f"{self.num_decode_rows} decode row{'s' * (self.num_decode_rows != 1)}")
        used = f"{self.num_tokens}/{self.max_step_tokens} tokens"
        return ", ".join(parts) + f" ({used})" if parts else f"empty ({used})"


@dataclass(frozen=True, slots=True)
class StallMark:
    """A wait between two tokens of one request, and the step that caused it."""

    request_id: str
    seconds: float
    from_step: int  # the step of the token before the wait
    to_step: int  # the step of the token after it
    start: float  # the first token's time (seconds from the run's first event)
    end: float  # the second token's time
    cause_step: int | None  # the slowest step in (from_step, to_step]
    cause: str  # for people: what that step did, and whether the request sat steps out

    def describe(self) -> str:
        return (
            f"{self.request_id} stalled {format_ms(self.seconds)} between tokens at steps "
            f"{self.from_step} and {self.to_step}: {self.cause}"
        )


@dataclass(slots=True)
class RequestLife:
    """One request's life, compactly: chunks by step, tokens as arrays."""

    request_id: str
    order: int  # admission order, from 0
    admitted_step: int
    admitted_at: float
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    chunks: dict[int, tuple[int, int]] = field(default_factory=dict)  # step -> [start, end)
    num_chunk_events: int = 0
    first_scheduled_at: float | None = None
    token_steps: array = field(default_factory=lambda: array("i"))
    token_counts: array = field(default_factory=lambda: array("i"))
    token_times: array = field(default_factory=lambda: array("d"))
    checkpoints: list[tuple[int, int]] = field(default_factory=list)  # (step, offset)
    # (parked after step, resumed after step or None): out of its seat for fair share
    parked: list[tuple[int, int | None]] = field(default_factory=list)
    terminal: Terminal | None = None
    terminal_at: float | None = None
    stalls: list[StallMark] = field(default_factory=list)  # worst first, after `collect`
    # the longest wait between two of its tokens, set by `collect` once the run is read
    worst_gap: float | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.admitted_at if self.token_times else None

    @property
    def queued(self) -> float | None:
        if self.first_scheduled_at is None:
            return None
        return self.first_scheduled_at - self.admitted_at

    @property
    def e2e(self) -> float | None:
        return None if self.terminal_at is None else self.terminal_at - self.admitted_at

    def gaps(self) -> np.ndarray:
        """Seconds between each token event and the one before (element i: events i, i+1)."""
        import numpy as np  # imported here: importing replay loads no BLAS

        return np.diff(np.frombuffer(self.token_times, dtype=np.float64))

    @property
    def longest_wait(self) -> float:
        """The longest the client waited for a token: the TTFT or the worst gap (or, with no
        token at all, the whole life as far as the log knows)."""
        first = self.ttft
        if first is None:
            end = self.terminal_at if self.terminal_at is not None else self.admitted_at
            return end - self.admitted_at
        return max(first, self.worst_gap or 0.0)

    @property
    def last_step(self) -> int:
        steps = [self.admitted_step, *self.chunks, *self.token_steps[-1:]]
        if self.terminal is not None:
            steps.append(self.terminal.step)
        return max(steps)

    @property
    def first_active_step(self) -> int | None:
        steps = [*self.chunks, *self.token_steps[:1]]
        if self.terminal is not None:
            steps.append(self.terminal.step)
        return min(steps) if steps else None

    def describe(self) -> str:
        """TTFT, queue time, prefill chunks, worst gap, cached tokens, outputs and the end."""
        worst = self.stalls[0] if self.stalls else None
        gap = self.worst_gap
        worst_text = "-" if gap is None else format_ms(gap)
        if worst is not None and worst.cause_step is not None:
            worst_text += f" (step {worst.cause_step})"
        if self.terminal is not None:
            end = f"{self.terminal.reason.value} after {format_ms(self.e2e)}"
        else:
            end = "no terminal event"
        return (
            f"TTFT {format_ms(self.ttft)} · queued {format_ms(self.queued)} · "
            f"{len(self.chunks)} prefill chunk{'s' * (len(self.chunks) != 1)} · "
            f"worst gap {worst_text} · {self.num_cached_tokens} cached tokens · "
            f"{self.num_output_tokens} output tokens · {end}"
        )


@dataclass
class RunTimeline:
    """One run of a log, laid out in time."""

    path: str
    run: int | None
    steps: dict[int, StepSpan]  # in step order
    requests: dict[str, RequestLife]  # in admission order
    stall_threshold: float  # seconds
    median_gap: float | None
    stalls: list[StallMark]  # every stall of the run, worst first
    model: str | None = None  # in a log several models share: whose steps
    loaded: ModelLoaded | None = None  # that model's first load in the run, if logged

    @property
    def first_step(self) -> int | None:
        return next(iter(self.steps), None)

    @property
    def last_step(self) -> int | None:
        return next(reversed(self.steps), None) if self.steps else None

    def causing_steps(self) -> dict[int, list[StallMark]]:
        """Step -> the stalls it caused."""
        out: dict[int, list[StallMark]] = {}
        for s in self.stalls:
            if s.cause_step is not None:
                out.setdefault(s.cause_step, []).append(s)
        return out


def step_span(event: StepPlanned, start: float) -> StepSpan:
    """The span of a planned step (a `StepPlanned` or its light struct) starting at `start`;
    its time is estimated until its step-finished event (or the next plan) says otherwise."""
    ids, tokens, kinds = event.request_ids, event.num_tokens, event.kinds
    n_decode = kinds.count("decode")
    if "decode" in kinds[n_decode:]:  # not decode rows first (as the engine writes them)
        rest = [i for i, kind in enumerate(kinds) if kind != "decode"]
    else:
        rest = list(range(n_decode, len(kinds)))
    prefills = [(ids[i], tokens[i]) for i in rest if kinds[i] == "prefill"]
    encodes = tuple(ids[i] for i in rest if kinds[i] == "encode")
    cause = max(prefills, key=_tokens)[0] if prefills else (encodes[0] if encodes else None)
    return StepSpan(
        step=event.step,
        start=start,
        seconds=0.0,
        predicted=None,
        estimated=True,
        num_tokens=sum(tokens),
        max_step_tokens=event.max_step_tokens,
        num_decode_rows=n_decode,
        num_chunk_tokens=sum(n for _, n in prefills),
        prefills=prefills[:_NAMED_PREFILLS],
        num_prefills=len(prefills),
        encodes=encodes,
        cause=cause,
    )


def _tokens(prefill: tuple[str, int]) -> int:
    return prefill[1]


def collect(
    path: str | Path,
    *,
    run: int | None = None,
    model: str | None = None,
    request_ids: set[str] | None = None,
    stall_s: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> RunTimeline:
    """Every step and request of one run (`run`, 1-based; None for a log of one run) and one
    model (`model`; None for a log of one model).

    `request_ids` keeps only those requests' lives (every step is kept: steps show what
    else ran). `stall_s` is the stall threshold in seconds (default: three times the median gap
    between two tokens of a request, over the whole run). `progress`, if given, is called
    with the number of events read every 10,000 events. Raises what `read_events` raises,
    ModelNeededError if the log serves several models and `model` is None, UnknownModelError.
    """
    model = resolve_model(path, model, run=run, needed=True)
    loaded: ModelLoaded | None = None
    steps: dict[int, StepSpan] = {}
    requests: dict[str, RequestLife] = {}
    t0: float | None = None
    previous: StepSpan | None = None
    gaps = Distribution()
    # with every request kept, the gaps are read off the lives at the end (in bulk)
    last_token_at: dict[str, float] | None = None if request_ids is None else {}
    num_events = 0
    for _, event in scan_run_events(path, run=run, model=model):
        num_events += 1
        if progress is not None and num_events % 10_000 == 0:
            progress(num_events)
        if t0 is None:
            t0 = event.ts
        at = event.ts - t0
        kind = event.type
        if kind == "decoding":
            _decoding(event, at, requests, request_ids, last_token_at, gaps)
            continue
        if kind == "step":
            if previous is not None and previous.estimated:
                previous.seconds = max(0.0, at - previous.start)  # older logs: until this plan
            previous = steps[event.step] = step_span(event, at)
            for rid in event.request_ids:
                life = requests.get(rid)
                if life is not None and life.first_scheduled_at is None:
                    life.first_scheduled_at = at
            continue
        if kind == "step-finished":
            span = steps.get(event.step)
            if span is not None:
                span.seconds, span.predicted = event.seconds, event.predicted_seconds
                span.estimated = False
            continue
        if isinstance(event, ModelLoaded) and loaded is None:
            loaded = event
        if event.request_id is not None:
            _request_event(event, at, requests, request_ids)
    for life in requests.values():
        between = life.gaps()
        life.worst_gap = float(between.max()) if len(between) else None
        if last_token_at is None:
            gaps.extend(between)
    median = gaps.quantile(0.5)
    if stall_s is None:
        stall_s = max(MIN_STALL_S, DEFAULT_STALL_FACTOR * median) if median is not None else 0.0
    timeline = RunTimeline(
        path=str(path),
        run=run,
        steps=steps,
        requests=requests,
        stall_threshold=stall_s,
        median_gap=median,
        stalls=[],
        model=model if model is not None else (loaded.model if loaded is not None else None),
        loaded=loaded,
    )
    for life in requests.values():
        life.stalls = find_stalls(life, timeline)
        timeline.stalls.extend(life.stalls)
    timeline.stalls.sort(key=lambda s: -s.seconds)
    return timeline


def _decoding(
    event,  # a step's decoding event (validated or light)
    at: float,
    requests: dict[str, RequestLife],
    request_ids: set[str] | None,
    last_token_at: dict[str, float] | None,
    gaps: Distribution,
) -> None:
    """A step's tokens: each request's part, into its life (and, where only some requests'
    lives are kept, every request's gap into the gaps' distribution, which sets the default
    stall threshold: the run's, not the kept requests')."""
    ids = event.request_ids
    counts = Counter(ids) if len(set(ids)) != len(ids) else None
    step = event.step
    for rid in dict.fromkeys(ids) if counts is not None else ids:
        if last_token_at is not None:
            before = last_token_at.get(rid)
            if before is not None:
                gaps.add(at - before)
            last_token_at[rid] = at
            if request_ids is not None and rid not in request_ids:
                continue
        life = requests.get(rid)
        if life is None or life.terminal is not None:
            continue  # verify's business, not the picture's
        life.token_steps.append(step)
        life.token_counts.append(counts[rid] if counts is not None else 1)
        life.token_times.append(at)


def _request_event(
    event,  # one request's event (validated or light)
    at: float,
    requests: dict[str, RequestLife],
    request_ids: set[str] | None,
) -> None:
    """One request's event, into its life."""
    rid = event.request_id
    if request_ids is not None and rid not in request_ids:
        return
    kind = event.type
    if kind == "admitted":
        if rid not in requests:
            requests[rid] = RequestLife(
                request_id=rid,
                order=len(requests),
                admitted_step=event.step,
                admitted_at=at,
                num_prompt_tokens=event.num_prompt_tokens,
                num_cached_tokens=event.num_cached_tokens,
            )
        return
    life = requests.get(rid)
    if life is None or life.terminal is not None:
        return  # verify's business, not the picture's
    if kind == "chunk-prefilled":
        start, _ = life.chunks.get(event.step, (event.start, event.end))
        life.chunks[event.step] = (start, event.end)  # a chunk split at a checkpoint
        life.num_chunk_events += 1
        life.num_cached_tokens = max(life.num_cached_tokens, event.num_cached_tokens)
    elif kind == "checkpoint-reached":
        life.checkpoints.append((event.step, event.offset))
    elif kind == "parked":
        life.parked.append((event.step, None))
    elif kind == "resumed" and life.parked:
        life.parked[-1] = (life.parked[-1][0], event.step)
    elif kind == "terminal":
        life.terminal, life.terminal_at = event, at


def find_stalls(life: RequestLife, timeline: RunTimeline) -> list[StallMark]:
    """The request's gaps over the timeline's threshold, worst first, each with its cause."""
    if timeline.stall_threshold <= 0:
        return []
    marks: list[StallMark] = []
    between_tokens = life.gaps()
    over = (between_tokens >= timeline.stall_threshold).nonzero()[0]
    if not len(over):
        return marks
    member_steps = set(life.token_steps) | set(life.chunks)
    for index in over.tolist():
        i, gap = index + 1, float(between_tokens[index])
        a, b = life.token_steps[i - 1], life.token_steps[i]
        between = [timeline.steps[s] for s in range(a + 1, b + 1) if s in timeline.steps]
        cause = max(between, key=lambda s: s.seconds, default=None)
        missed = sum(1 for s in between if s.step not in member_steps)
        parked = [p for p in life.parked if a <= p[0] < b]
        if parked:
            start, end = parked[0]
            back = f", back in the decode batch after step {end}" if end is not None else ""
            why = (
                f"parked after step {start} for fair share (its client ran more than its "
                f"share while another client's request waited){back}"
            )
        elif cause is None:
            why = "no step ran in between"
        else:
            why = cause.describe()
            busy = sum(s.seconds for s in between)
            if missed:
                why += f"; it sat out {missed} step{'s' * (missed != 1)}"
            if not cause.estimated and gap - busy > max(0.5 * gap, 0.005):
                why += f"; {format_ms(gap - busy)} of the wait no step ran"
        marks.append(
            StallMark(
                request_id=life.request_id,
                seconds=gap,
                from_step=a,
                to_step=b,
                start=life.token_times[i - 1],
                end=life.token_times[i],
                cause_step=None if cause is None else cause.step,
                cause=why,
            )
        )
    marks.sort(key=lambda s: -s.seconds)
    return marks


def format_ms(seconds: float | None, decimals: int = 2) -> str:
    """'141.6 ms', '2.31 s' (`decimals` of a second), or '-' for None."""
    if seconds is None:
        return "-"
    if abs(seconds) < 1:
        return f"{seconds * 1000:.1f} ms"
    return f"{seconds:.{decimals}f} s"
