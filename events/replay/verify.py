"""Replay's verify: every violation of the engine's invariants, with the events that show it.

The rules about one request live in the fold (`events.fold.apply` raises a `FoldError` that
names the broken rule); verify applies each event with it and reports what it refuses, then
carries on as if the event had happened. The rules about the log itself (sequence numbers,
step order) and about a step (budget, max_num_seqs, members) are checked here.

Runs are verified one after the other: sequence numbers start again at 1 in each, and a
request a run left unfinished before a restart is `interrupted`, not a violation. In a log
several models share, each model's events are checked as a run of their own (its sequence
numbers contiguous from 1, its steps never going back); `verify_models` reports each model
apart.
"""

from __future__ import annotations

from collections import Counter
from enum import StrEnum
from pathlib import Path
from typing import Any

from stepline.events.fold import FoldError, RequestState, Status, apply, with_encoded
from stepline.events.log import (
    LogCorruptError,
    LogRun,
    log_files,
    read_models,
    read_runs,
)
from stepline.events.models import (
    Admitted,
    ChunkPrefilled,
    Decoding,
    Event,
    ImageEncoded,
    Parked,
    Resumed,
    StepPlanned,
    Terminal,
    TokensSampled,
    per_request,
)
from stepline.events.replay.describe import InFlight, dump_event, resolve_model, resolve_run
from stepline.events.replay.stalls import DecodingRows
from stepline.events.replay.stats import Report
from stepline.events.scan import scan_run_events, token_ids


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
    CHUNK_SPLITS_IMAGE = "chunk-splits-image"  # a chunk ends inside a whole image's span
    CHUNK_SPLITS_PROMPT = "chunk-splits-prompt"  # a part of a prompt that goes whole (BERT's)
    CHUNK_BEFORE_ENCODING = "chunk-before-encoding"  # an image's tokens before its encoder
    UNKNOWN_IMAGE = "unknown-image"  # encoder work for an image the prompt does not hold
    NON_CONTIGUOUS_ENCODING = "non-contiguous-encoding"  # encoder units skipped or twice
    PROMPT_NOT_COVERED = "prompt-not-covered"  # tokens or a normal finish before the prompt
    TOKENS_WHILE_PARKED = "tokens-while-parked"  # tokens for a request out of its seat
    PARK_OUT_OF_TURN = "park-out-of-turn"  # parked while not decoding, or resumed unparked
    CHECKPOINT_AHEAD = "checkpoint-ahead-of-prefill"  # snapshot of tokens not yet computed
    STEP_OVER_BUDGET = "step-over-budget"
    STEP_OVER_MAX_NUM_SEQS = "step-over-max-num-seqs"
    DUPLICATE_STEP_ENTRY = "duplicate-step-entry"  # a request twice in one step
    # the engine's own request (a next turn's prefill) started while a client's waited
    NEXT_TURN_BEFORE_CLIENT = "next-turn-before-client"
    UNKNOWN_MODEL = "unknown-model"  # an event of a model its run's header does not list
    CORRUPT_LOG = "corrupt-log"  # a line that cannot be read; verification stops there


class Violation(Report):
    kind: ViolationKind
    message: str
    request_id: str | None = None
    step: int | None = None
    run: int | None = None
    events: tuple[dict[str, Any], ...] = ()  # the events that show it, in log order


class VerifyReport(Report):
    files: tuple[str, ...]
    runs: tuple[LogRun, ...]
    model: str | None = None  # in a log several models share: whose events were checked
    num_events: int
    num_requests: int
    num_steps: int
    ok: bool
    counts: dict[str, int]  # violation kind -> how many
    violations: tuple[Violation, ...]  # at most `max_per_kind` of each kind
    in_flight: tuple[InFlight, ...]  # no terminal when the log ends: apart, not a violation
    interrupted: tuple[InFlight, ...]  # no terminal when a run ended and the next began


class ModelVerifyReports(Report):
    """Verification of a log several models share: one report per model, in the order the
    log's headers list them."""

    files: tuple[str, ...]
    ok: bool  # every model's report is
    models: tuple[VerifyReport, ...]


