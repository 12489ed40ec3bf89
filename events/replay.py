"""Replay: answer questions about a recorded run from its event log alone.

Pure analysis, MLX-free, one streaming pass per question (constant memory in the length of
the log; proportional to the requests in it at most):

- `request_timeline`: one request's life, with TTFT, inter-token latencies and queueing time;
- `state_at_step`: every request's state as of a step, by the same `fold` the engine uses;
- `step_records`: per step, its members, tokens each and budget used;
- `summarize`: outcomes, latency percentiles, budget utilisation, stalls, requests in flight;
- `verify`: every violation of the engine's invariants, with the events that show it.

Every report is a frozen pydantic model, so `--json` is `model_dump_json()`.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from stepline.events.fold import RequestState, Status, fold
from stepline.events.log import LogCorruptError, log_files, read_events, read_header
from stepline.events.models import (
    Admitted,
    CheckpointReached,
    ChunkPrefilled,
    Decoding,
    Event,
    FinishReason,
    LogHeader,
    RequestParams,
    StepPlanned,
    Terminal,
)


class UnknownRequestError(LookupError):
    """The log holds no request with the asked-for id."""


class _Report(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---------------------------------------------------------------------------------------------
# Distributions: exact up to a point, then a log-scale histogram (bounded memory).


class Percentiles(_Report):
    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None


_EXACT_LIMIT = 100_000  # samples kept exactly; beyond, a histogram with ~1% relative error
_BIN_GROWTH = 1.01
_BIN_FLOOR = 1e-7  # values below this (and zero) share bin 0


class Distribution:
    """Collects samples for percentiles in bounded memory.

    Exact while it holds at most 100,000 samples; past that it folds them into a log-scale
    histogram whose percentiles are within 1% of the exact ones. Mean and max stay exact.
    """

    def __init__(self) -> None:
        self._values: array[float] | None = array("d")
        self._bins: Counter[int] = Counter()
        self.count = 0
        self._sum = 0.0
        self._max = -math.inf
        self._min = math.inf

    def add(self, value: float) -> None:
        self.count += 1
        self._sum += value
        self._max = max(self._max, value)
        self._min = min(self._min, value)
        if self._values is not None:
            self._values.append(value)
            if len(self._values) > _EXACT_LIMIT:
                for v in self._values:
                    self._bins[self._bin(v)] += 1
                self._values = None
        else:
            self._bins[self._bin(value)] += 1

    @staticmethod
    def _bin(value: float) -> int:
        if value <= _BIN_FLOOR:
            return 0
        return 1 + int(math.log(value / _BIN_FLOOR, _BIN_GROWTH))

    @staticmethod
    def _bin_value(index: int) -> float:
        if index == 0:
            return 0.0
        return _BIN_FLOOR * _BIN_GROWTH ** (index - 0.5)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 <= q <= 1), interpolated between exact samples; None if empty."""
        return self._quantiles((q,))[0]

    def _quantiles(self, qs: tuple[float, ...]) -> list[float | None]:
        if self.count == 0:
            return [None for _ in qs]
        if self._values is not None:
            ordered = sorted(self._values)
            out: list[float | None] = []
            for q in qs:
                pos = q * (len(ordered) - 1)
                lo = math.floor(pos)
                hi = min(lo + 1, len(ordered) - 1)
                out.append(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
            return out
        bins = sorted(self._bins.items())
        out = []
        for q in qs:
            rank = q * (self.count - 1)
            seen = 0
            value = self._max
            for index, n in bins:
                seen += n
                if seen > rank:
                    value = min(max(self._bin_value(index), self._min), self._max)
                    break
            out.append(value)
        return out

    def percentiles(self) -> Percentiles:
        if self.count == 0:
            return Percentiles(count=0)
        p50, p90, p99 = self._quantiles((0.5, 0.9, 0.99))
        return Percentiles(
            count=self.count, mean=self._sum / self.count, p50=p50, p90=p90, p99=p99, max=self._max
        )


def percentiles(values: Iterable[float]) -> Percentiles:
    dist = Distribution()
    for v in values:
        dist.add(v)
    return dist.percentiles()


class _TopK:
    """The k largest items by key, in bounded memory."""

    def __init__(self, k: int) -> None:
        self.k = k
        self._heap: list[tuple[float, int, Any]] = []
        self._n = 0

    def offer(self, key: float, item: Any) -> None:
        self._n += 1
        entry = (key, -self._n, item)  # ties: the earlier one wins
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, entry)
        elif entry > self._heap[0]:
            heapq.heapreplace(self._heap, entry)

    def items(self) -> list[Any]:
        return [item for _, _, item in sorted(self._heap, reverse=True)]


