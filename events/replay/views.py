"""Replay's views of a run: one request's timeline, every request's state at a step, steps.

Each is one streaming pass over the log (memory bounded by the requests or steps asked
about). In a log of several runs, a view looks at one run (`run`, its 1-based index); in a
log several models share, the views of steps and states look at one model (`model`), while a
request's timeline finds its model.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field

from stepline.events.fold import RequestState, Status, fold
from stepline.events.log import read_events, read_runs
from stepline.events.models import (
    Admitted,
    ChunkPrefilled,
    Event,
    FinishReason,
    RequestParams,
    StepFinished,
    StepPlanned,
    Terminal,
)
from stepline.events.replay.describe import (
    RequestNotInLogError,
    UnknownRequestError,
    describe_images,
    describe_runs,
    describe_status,
    resolve_model,
    resolve_run,
)
from stepline.events.replay.stats import Percentiles, Report, percentiles
from stepline.events.replay.summary import request_why
from stepline.events.replay.why import RequestWhy
from stepline.events.scan import scan_run_events, to_builtins, token_ids

# ---------------------------------------------------------------------------------------------
# Timeline of one request.


class ChunkRecord(Report):
    seq: int
    step: int
    ts: float
    start: int
    end: int
    num_cached_tokens: int = 0  # on a request's first chunk: prompt tokens it reused
    cache_source: str | None = None


class CheckpointRecord(Report):
    seq: int
    step: int
    ts: float
    offset: int


class TokensRecord(Report):
    seq: int
    step: int
    ts: float
    token_ids: tuple[int, ...] | None  # None: the log left output ids out (log_outputs)
    num_tokens: int


class StepShare(Report):
    """A step the request took part in, and what else it held."""

    step: int
    ts: float
    kind: str  # "prefill" or "decode"
    num_tokens: int  # this request's tokens in the step
    step_tokens: int  # all tokens in the step
    max_step_tokens: int
    others: tuple[str, ...]  # the other requests in the step


class TerminalRecord(Report):
    seq: int
    step: int
    ts: float
    reason: FinishReason
    message: str | None
    # an embedding request's vector's length (`Terminal.dimensions`); shown only then
    dimensions: int | None = Field(default=None, exclude_if=lambda v: v is None)


class RequestTimeline(Report):
    request_id: str
    run: int  # the run it belongs to (1-based)
    model: str | None = None  # in a log several models share: the model that served it
    num_prompt_tokens: int
    num_cached_tokens: int
    cache_source: str | None
    # why the prefix-cache hit stops where it does (None: all but the last prompt token came
    # from it, no prefix cache, or a log before schema 8) and how far the prompt matched
    # what the cache held (`events.models.PrefixMiss`)
    prefix_miss: str | None = None
    prefix_shared: int = 0
    checkpoints: tuple[int, ...]
    params: RequestParams
    prompt_logged: bool
    outputs_logged: bool
    admitted_seq: int
    admitted_step: int
    admitted_ts: float
    steps: tuple[StepShare, ...]
    chunks: tuple[ChunkRecord, ...]
    checkpoints_reached: tuple[CheckpointRecord, ...]
    tokens: tuple[TokensRecord, ...]
    terminal: TerminalRecord | None
    interrupted: bool  # no terminal, and a later run followed: the engine stopped mid-way
    num_output_tokens: int
    queueing_s: float | None  # admission -> the first step that scheduled it
    ttft_s: float | None  # admission -> first token
    e2e_s: float | None  # admission -> terminal
    itl_s: tuple[float, ...]  # time between consecutive token events
    itl: Percentiles
    # The steps shown (None: unbounded): `within` narrows the step-by-step records; the
    # latencies above stay those of the whole life.
    first_step: int | None = None
    last_step: int | None = None
    why: RequestWhy | None = None  # where its time went, and what stalled it or it stalled

    def within(self, first: int | None, last: int | None) -> RequestTimeline:
        """The same timeline with only the records of steps first..last (inclusive)."""
        if first is None and last is None:
            return self

        def inside(step: int) -> bool:
            return (first is None or step >= first) and (last is None or step <= last)

        return self.model_copy(
            update={
                "first_step": first,
                "last_step": last,
                "steps": tuple(s for s in self.steps if inside(s.step)),
                "chunks": tuple(c for c in self.chunks if inside(c.step)),
                "checkpoints_reached": tuple(c for c in self.checkpoints_reached if inside(c.step)),
                "tokens": tuple(t for t in self.tokens if inside(t.step)),
                "terminal": self.terminal if self.terminal and inside(self.terminal.step) else None,
            }
        )


@dataclass
class _Life:
    """What one run's log says about the request."""

    admitted: Admitted
    steps: list[StepShare] = field(default_factory=list)
    chunks: list[ChunkRecord] = field(default_factory=list)
    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    tokens: list[TokensRecord] = field(default_factory=list)
    terminal: Terminal | None = None
    # why its prefix-cache hit stops where it does, and how far its prompt matched (its
    # first step's event says), once seen
    miss: tuple[str | None, int] | None = None