def _carry_on(state: RequestState, event: Event) -> RequestState:
    """The state as if a refused event had happened anyway, so one fault is reported once."""
    if isinstance(event, ChunkPrefilled):
        computed = max(state.num_computed_tokens, event.end)
        done = computed >= state.num_prompt_tokens
        return state.evolve(
            num_computed_tokens=computed,
            status=Status.DECODING if done else Status.PREFILLING,
        )
    if isinstance(event, Decoding):
        return state.evolve(num_output_tokens=state.num_output_tokens + event.num_tokens)
    if isinstance(event, Parked | Resumed):
        return state.evolve(parked=isinstance(event, Parked))
    if isinstance(event, ImageEncoded) and 0 <= event.image < len(state.encoded):
        return with_encoded(state, event.image, max(state.encoded[event.image], event.end))
    if isinstance(event, Terminal):
        return state.evolve(
            status=Status.FINISHED,
            finish_reason=event.reason,
            finished_step=event.step,
        )
    return state  # a checkpoint ahead of prefill changes nothing that later checks read


class _Verifier:
    def __init__(self, max_per_kind: int) -> None:
        self.max_per_kind = max_per_kind
        self.counts: Counter[str] = Counter()
        self.violations: list[Violation] = []
        self.runs: list[LogRun] = []
        self.num_events = self.num_steps = self.num_requests = 0
        self.in_flight: list[InFlight] = []
        self.interrupted: list[InFlight] = []
        self.run: LogRun | None = None

    def start_run(self, run: LogRun) -> None:
        self.end_run(last=False)
        self.run = run
        self.runs.append(run)
        self.states: dict[str, RequestState] = {}
        self.decoding: set[str] = set()  # the requests whose state is decoding
        self.rows = DecodingRows()  # their tokens (a state's `num_output_tokens` is not kept)
        # Per request, the event to show beside a violation: its admission (without the
        # prompt), its last chunk, or its terminal.
        self.evidence: dict[str, Event] = {}
        # Each model's last event: a model's sequence numbers and steps are its own.
        self.prev: dict[str | None, Event] = {}
        self.listed = run.header.models  # the models the run serves (none: its one model)
        self.unlisted: set[str | None] = set()

    def end_run(self, *, last: bool) -> None:
        if self.run is None:
            return
        self.num_requests += len(self.states)
        left = [
            InFlight(
                request_id=s.request_id,
                status=s.status,
                num_prompt_tokens=s.num_prompt_tokens,
                num_computed_tokens=s.num_computed_tokens,
                num_output_tokens=self.rows.num_tokens(s.request_id),
                admitted_step=s.admitted_step,
                run=self.run.index,
            )
            for s in self.states.values()
            if not s.is_finished
        ]
        (self.in_flight if last else self.interrupted).extend(left)
        self.run = None

    def corrupt(self, exc: LogCorruptError) -> None:
        """A line that cannot be read: verification stops there."""
        self.counts[ViolationKind.CORRUPT_LOG.value] += 1
        self.violations.append(Violation(kind=ViolationKind.CORRUPT_LOG, message=str(exc)))

    def report(self, path: str | Path, num_runs: int, model: str | None) -> VerifyReport:
        """What was found, once the log (as far as it was read) is through."""
        if self.run is not None:
            self.end_run(last=self.run.index == num_runs)
        return VerifyReport(
            files=tuple(str(p) for p in log_files(path)),
            runs=tuple(self.runs),
            model=model,
            num_events=self.num_events,
            num_requests=self.num_requests,
            num_steps=self.num_steps,
            ok=not self.counts,
            counts=dict(self.counts),
            violations=tuple(self.violations),
            in_flight=tuple(self.in_flight),
            interrupted=tuple(self.interrupted),
        )

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
                run=self.run.index if self.run is not None else None,
                events=tuple(dump_event(e) for e in shown),
            )
        )

    def check(self, event: Event) -> None:  # or a light step event (events/scan.py)
        self.num_events += 1
        self.check_order(event)
        kind = event.type
        if kind == "step":
            self.check_step(event)  # type: ignore[arg-type]
        elif kind == "decoding":
            self.check_rows(event)  # type: ignore[arg-type]
        elif kind != "step-finished":
            for one in per_request(event):
                self.check_request_event(one)

    def check_rows(self, event: TokensSampled) -> None:
        """A step's tokens: each row's request must be decoding (`apply_sampled`'s rule).
        Checked for the rows in bulk (a set inclusion); a row that breaks it is applied on its
        own, so that `apply` says what is wrong. Token counts go to `rows`."""
        ids = event.request_ids
        self.rows.feed(ids, event.ts, event.step)
        if self.decoding.issuperset(ids):
            return
        tokens = token_ids(event)
        for rid, n in Counter(ids).items():
            if rid not in self.decoding:
                mine = (
                    None
                    if tokens is None
                    else tuple(t for r, t in zip(ids, tokens, strict=True) if r == rid)
                )
                one = Decoding(
                    seq=event.seq,
                    ts=event.ts,
                    step=event.step,
                    model=event.model,
                    request_id=rid,
                    token_ids=mine,
                    token_count=None if mine is not None else n,
                )
                self.check_request_event(one)

    def check_order(self, event: Event) -> None:
        model = event.model
        # None in a log of several: the run's own events (a refusal before any model had it)
        listed = model is None or model in self.listed
        if self.listed and not listed and model not in self.unlisted:
            self.unlisted.add(model)
            self.flag(
                ViolationKind.UNKNOWN_MODEL,
                f"an event of model {model!r}, which the run's header does not list "
                f"(it lists {', '.join(self.listed)})",
                event,
            )
        prev = self.prev.get(model)
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
            self.prev[model] = event

    def check_request_event(self, event: Event | Decoding) -> None:
        rid = event.request_id
        assert rid is not None
        state = self.states.get(rid)
        try:
            after = apply(state, event)
        except FoldError as exc:
            kind = ViolationKind(exc.kind)
            shown = () if kind is ViolationKind.UNKNOWN_REQUEST else (self.evidence.get(rid),)
            self.flag(kind, str(exc), *shown, event, request_id=rid)
            if state is None or state.is_finished or isinstance(event, Admitted):
                return  # nothing to carry on with: the first admission and terminal stand
            after = _carry_on(state, event)
        self.states[rid] = after
        if after.status is Status.DECODING and not after.parked:
            self.decoding.add(rid)
        else:
            self.decoding.discard(rid)
        if isinstance(event, Admitted):
            # Kept as evidence without its prompt: memory stays bounded by the requests.
            self.evidence[rid] = event.model_copy(update={"prompt_token_ids": None})
            self.states[rid] = after.evolve(prompt_token_ids=None)
        elif isinstance(event, ChunkPrefilled | ImageEncoded | Terminal):
            self.evidence[rid] = event

    def _one_image_alone(self, event: StepPlanned) -> bool:
        """Whether the step's one prompt chunk is an image span whole, or a prompt that goes
        whole (a non-causal model's): a span no step could hold runs alone, past the budget
        (`policy.oversized_image`)."""
        chunks = [
            (rid, n)
            for rid, n, kind in zip(event.request_ids, event.num_tokens, event.kinds, strict=True)
            if kind == "prefill"
        ]
        if len(chunks) != 1:
            return False
        ((rid, n),) = chunks
        state = self.states.get(rid)
        if state is None:
            return False
        embed = state.params.embed
        if embed is not None and embed.whole:
            return n == state.num_prompt_tokens
        return any(
            i.whole and i.end - i.start == n and i.start >= state.num_computed_tokens
            for i in state.images
        )

    def check_step(self, event: StepPlanned) -> None:
        self.num_steps += 1
        used = sum(event.num_tokens)
        if used > event.max_step_tokens and not self._one_image_alone(event):
            self.flag(
                ViolationKind.STEP_OVER_BUDGET,
                f"step {event.step} schedules {used} tokens, over its budget of "
                f"{event.max_step_tokens}",
                event,
            )
        if len(event.request_ids) > event.max_num_seqs:
            self.flag(
                ViolationKind.STEP_OVER_MAX_NUM_SEQS,
                f"step {event.step} runs {len(event.request_ids)} requests, over max_num_seqs "
                f"{event.max_num_seqs}",
                event,
            )
        ids = event.request_ids
        states = self.states
        self._check_ours_wait(event)
        if len(set(ids)) == len(ids) and all(
            (state := states.get(rid)) is not None and not state.is_finished for rid in ids
        ):
            return  # the usual step: every member known, live and once
        seen: set[str] = set()
        for rid in ids:
            if rid in seen:
                self.flag(
                    ViolationKind.DUPLICATE_STEP_ENTRY,
                    f"step {event.step} schedules request {rid} twice",
                    event,
                    request_id=rid,
                )
            seen.add(rid)
            state = states.get(rid)
            if state is None:
                self.flag(
                    ViolationKind.UNKNOWN_REQUEST,
                    f"step {event.step} schedules request {rid}, which was never admitted",
                    event,
                    request_id=rid,
                )
            elif state.is_finished:
                self.flag(
                    ViolationKind.AFTER_TERMINAL,
                    f"step {event.step} schedules request {rid} after its terminal event",
                    self.evidence.get(rid),
                    event,
                    request_id=rid,
                )

    def _check_ours_wait(self, event: StepPlanned) -> None:
        """The engine's own requests start only while no client's request waits (a client's
        starting in the same step aside)."""
        states = self.states
        starting = [
            s
            for rid in event.request_ids
            if (s := states.get(rid)) is not None and s.status is Status.WAITING
        ]
        ours = [s for s in starting if s.is_background]
        if not ours:
            return
        joined = set(event.request_ids)
        for s in states.values():
            if s.status is Status.WAITING and not s.is_background and s.request_id not in joined:
                self.flag(
                    ViolationKind.NEXT_TURN_BEFORE_CLIENT,
                    f"step {event.step} starts the engine's own request {ours[0].request_id} "
                    f"while client request {s.request_id} waits",
                    event,
                    request_id=ours[0].request_id,
                )
                return