# ---------------------------------------------------------------------------------------------
# Shared report pieces.


class InFlight(_Report):
    """A request with no terminal event when the log ends (a crashed or cut-off run)."""

    request_id: str
    status: Status
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    admitted_step: int


def describe_status(
    status: Status,
    num_computed: int,
    num_prompt: int,
    num_output: int,
    reason: FinishReason | None = None,
) -> str:
    """'waiting', 'prefilling k of n', 'decoding, m tokens', 'finished: stop, m tokens'."""
    if status is Status.WAITING:
        return f"waiting ({num_prompt} prompt tokens)"
    if status is Status.PREFILLING:
        return f"prefilling {num_computed} of {num_prompt}"
    if status is Status.DECODING:
        return f"decoding, {num_output} token{'s' * (num_output != 1)}"
    return f"finished: {reason.value if reason else '?'}, {num_output} tokens"


def describe_event(event: Event) -> str:
    """One line for a person: 'seq 12 step 3 chunk-prefilled r1 [0, 512)'."""
    head = f"seq {event.seq} step {event.step} {event.type}"
    if isinstance(event, StepPlanned):
        used = sum(e.num_tokens for e in event.entries)
        return (
            f"{head}: {len(event.entries)} requests, {used}/{event.max_step_tokens} tokens "
            f"(max_num_seqs {event.max_num_seqs})"
        )
    rid = event.request_id
    if isinstance(event, Admitted):
        return f"{head} {rid}: {event.num_prompt_tokens} prompt tokens"
    if isinstance(event, ChunkPrefilled):
        return f"{head} {rid} [{event.start}, {event.end})"
    if isinstance(event, CheckpointReached):
        return f"{head} {rid} at {event.offset}"
    if isinstance(event, Decoding):
        return f"{head} {rid} {list(event.token_ids)}"
    if isinstance(event, Terminal):
        msg = f" ({event.message})" if event.message else ""
        return f"{head} {rid}: {event.reason.value}{msg}"
    return head


def _dump(event: Event) -> dict[str, Any]:
    return event.model_dump(mode="json")


# ---------------------------------------------------------------------------------------------
# Timeline of one request.


class ChunkRecord(_Report):
    seq: int
    step: int
    ts: float
    start: int
    end: int


class CheckpointRecord(_Report):
    seq: int
    step: int
    ts: float
    offset: int


class TokensRecord(_Report):
    seq: int
    step: int
    ts: float
    token_ids: tuple[int, ...]


class StepShare(_Report):
    """A step the request took part in, and what else it held."""

    step: int
    ts: float
    kind: str  # "prefill" or "decode"
    num_tokens: int  # this request's tokens in the step
    step_tokens: int  # all tokens in the step
    max_step_tokens: int
    others: tuple[str, ...]  # the other requests in the step


class TerminalRecord(_Report):
    seq: int
    step: int
    ts: float
    reason: FinishReason
    message: str | None


class RequestTimeline(_Report):
    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    cache_source: str | None
    checkpoints: tuple[int, ...]
    params: RequestParams
    prompt_logged: bool
    admitted_seq: int
    admitted_step: int
    admitted_ts: float
    steps: tuple[StepShare, ...]
    chunks: tuple[ChunkRecord, ...]
    checkpoints_reached: tuple[CheckpointRecord, ...]
    tokens: tuple[TokensRecord, ...]
    terminal: TerminalRecord | None
    num_output_tokens: int
    queueing_s: float | None  # admission -> the first step that scheduled it
    ttft_s: float | None  # admission -> first token
    e2e_s: float | None  # admission -> terminal
    itl_s: tuple[float, ...]  # time between consecutive token events
    itl: Percentiles