def _share(event: StepPlanned, request_id: str) -> StepShare | None:
    if request_id not in event.request_ids:
        return None
    mine = event.request_ids.index(request_id)
    return StepShare(
        step=event.step,
        ts=event.ts,
        kind=event.kinds[mine],
        num_tokens=event.num_tokens[mine],
        step_tokens=sum(event.num_tokens),
        max_step_tokens=event.max_step_tokens,
        others=tuple(rid for rid in event.request_ids if rid != request_id),
    )


def _note(life: _Life, event) -> None:  # one request's event, validated or light
    at = {"seq": event.seq, "step": event.step, "ts": event.ts}
    kind = event.type
    if kind in ("chunk-prefilled", "image-encoded") and life.miss is None:
        life.miss = (event.prefix_miss, event.prefix_shared)
    if kind == "chunk-prefilled":
        life.chunks.append(
            ChunkRecord(
                **at,
                start=event.start,
                end=event.end,
                num_cached_tokens=event.num_cached_tokens,
                cache_source=event.cache_source,
            )
        )
    elif kind == "checkpoint-reached":
        life.checkpoints.append(CheckpointRecord(**at, offset=event.offset))
    elif kind == "terminal":
        life.terminal = event


def _tokens_of(event, request_id: str) -> TokensRecord:  # a step's decoding event
    """The request's tokens of a step's `decoding` event (validated or light)."""
    ids = token_ids(event)
    rows = event.request_ids
    mine = (
        None if ids is None else tuple(t for r, t in zip(rows, ids, strict=True) if r == request_id)
    )
    return TokensRecord(
        seq=event.seq,
        step=event.step,
        ts=event.ts,
        token_ids=mine,
        num_tokens=rows.count(request_id),
    )


def request_timeline(
    path: str | Path,
    request_id: str,
    *,
    run: int | str | None = None,
    model: str | None = None,
) -> RequestTimeline:
    """The life of `request_id`, from the log alone (in `run`, or in whichever run has it; of
    `model`, or of whichever model served it: request ids are unique across a run's models).

    Raises UnknownRequestError if no run admitted it (RequestNotInLogError if the log has no
    trace of it), or several did and `run` is None; UnknownRunError for a run the log does not
    hold; UnknownModelError for a model it does not serve; and what `read_events` raises.
    """
    index = resolve_run(path, run)
    model = resolve_model(path, model, run=index)
    lives: dict[int, _Life] = {}
    refused: Terminal | None = None  # its lone terminal: refused at a door, never admitted
    outputs_logged: dict[int, bool] = {}
    models: dict[int, str | None] = {}
    for log_run, event in scan_run_events(path, run=index, model=model):
        life = lives.get(log_run.index)
        kind = event.type
        if kind == "step":
            share = _share(event, request_id) if life is not None else None
            if share is not None and life is not None and life.terminal is None:
                life.steps.append(share)
        elif kind == "decoding":
            if life is not None and life.terminal is None and request_id in event.request_ids:
                life.tokens.append(_tokens_of(event, request_id))
        elif event.request_id != request_id:
            continue
        elif kind == "admitted":
            if life is None:
                lives[log_run.index] = _Life(_validated(event))
                outputs_logged[log_run.index] = log_run.header.log_outputs
                models[log_run.index] = event.model
        elif life is not None and life.terminal is None:  # nothing follows it (verify checks)
            _note(life, event)
        elif life is None and kind == "terminal":
            refused = event
    if not lives:
        where = f"run {run} of {path}" if run is not None else str(path)
        if model is not None:
            where = f"model {model} of {where}"
        if refused is not None:
            raise UnknownRequestError(
                f"request {request_id!r} was refused before it was admitted ({refused.status} "
                f"{refused.code}: {refused.message}), at step {refused.step} of {where}"
            )
        raise RequestNotInLogError(
            f"no request {request_id!r} in {where}: see the summary for the requests it holds"
        )
    if len(lives) > 1:
        runs = [r for r in read_runs(path) if r.index in lives]
        raise UnknownRequestError(
            f"request {request_id!r} is in {len(lives)} runs of {path} ({describe_runs(runs)}): "
            "pick one with --run"
        )
    ((found, life),) = lives.items()
    later_run = life.terminal is None and found < len(read_runs(path))
    timeline = _timeline(request_id, found, life, outputs_logged[found], later_run)
    why = request_why(path, request_id, run=found, model=models[found] or model)
    return timeline.model_copy(update={"model": models[found], "why": why})