def verify(
    path: str | Path,
    *,
    max_per_kind: int = 100,
    run: int | str | None = None,
    model: str | None = None,
) -> VerifyReport:
    """Check the log (every run of it, or one `run`; every model of it, or one `model`)
    against the engine's invariants, in one streaming pass.

    Checks, per run and model: sequence numbers contiguous from 1; steps never go back;
    every event belongs to an admitted request; at most one terminal per request and
    nothing after it; chunks contiguous, in order, inside the prompt, covering it
    (prefix-cache hits accounted for) before tokens or a stop/length finish; checkpoints
    not ahead of prefill; no step over its token budget or max_num_seqs, nor with a request
    twice; in a log several models share, every event of a model its run's header lists.
    Requests with no terminal when their run ends are reported apart (`interrupted` if a
    later run followed, `in_flight` at the end of the log), not as violations. A line that
    cannot be read is a `corrupt-log` violation, and verification stops there. Raises
    UnknownRunError, UnknownModelError.
    """
    index = resolve_run(path, run)
    model = resolve_model(path, model, run=index)
    v = _Verifier(max_per_kind)
    try:
        for log_run, event in scan_run_events(path, run=index, model=model, requests=False):
            if v.run is None or v.run.index != log_run.index:
                v.start_run(log_run)
            v.check(event)
    except LogCorruptError as exc:
        v.corrupt(exc)
    return v.report(path, len(read_runs(path)), model)