def request_timeline(path: str | Path, request_id: str) -> RequestTimeline:
    """The life of `request_id`, from the log alone.

    Raises UnknownRequestError if the log never admitted it, and what `read_events` raises.
    """
    admitted: Admitted | None = None
    steps: list[StepShare] = []
    chunks: list[ChunkRecord] = []
    checkpoints: list[CheckpointRecord] = []
    tokens: list[TokensRecord] = []
    terminal: Terminal | None = None
    for event in read_events(path):
        if isinstance(event, StepPlanned):
            if admitted is None:
                continue
            mine = [e for e in event.entries if e.request_id == request_id]
            if mine:
                steps.append(
                    StepShare(
                        step=event.step,
                        ts=event.ts,
                        kind=mine[0].kind,
                        num_tokens=mine[0].num_tokens,
                        step_tokens=sum(e.num_tokens for e in event.entries),
                        max_step_tokens=event.max_step_tokens,
                        others=tuple(
                            e.request_id for e in event.entries if e.request_id != request_id
                        ),
                    )
                )
            continue
        if event.request_id != request_id:
            continue
        at = {"seq": event.seq, "step": event.step, "ts": event.ts}
        if isinstance(event, Admitted):
            admitted = admitted or event
        elif isinstance(event, ChunkPrefilled):
            chunks.append(ChunkRecord(**at, start=event.start, end=event.end))
        elif isinstance(event, CheckpointReached):
            checkpoints.append(CheckpointRecord(**at, offset=event.offset))
        elif isinstance(event, Decoding):
            tokens.append(TokensRecord(**at, token_ids=event.token_ids))
        elif isinstance(event, Terminal):
            terminal = terminal or event
            break  # nothing of it follows a terminal (verify checks that)
    if admitted is None:
        raise UnknownRequestError(
            f"no request {request_id!r} in {path}: see the summary for the requests it holds"
        )
    t0 = admitted.ts
    itls = tuple(b.ts - a.ts for a, b in zip(tokens, tokens[1:], strict=False))
    first_scheduled = steps[0].ts if steps else (chunks[0].ts if chunks else None)
    return RequestTimeline(
        request_id=request_id,
        num_prompt_tokens=admitted.num_prompt_tokens,
        num_cached_tokens=admitted.num_cached_tokens,
        cache_source=admitted.cache_source,
        checkpoints=admitted.checkpoints,
        params=admitted.params,
        prompt_logged=admitted.prompt_token_ids is not None,
        admitted_seq=admitted.seq,
        admitted_step=admitted.step,
        admitted_ts=t0,
        steps=tuple(steps),
        chunks=tuple(chunks),
        checkpoints_reached=tuple(checkpoints),
        tokens=tuple(tokens),
        terminal=(
            TerminalRecord(
                seq=terminal.seq,
                step=terminal.step,
                ts=terminal.ts,
                reason=terminal.reason,
                message=terminal.message,
            )
            if terminal
            else None
        ),
        num_output_tokens=sum(len(t.token_ids) for t in tokens),
        queueing_s=None if first_scheduled is None else first_scheduled - t0,
        ttft_s=tokens[0].ts - t0 if tokens else None,
        e2e_s=terminal.ts - t0 if terminal else None,
        itl_s=itls,
        itl=percentiles(itls),
    )


# ---------------------------------------------------------------------------------------------
# State at a step.


class RequestAtStep(_Report):
    request_id: str
    status: Status
    description: str  # "prefilling 512 of 2048"
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None


class StateAtStep(_Report):
    step: int
    counts: dict[str, int]  # status -> number of requests
    requests: tuple[RequestAtStep, ...]  # in admission order