def _validated(event) -> Admitted:  # an admitted event, validated or light
    return event if isinstance(event, Admitted) else Admitted.model_validate(to_builtins(event))


def _timeline(
    request_id: str, run: int, life: _Life, outputs_logged: bool, later_run: bool
) -> RequestTimeline:
    admitted, tokens, terminal = life.admitted, life.tokens, life.terminal
    first_chunk = (
        life.chunks[0] if life.chunks else ChunkRecord(seq=0, step=0, ts=0, start=0, end=0)
    )
    t0 = admitted.ts
    itls = tuple(b.ts - a.ts for a, b in zip(tokens, tokens[1:], strict=False))
    first_scheduled = (
        life.steps[0].ts if life.steps else (life.chunks[0].ts if life.chunks else None)
    )
    return RequestTimeline(
        request_id=request_id,
        run=run,
        num_prompt_tokens=admitted.num_prompt_tokens,
        # Logs of schema 1 recorded a cache hit on `admitted`, newer ones on the first chunk.
        num_cached_tokens=admitted.num_cached_tokens or first_chunk.num_cached_tokens,
        cache_source=admitted.cache_source or first_chunk.cache_source,
        prefix_miss=life.miss[0] if life.miss else None,
        prefix_shared=life.miss[1] if life.miss else 0,
        checkpoints=admitted.checkpoints,
        params=admitted.params,
        prompt_logged=admitted.prompt_token_ids is not None,
        outputs_logged=outputs_logged,
        admitted_seq=admitted.seq,
        admitted_step=admitted.step,
        admitted_ts=t0,
        steps=tuple(life.steps),
        chunks=tuple(life.chunks),
        checkpoints_reached=tuple(life.checkpoints),
        tokens=tuple(tokens),
        terminal=(
            TerminalRecord(
                seq=terminal.seq,
                step=terminal.step,
                ts=terminal.ts,
                reason=terminal.reason,
                message=terminal.message,
                dimensions=terminal.dimensions,
            )
            if terminal
            else None
        ),
        interrupted=terminal is None and later_run,
        num_output_tokens=sum(t.num_tokens for t in tokens),
        queueing_s=None if first_scheduled is None else first_scheduled - t0,
        ttft_s=tokens[0].ts - t0 if tokens else None,
        e2e_s=terminal.ts - t0 if terminal else None,
        itl_s=itls,
        itl=percentiles(itls),
    )


# ---------------------------------------------------------------------------------------------
# State at a step.


class RequestAtStep(Report):
    request_id: str
    status: Status
    description: str  # "prefilling 512 of 2048"
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None


class StateAtStep(Report):
    step: int
    run: int
    model: str | None = None  # in a log several models share: whose steps
    last_step: int  # the last step the run's log reaches
    past_end: bool  # `step` is past it: the state shown is the one when the log ends
    counts: dict[str, int]  # status -> number of requests
    requests: tuple[RequestAtStep, ...]  # in admission order