def verify_models(
    path: str | Path, *, max_per_kind: int = 100, run: int | str | None = None
) -> ModelVerifyReports:
    """`verify` of each model of a log several models share (of one `run`), in one pass: each
    model's events checked as a log of their own, and a request id that two models admit
    reported (ids are unique across a run's models). Raises UnknownRunError."""
    index = resolve_run(path, run)
    verifiers = {name: _Verifier(max_per_kind) for name in read_models(path, run=index)}
    owners: dict[str, str | None] = {}  # request id -> the model that admitted it, this run
    run_now = None
    try:
        for log_run, event in scan_run_events(path, run=index, requests=False):
            if run_now != log_run.index:
                run_now, owners = log_run.index, {}
            name = log_run.header.model_of(event)
            v = verifiers.get(name) if name is not None else None
            if v is None:  # a model no header lists (its check names it)
                v = verifiers.setdefault(name or "?", _Verifier(max_per_kind))
            if v.run is None or v.run.index != log_run.index:
                v.start_run(log_run)
            v.check(event)
            if isinstance(event, Admitted):
                owner = owners.setdefault(event.request_id, name)
                if owner != name:
                    v.flag(
                        ViolationKind.ADMITTED_TWICE,
                        f"request {event.request_id} admitted by model {name}, and before by "
                        f"model {owner} (request ids are unique across a run's models)",
                        event,
                        request_id=event.request_id,
                    )
    except LogCorruptError as exc:
        if not verifiers:
            verifiers["?"] = _Verifier(max_per_kind)
        for v in verifiers.values():  # reading stopped there for every model
            v.corrupt(exc)
    num_runs = len(read_runs(path))
    reports = tuple(v.report(path, num_runs, name) for name, v in verifiers.items())
    return ModelVerifyReports(
        files=tuple(str(p) for p in log_files(path)),
        ok=all(r.ok for r in reports),
        models=reports,
    )