def state_at_step(path: str | Path, step: int) -> StateAtStep:
    """Every request's state after step `step`, by folding the log with the engine's `apply`.

    Raises FoldError if the log cannot be folded (run verify to see why).
    """
    states = fold(read_events(path), until_step=step)
    ordered = sorted(states.values(), key=lambda s: s.admitted_seq)
    return StateAtStep(
        step=step,
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
        ),
        num_prompt_tokens=s.num_prompt_tokens,
        num_computed_tokens=s.num_computed_tokens,
        num_output_tokens=s.num_output_tokens,
        finish_reason=s.finish_reason,
    )


# ---------------------------------------------------------------------------------------------
# Steps A..B.


class StepMember(_Report):
    request_id: str
    kind: str  # "prefill" or "decode"
    num_tokens: int
    prompt_range: tuple[int, int] | None = None  # for prefill: the prompt tokens computed


class StepRecord(_Report):
    step: int
    seq: int
    ts: float
    duration_s: float | None  # until the next step was planned; None for the last one
    members: tuple[StepMember, ...]
    num_tokens: int
    max_step_tokens: int
    num_seqs: int
    max_num_seqs: int
    utilisation: float  # num_tokens / max_step_tokens
    finished: tuple[str, ...]  # requests whose terminal event came in this step


class StepsReport(_Report):
    first: int | None
    last: int | None
    steps: tuple[StepRecord, ...]


@dataclass
class _OpenStep:
    event: StepPlanned
    ranges: dict[str, tuple[int, int]]
    finished: list[str]


def step_records(
    path: str | Path, first: int | None = None, last: int | None = None
) -> StepsReport:
    """Every step numbered first..last (inclusive; None = unbounded) with its members."""
    records: list[StepRecord] = []
    current: _OpenStep | None = None

    def close(open_step: _OpenStep, next_ts: float | None) -> None:
        e = open_step.event
        used = sum(m.num_tokens for m in e.entries)
        records.append(
            StepRecord(
                step=e.step,
                seq=e.seq,
                ts=e.ts,
                duration_s=None if next_ts is None else next_ts - e.ts,
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
                num_seqs=len(e.entries),
                max_num_seqs=e.max_num_seqs,
                utilisation=used / e.max_step_tokens if e.max_step_tokens else math.inf,
                finished=tuple(open_step.finished),
            )
        )

    for event in read_events(path):
        if isinstance(event, StepPlanned):
            if current is not None:
                close(current, event.ts)
                current = None
            if last is not None and event.step > last:
                break
            if first is None or event.step >= first:
                current = _OpenStep(event, {}, [])
        elif current is not None and event.step == current.event.step:
            if isinstance(event, ChunkPrefilled):
                lo, _ = current.ranges.get(event.request_id, (event.start, event.end))
                current.ranges[event.request_id] = (lo, event.end)  # chunks split at checkpoints
            elif isinstance(event, Terminal):
                current.finished.append(event.request_id)
    if current is not None:
        close(current, None)
    return StepsReport(first=first, last=last, steps=tuple(records))


# ---------------------------------------------------------------------------------------------
# Per-request tracking for the one-pass analyses.


@dataclass(slots=True)
class _Track:
    num_prompt_tokens: int
    num_computed: int
    admitted_step: int
    admitted_ts: float
    admission: Admitted | None = None  # kept by verify only (for evidence)
    first_scheduled_ts: float | None = None
    num_output: int = 0
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    last_token_step: int = 0
    last_chunk: ChunkPrefilled | None = None
    terminal: Terminal | None = None

    @property
    def status(self) -> Status:
        if self.terminal is not None:
            return Status.FINISHED
        if self.num_computed >= self.num_prompt_tokens:
            return Status.DECODING
        if self.last_chunk is None:
            return Status.WAITING
        return Status.PREFILLING


def _in_flight(tracks: dict[str, _Track]) -> list[InFlight]:
    return [
        InFlight(
            request_id=rid,
            status=t.status,
            num_prompt_tokens=t.num_prompt_tokens,
            num_computed_tokens=t.num_computed,
            num_output_tokens=t.num_output,
            admitted_step=t.admitted_step,
        )
        for rid, t in tracks.items()
        if t.terminal is None
    ]