def state_at_step(
    path: str | Path,
    step: int,
    *,
    run: int | str | None = None,
    model: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> StateAtStep:
    """Every request's state after step `step` (of `model`'s steps, in a log several models
    share), by folding the log with the engine's `apply`.

    `progress`, if given, is called with the number of events read every 10,000 events.
    Raises FoldError if the log cannot be folded (run verify to see why), RunNeededError if
    the log holds several runs and `run` is None, ModelNeededError if it serves several
    models and `model` is None, UnknownRunError, UnknownModelError.
    """
    index = resolve_run(path, run, needed=True)
    assert index is not None
    model = resolve_model(path, model, run=index, needed=True)
    last_step = 0

    def tracked() -> Iterator[Event]:
        nonlocal last_step
        events = read_events(path, run=index, model=model)
        for num_events, event in enumerate(events, start=1):
            last_step = max(last_step, event.step)
            if progress is not None and num_events % 10_000 == 0:
                progress(num_events)
            yield event

    states = fold(tracked(), until_step=step)
    ordered = sorted(states.values(), key=lambda s: s.admitted_seq)
    return StateAtStep(
        step=step,
        run=index,
        model=model,
        last_step=last_step,
        past_end=step > last_step,
        counts=dict(Counter(s.status.value for s in ordered)),
        requests=tuple(_at_step(s) for s in ordered),
    )


def _at_step(s: RequestState) -> RequestAtStep:
    return RequestAtStep(
        request_id=s.request_id,
        status=s.status,
        description=describe_status(
            s.status,
            s.num_computed_tokens,
            s.num_prompt_tokens,
            s.num_output_tokens,
            s.finish_reason,
        )
        + describe_images(s),
        num_prompt_tokens=s.num_prompt_tokens,
        num_computed_tokens=s.num_computed_tokens,
        num_output_tokens=s.num_output_tokens,
        finish_reason=s.finish_reason,
    )


# ---------------------------------------------------------------------------------------------
# Steps A..B.


class StepMember(Report):
    request_id: str
    kind: str  # "prefill" or "decode"
    num_tokens: int
    prompt_range: tuple[int, int] | None = None  # for prefill: the prompt tokens computed


class StepRecord(Report):
    step: int
    seq: int
    ts: float
    # The executor's measured time of the step; in logs without step-finished events (before
    # schema 2), estimated as the time until the next step was planned (None for the last).
    duration_s: float | None
    duration_estimated: bool
    predicted_s: float | None  # the scheduler's prediction, where it made one
    idle_after_s: float | None  # from the step's end to the next step's plan (measured only)
    members: tuple[StepMember, ...]
    num_tokens: int
    max_step_tokens: int
    num_seqs: int
    max_num_seqs: int
    utilisation: float  # num_tokens / max_step_tokens
    finished: tuple[str, ...]  # requests whose terminal event came in this step


class StepsReport(Report):
    run: int
    model: str | None = None  # in a log several models share: whose steps
    first: int | None
    last: int | None
    last_step: int | None  # the run's last planned step
    steps: tuple[StepRecord, ...]


@dataclass
class _OpenStep:
    event: StepPlanned
    ranges: dict[str, tuple[int, int]]
    finished: list[str]
    done: StepFinished | None = None


def _step_record(open_step: _OpenStep, next_ts: float | None) -> StepRecord:
    e, done = open_step.event, open_step.done
    used = sum(e.num_tokens)
    if done is not None:
        duration: float | None = done.seconds
        idle = None if next_ts is None else max(0.0, next_ts - done.ts)
    else:
        duration = None if next_ts is None else next_ts - e.ts
        idle = None
    return StepRecord(
        step=e.step,
        seq=e.seq,
        ts=e.ts,
        duration_s=duration,
        duration_estimated=done is None,
        predicted_s=done.predicted_seconds if done is not None else None,
        idle_after_s=idle,
        members=tuple(
            StepMember(
                request_id=m.request_id,
                kind=m.kind,
                num_tokens=m.num_tokens,
                prompt_range=open_step.ranges.get(m.request_id),
            )
            for m in e.entries
        ),
        num_tokens=used,
        max_step_tokens=e.max_step_tokens,
        num_seqs=len(e.request_ids),
        max_num_seqs=e.max_num_seqs,
        utilisation=used / e.max_step_tokens if e.max_step_tokens else math.inf,
        finished=tuple(open_step.finished),
    )


def step_records(
    path: str | Path,
    first: int | None = None,
    last: int | None = None,
    *,
    run: int | str | None = None,
    model: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> StepsReport:
    """Every step numbered first..last (inclusive; None = unbounded) with its members (of
    `model`'s steps, in a log several models share).

    `progress`, if given, is called with the number of events read every 10,000 events.
    Raises RunNeededError if the log holds several runs and `run` is None, ModelNeededError
    if it serves several models and `model` is None, UnknownRunError, UnknownModelError.
    """
    index = resolve_run(path, run, needed=True)
    assert index is not None
    model = resolve_model(path, model, run=index, needed=True)
    records: list[StepRecord] = []
    current: _OpenStep | None = None
    last_step: int | None = None
    events = read_events(path, run=index, model=model)
    for num_events, event in enumerate(events, start=1):
        if progress is not None and num_events % 10_000 == 0:
            progress(num_events)
        if isinstance(event, StepPlanned):
            last_step = event.step
            if current is not None:
                records.append(_step_record(current, event.ts))
                current = None
            if last is not None and event.step > last:
                break
            if first is None or event.step >= first:
                current = _OpenStep(event, {}, [])
        elif current is not None and event.step == current.event.step:
            if isinstance(event, StepFinished):
                current.done = event
            elif isinstance(event, ChunkPrefilled):
                lo, _ = current.ranges.get(event.request_id, (event.start, event.end))
                current.ranges[event.request_id] = (lo, event.end)  # chunks split at checkpoints
            elif isinstance(event, Terminal):
                current.finished.append(event.request_id)
    if current is not None:
        records.append(_step_record(current, None))
    return StepsReport(
        run=index, model=model, first=first, last=last, last_step=last_step, steps=tuple(records)
    )
