"""The summary (`Summary`) of a log, of one run or of one model, and the calls that make it:
`summarize`, `summarize_models`, and `request_why` (one request's why, by the same fold)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pydantic import Field

from stepline.events.log import log_files, read_header, read_models, read_runs
from stepline.events.models import LogHeader
from stepline.events.replay.describe import InFlight, resolve_model, resolve_run
from stepline.events.replay.stalls import StallCause
from stepline.events.replay.stats import Percentiles, Report
from stepline.events.replay.summary.drafts import Drafts
from stepline.events.replay.summary.fold import RunOverview, Summariser
from stepline.events.replay.summary.loads import ModelLoads
from stepline.events.replay.summary.requests import NextTurns
from stepline.events.replay.summary.steps import IdleGap, SlowStep, StepTimes
from stepline.events.replay.summary.waits import Stall
from stepline.events.replay.why import Focus, RequestWhy, explain
from stepline.events.scan import scan_run_events


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
    summariser = Summariser(top)
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
    summarisers = {name: Summariser(top) for name in read_models(path, run=index)}
    for num_events, (log_run, event) in enumerate(scan_run_events(path, run=index), start=1):
        name = log_run.header.model_of(event)
        summariser = summarisers.get(name) if name is not None else None
        if summariser is None:  # an event of a model no header lists: verify's business
            summariser = summarisers.setdefault(name or "?", Summariser(top))
        summariser.feed(log_run, event)
        if progress is not None and num_events % 10_000 == 0:
            progress(num_events)
    num_runs = len(read_runs(path))
    return ModelSummaries(
        files=tuple(str(p) for p in log_files(path)),
        models=tuple(_summary(path, index, s, name, num_runs) for name, s in summarisers.items()),
    )


def _summary(
    path: str | Path, index: int | None, s: Summariser, model: str | None, num_runs: int
) -> Summary:
    header = read_header(path)
    if s.run is not None:
        s.end_run(last=s.run.index == num_runs)
    if index is not None and s.runs:
        header = s.first_header or header
    requests, tokens, waits, shapes, clock = s.requests, s.tokens, s.waits, s.shapes, s.clock
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
        busy_s=clock.busy_s(),
        idle_s=clock.idle_s(),
        num_requests=sum(requests.outcomes.values()),
        outcomes=dict(requests.outcomes.most_common()),
        num_prompt_tokens=tokens.num_prompt,
        num_cached_tokens=tokens.num_cached,
        num_prefilled_tokens=tokens.num_prefilled,
        num_output_tokens=tokens.num_output,
        ttft_s=requests.ttft.percentiles(),
        itl_s=waits.percentiles(),
        queueing_s=requests.queueing.percentiles(),
        e2e_s=requests.e2e.percentiles(),
        budget_utilisation=shapes.utilisation.percentiles(),
        seqs_per_step=shapes.seqs.percentiles(),
        longest_stalls=waits.stalls(),
        stall_threshold_s=waits.threshold(),
        stall_causes=tuple(waits.by_cause(s.top)),
        step_time=clock.step_times(),
        chunk_limits=dict(shapes.limits.most_common()),
        held_reasons=dict(shapes.held.most_common()),
        prefix_misses=dict(tokens.prefix_misses.most_common()),
        drafts=s.drafts.report(),
        next_turns=requests.next_turns(),
        slowest_steps=tuple(clock.slow_steps.items()),
        longest_idle=tuple(clock.idle_gaps.items()),
        in_flight=tuple(requests.in_flight),
        interrupted=tuple(requests.interrupted),
    )


def request_why(
    path: str | Path, request_id: str, *, run: int | None = None, model: str | None = None
) -> RequestWhy:
    """Why `request_id` (of `run`, 1-based, None for a log of one run; of `model`) took the
    time it took (why.py): one pass over its run with this summary's fold, following it.
    Raises what `summarize` raises."""
    s = Summariser(0, Focus(request_id))
    s.consume(scan_run_events(path, run=run, model=model), None)
    assert s.focus is not None
    caused = s.waits.by_cause(1, only=(s.run.index if s.run else 1, request_id))
    return explain(s.focus, s.waits.threshold(), caused[0] if caused else None)