# ---------------------------------------------------------------------------------------------
# Summary.


class Stall(_Report):
    """A long wait between two consecutive tokens of one request."""

    request_id: str
    seconds: float
    from_step: int
    to_step: int


class SlowStep(_Report):
    step: int
    seconds: float  # until the next step was planned
    num_tokens: int
    num_seqs: int


class Summary(_Report):
    files: tuple[str, ...]
    header: LogHeader
    num_events: int
    num_steps: int
    first_step: int | None
    last_step: int | None
    duration_s: float  # first event -> last event
    num_requests: int
    outcomes: dict[str, int]  # finish reason -> requests; "in-flight" for those without one
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
    in_flight: tuple[InFlight, ...]


def summarize(path: str | Path, *, top: int = 5) -> Summary:
    """Outcomes, latencies and scheduling figures of the whole log, in one streaming pass.

    Tolerant: events that break the invariants are counted as they come (verify reports them).
    """
    header = read_header(path)
    tracks: dict[str, _Track] = {}
    outcomes: Counter[str] = Counter()
    ttft, itl, queueing, e2e = Distribution(), Distribution(), Distribution(), Distribution()
    utilisation, seqs = Distribution(), Distribution()
    stalls, slow_steps = _TopK(top), _TopK(top)
    num_events = num_steps = 0
    num_prompt = num_cached = num_prefilled = num_output = 0
    first_ts = last_ts = None
    first_step = last_step = None
    prev_step: StepPlanned | None = None
    prev_step_tokens = 0

    for event in read_events(path):
        num_events += 1
        if first_ts is None:
            first_ts = event.ts
        last_ts = event.ts
        kind = type(event)
        if kind is Decoding:
            t = tracks.get(event.request_id)
            if t is None:
                continue
            n = len(event.token_ids)
            num_output += n
            if t.first_token_ts is None:
                t.first_token_ts = event.ts
                ttft.add(event.ts - t.admitted_ts)
            else:
                gap = event.ts - t.last_token_ts
                itl.add(gap)
                stalls.offer(
                    gap,
                    (event.request_id, gap, t.last_token_step, event.step),
                )
            t.last_token_ts = event.ts
            t.last_token_step = event.step
            t.num_output += n
        elif kind is StepPlanned:
            num_steps += 1
            if first_step is None:
                first_step = event.step
            last_step = event.step
            used = 0
            for entry in event.entries:
                used += entry.num_tokens
                t = tracks.get(entry.request_id)
                if t is not None and t.first_scheduled_ts is None:
                    t.first_scheduled_ts = event.ts
                    queueing.add(event.ts - t.admitted_ts)
            utilisation.add(used / event.max_step_tokens)
            seqs.add(len(event.entries))
            if prev_step is not None:
                slow_steps.offer(
                    event.ts - prev_step.ts,
                    (prev_step.step, event.ts - prev_step.ts, prev_step_tokens, prev_step),
                )
            prev_step, prev_step_tokens = event, used
        elif kind is ChunkPrefilled:
            t = tracks.get(event.request_id)
            num_prefilled += event.end - event.start
            if t is not None:
                t.num_computed = max(t.num_computed, event.end)
                t.last_chunk = event
        elif kind is Admitted:
            if event.request_id in tracks:
                continue
            tracks[event.request_id] = _Track(
                num_prompt_tokens=event.num_prompt_tokens,
                num_computed=event.num_cached_tokens,
                admitted_step=event.step,
                admitted_ts=event.ts,
            )
            num_prompt += event.num_prompt_tokens
            num_cached += event.num_cached_tokens
        elif kind is Terminal:
            t = tracks.pop(event.request_id, None)
            if t is None:
                continue  # a second terminal, or an unknown request: verify's business
            outcomes[event.reason.value] += 1
            e2e.add(event.ts - t.admitted_ts)

    in_flight = _in_flight(tracks)
    if in_flight:
        outcomes["in-flight"] = len(in_flight)
    return Summary(
        files=tuple(str(p) for p in log_files(path)),
        header=header,
        num_events=num_events,
        num_steps=num_steps,
        first_step=first_step,
        last_step=last_step,
        duration_s=(last_ts - first_ts) if first_ts is not None else 0.0,
        num_requests=sum(outcomes.values()),
        outcomes=dict(outcomes.most_common()),
        num_prompt_tokens=num_prompt,
        num_cached_tokens=num_cached,
        num_prefilled_tokens=num_prefilled,
        num_output_tokens=num_output,
        ttft_s=ttft.percentiles(),
        itl_s=itl.percentiles(),
        queueing_s=queueing.percentiles(),
        e2e_s=e2e.percentiles(),
        budget_utilisation=utilisation.percentiles(),
        seqs_per_step=seqs.percentiles(),
        longest_stalls=tuple(
            Stall(request_id=rid, seconds=s, from_step=a, to_step=b)
            for rid, s, a, b in stalls.items()
        ),
        slowest_steps=tuple(
            SlowStep(step=step, seconds=s, num_tokens=n, num_seqs=len(e.entries))
            for step, s, n, e in slow_steps.items()
        ),
        in_flight=tuple(in_flight),
    )


# ---------------------------------------------------------------------------------------------
# Verify.


class ViolationKind(StrEnum):
    SEQ_GAP = "seq-gap"  # sequence numbers skip
    SEQ_DUPLICATE = "seq-duplicate"  # a sequence number repeats or goes back
    STEP_BACKWARDS = "step-backwards"  # an event of an earlier step after a later one
    UNKNOWN_REQUEST = "unknown-request"  # an event for a request never admitted
    ADMITTED_TWICE = "admitted-twice"
    TWO_TERMINALS = "two-terminals"
    AFTER_TERMINAL = "event-after-terminal"
    NON_CONTIGUOUS_CHUNK = "non-contiguous-chunk"  # a gap, an overlap or an empty chunk
    CHUNK_PAST_PROMPT = "chunk-past-prompt"
    PROMPT_NOT_COVERED = "prompt-not-covered"  # tokens or a normal finish before the prompt
    CHECKPOINT_AHEAD = "checkpoint-ahead-of-prefill"  # snapshot of tokens not yet computed
    STEP_OVER_BUDGET = "step-over-budget"
    STEP_OVER_MAX_NUM_SEQS = "step-over-max-num-seqs"
    DUPLICATE_STEP_ENTRY = "duplicate-step-entry"  # a request twice in one step
    CORRUPT_LOG = "corrupt-log"  # a line that cannot be read; verification stops there


class Violation(_Report):
    kind: ViolationKind
    message: str
    request_id: str | None = None
    step: int | None = None
    events: tuple[dict[str, Any], ...] = ()  # the events that show it, in log order


class VerifyReport(_Report):
    files: tuple[str, ...]
    num_events: int
    num_requests: int
    num_steps: int
    ok: bool
    counts: dict[str, int]  # violation kind -> how many
    violations: tuple[Violation, ...]  # at most `max_per_kind` of each kind
    in_flight: tuple[InFlight, ...]  # admitted, no terminal: reported apart, not a violation


_NORMAL_ENDS = (FinishReason.STOP, FinishReason.LENGTH)


class _Verifier:
    def __init__(self, max_per_kind: int) -> None:
        self.max_per_kind = max_per_kind
        self.tracks: dict[str, _Track] = {}
        self.counts: Counter[str] = Counter()
        self.violations: list[Violation] = []
        self.num_events = 0
        self.num_steps = 0
        self.prev: Event | None = None

    def flag(
        self,
        kind: ViolationKind,
        message: str,
        *events: Event | None,
        request_id: str | None = None,
    ) -> None:
        self.counts[kind.value] += 1
        if self.counts[kind.value] > self.max_per_kind:
            return
        shown = [e for e in events if e is not None]
        self.violations.append(
            Violation(
                kind=kind,
                message=message,
                request_id=request_id,
                step=shown[-1].step if shown else None,
                events=tuple(_dump(e) for e in shown),
            )
        )

    def check(self, event: Event) -> None:
        self.num_events += 1
        prev = self.prev
        expected = 1 if prev is None else prev.seq + 1
        if event.seq > expected:
            missing = f"{expected}" if event.seq == expected + 1 else f"{expected}..{event.seq - 1}"
            self.flag(ViolationKind.SEQ_GAP, f"sequence numbers {missing} are missing", prev, event)
        elif event.seq < expected:
            self.flag(
                ViolationKind.SEQ_DUPLICATE,
                f"sequence number {event.seq} comes again after {expected - 1}",
                prev,
                event,
            )
        if prev is not None and event.step < prev.step:
            self.flag(
                ViolationKind.STEP_BACKWARDS,
                f"an event of step {event.step} follows one of step {prev.step}",
                prev,
                event,
            )
        if prev is None or event.seq >= prev.seq:
            self.prev = event

        if isinstance(event, StepPlanned):
            self.check_step(event)
            return
        rid = event.request_id
        t = self.tracks.get(rid)
        if isinstance(event, Admitted):
            if t is not None:
                self.flag(
                    ViolationKind.ADMITTED_TWICE,
                    f"request {rid} is admitted again",
                    t.admission,
                    event,
                    request_id=rid,
                )
                return
            self.tracks[rid] = _Track(
                num_prompt_tokens=event.num_prompt_tokens,
                num_computed=event.num_cached_tokens,
                admitted_step=event.step,
                admitted_ts=event.ts,
                admission=event.model_copy(update={"prompt_token_ids": None}),
            )
            return
        if t is None:
            self.flag(
                ViolationKind.UNKNOWN_REQUEST,
                f"{event.type} for request {rid}, which was never admitted",
                event,
                request_id=rid,
            )
            return
        if t.terminal is not None:
            if isinstance(event, Terminal):
                self.flag(
                    ViolationKind.TWO_TERMINALS,
                    f"request {rid} ends twice: {t.terminal.reason.value}, then "
                    f"{event.reason.value}",
                    t.terminal,
                    event,
                    request_id=rid,
                )
            else:
                self.flag(
                    ViolationKind.AFTER_TERMINAL,
                    f"{event.type} for request {rid} after its terminal event",
                    t.terminal,
                    event,
                    request_id=rid,
                )
            return
        if isinstance(event, ChunkPrefilled):
            self.check_chunk(t, event)
        elif isinstance(event, CheckpointReached):
            if event.offset > t.num_computed:
                self.flag(
                    ViolationKind.CHECKPOINT_AHEAD,
                    f"request {rid} snapshotted at {event.offset} with only {t.num_computed} "
                    "prompt tokens computed",
                    t.last_chunk or t.admission,
                    event,
                    request_id=rid,
                )
        elif isinstance(event, Decoding):
            if t.num_computed < t.num_prompt_tokens and t.num_output == 0:
                self.flag(
                    ViolationKind.PROMPT_NOT_COVERED,
                    f"request {rid} got tokens with {t.num_computed} of its "
                    f"{t.num_prompt_tokens} prompt tokens computed",
                    t.last_chunk or t.admission,
                    event,
                    request_id=rid,
                )
            t.num_output += len(event.token_ids)
        elif isinstance(event, Terminal):
            if event.reason in _NORMAL_ENDS and t.num_computed != t.num_prompt_tokens:
                self.flag(
                    ViolationKind.PROMPT_NOT_COVERED,
                    f"request {rid} finished ({event.reason.value}) with {t.num_computed} of "
                    f"its {t.num_prompt_tokens} prompt tokens computed",
                    t.last_chunk or t.admission,
                    event,
                    request_id=rid,
                )
            t.terminal = event
            t.admission = t.last_chunk = None  # a finished request keeps only its terminal

    def check_chunk(self, t: _Track, event: ChunkPrefilled) -> None:
        rid = event.request_id
        before = t.last_chunk or t.admission
        if event.end <= event.start:
            self.flag(
                ViolationKind.NON_CONTIGUOUS_CHUNK,
                f"request {rid} has an empty chunk [{event.start}, {event.end})",
                before,
                event,
                request_id=rid,
            )
        elif event.start > t.num_computed:
            self.flag(
                ViolationKind.NON_CONTIGUOUS_CHUNK,
                f"request {rid} skips prompt tokens [{t.num_computed}, {event.start}): its chunk "
                f"starts at {event.start}",
                before,
                event,
                request_id=rid,
            )
        elif event.start < t.num_computed:
            self.flag(
                ViolationKind.NON_CONTIGUOUS_CHUNK,
                f"request {rid} computes prompt tokens [{event.start}, "
                f"{min(event.end, t.num_computed)}) twice",
                before,
                event,
                request_id=rid,
            )
        if event.end > t.num_prompt_tokens:
            self.flag(
                ViolationKind.CHUNK_PAST_PROMPT,
                f"request {rid} has a chunk ending at {event.end}, past its "
                f"{t.num_prompt_tokens}-token prompt",
                event,
                request_id=rid,
            )
        t.num_computed = max(t.num_computed, event.end)
        t.last_chunk = event

    def check_step(self, event: StepPlanned) -> None:
        self.num_steps += 1
        used = sum(e.num_tokens for e in event.entries)
        if used > event.max_step_tokens:
            self.flag(
                ViolationKind.STEP_OVER_BUDGET,
                f"step {event.step} schedules {used} tokens, over its budget of "
                f"{event.max_step_tokens}",
                event,
            )
        if len(event.entries) > event.max_num_seqs:
            self.flag(
                ViolationKind.STEP_OVER_MAX_NUM_SEQS,
                f"step {event.step} runs {len(event.entries)} requests, over max_num_seqs "
                f"{event.max_num_seqs}",
                event,
            )
        seen: set[str] = set()
        for entry in event.entries:
            rid = entry.request_id
            if rid in seen:
                self.flag(
                    ViolationKind.DUPLICATE_STEP_ENTRY,
                    f"step {event.step} schedules request {rid} twice",
                    event,
                    request_id=rid,
                )
            seen.add(rid)
            t = self.tracks.get(rid)
            if t is None:
                self.flag(
                    ViolationKind.UNKNOWN_REQUEST,
                    f"step {event.step} schedules request {rid}, which was never admitted",
                    event,
                    request_id=rid,
                )
            elif t.terminal is not None:
                self.flag(
                    ViolationKind.AFTER_TERMINAL,
                    f"step {event.step} schedules request {rid} after its terminal event",
                    t.terminal,
                    event,
                    request_id=rid,
                )


def verify(path: str | Path, *, max_per_kind: int = 100) -> VerifyReport:
    """Check the log against the engine's invariants, in one streaming pass.

    Checks: sequence numbers contiguous from 1; steps never go back; every event belongs to an
    admitted request; at most one terminal per request and nothing after it; chunks contiguous,
    in order, inside the prompt, covering it (prefix-cache hits accounted for) before tokens
    or a stop/length finish; checkpoints not ahead of prefill; no step over its token budget
    or max_num_seqs, nor with a request twice. Requests with no terminal when the log ends
    are reported apart (`in_flight`), not as violations. A line that cannot be read is a
    `corrupt-log` violation, and verification stops there.
    """
    v = _Verifier(max_per_kind)
    try:
        for event in read_events(path):
            v.check(event)
    except LogCorruptError as exc:
        v.counts[ViolationKind.CORRUPT_LOG.value] += 1
        v.violations.append(Violation(kind=ViolationKind.CORRUPT_LOG, message=str(exc)))
    return VerifyReport(
        files=tuple(str(p) for p in log_files(path)),
        num_events=v.num_events,
        num_requests=len(v.tracks),
        num_steps=v.num_steps,
        ok=not v.counts,
        counts=dict(v.counts),
        violations=tuple(v.violations),
        in_flight=tuple(_in_flight(v.tracks)),
    )
