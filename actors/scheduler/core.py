"""The scheduler core: every fact about every request, changed only by events.

Synchronous and MLX-free (vLLM's `EngineCore` / `Scheduler`, nano-vllm's `Scheduler`).
The step loop (actors/step_loop.py) is its async shell:

    core.add(...) / core.abort(...)            what the inbox brought
    work = core.schedule()                     the next step (or None)
    result = await executor.call(runner.run, work)
    updates = core.update_from_output(work, result)
    log.append(core.take_events()); tell each request actor its update

Who owns which fact about a request:

| fact                                   | owner                                              |
|----------------------------------------|----------------------------------------------------|
| prompt ids, params, checkpoints, its   | its `RequestState` (from `Admitted`)               |
| client (who sent it: fair share)       |                                                    |
| its token limit                        | `params.max_tokens`, cut to the context when it is |
|                                        | admitted (`add`); the runner reads it              |
|                                        | (`NewRequest.params`), never recomputes it         |
| phase (waiting / prefilling / decoding /| `RequestState.status`; ended requests move to     |
| ended), tokens computed, output count  | `finished`; its actor reads the count in each      |
|                                        | `Update`, never counts for itself                  |
| its cache hit and where it came from   | `RequestState.num_cached_tokens` / `cache_source`  |
|                                        | (from its first `ChunkPrefilled`)                  |
| the executor still holds its arrays    | `book.to_free` (until the next step or             |
|                                        | housekeeping; bookkeeping.py `RequestBook`)        |
| a disk entry was loaded for it         | `book.disk_tried`                                  |
| whether its answer now loops           | `book.loop_guards` (its last generated ids, where  |
|                                        | its params ask for a loop guard: loop_guard.py)    |
| output ids and text                    | its request actor (detokenizer, stop strings)      |
| MLX arrays (cache, prompt, sampling)   | the executor's runner (`engine/sequences.Seq`)     |

Every `RequestState` change is an event recorded here and applied with the fold's `apply`
(events/fold.py), the function replay uses: folding the log gives exactly `states`. A
step's sampled tokens are one `TokensSampled` event, applied row by row with the fold's
`apply_sampled`. The events' fields are plain functions of the plan, a request's state and
the executor's result (step_records.py). A refusal is reported by its kind
(`admission.Refusal`); the HTTP status the client got, which its `terminal` records, is
the API layer's (`refusal_status`, from api/refusals.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from stepline.actors.host import StepConditions
from stepline.actors.messages import Update
from stepline.actors.scheduler.admission import (
    AdmissionError,
    EngineDeadError,
    QueueFullError,
    Refusal,
    check_admissible,
    check_queue,
    max_output_tokens,
)
from stepline.actors.scheduler.background import preemptions, stale
from stepline.actors.scheduler.bookkeeping import RequestBook
from stepline.actors.scheduler.cost_model import CostModel
from stepline.actors.scheduler.drafter import Drafter, SpeculativeConfig, speculates
from stepline.actors.scheduler.plan import (
    ScheduledChunk,
    ScheduledEncode,
    SchedulerConfig,
    StepPlan,
)
from stepline.actors.scheduler.policy import schedule
from stepline.actors.scheduler.prefix_candidates import (
    outside_images,
    prefix_candidates,
    whole_prompt_pooled,
)
from stepline.actors.scheduler.prefix_index import PrefixIndex, PrefixPlan, Tokens, plan_prefixes
from stepline.actors.scheduler.spans import PromptImage, check_spans, prompt_key
from stepline.actors.scheduler.step_records import (
    ModelLimits,
    StepOutcome,
    admitted,
    chunk_records,
    cut_at_finish,
    planned,
)
from stepline.actors.scheduler.work import (
    Housekeeping,
    NewRequest,
    PrefixReport,
    StepResult,
    StepWork,
)
from stepline.events.fold import RequestState, Status, apply, apply_sampled
from stepline.events.models import (
    Admitted,
    Event,
    FinishReason,
    ImageEncoded,
    Origin,
    Parked,
    RequestParams,
    Resumed,
    StepFinished,
    StepPlanned,
    Terminal,
    TokensSampled,
)

__all__ = ["EngineDeadError", "ModelLimits", "SchedulerCore", "StepOutcome"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class LogPlace:
    """Where a model's events go on in a log that several models share (api/pool.py): its
    name, put on each event, and the last sequence number and step of its earlier loads in
    this run, so that its events read as one run of one model."""

    model: str
    seq: int = 0
    step: int = 0


class SchedulerCore:
    def __init__(
        self,
        config: SchedulerConfig,
        limits: ModelLimits,
        *,
        index: PrefixIndex | None = None,  # None: no prefix cache
        cost_model: CostModel | None = None,  # learns step times; None: tokens only
        salt: str | None = None,  # the event log's prompt-digest salt
        place: LogPlace | None = None,  # in a log of several models; None: the run's one
        speculative: SpeculativeConfig | None = None,  # drafted decoding; None: none
        # the status the API answers each refusal kind with, for the log; none: no status
        refusal_status: Mapping[Refusal, int] | None = None,
    ) -> None:
        self.config = config
        self.refusal_status: Mapping[Refusal, int] = refusal_status or {}
        self.speculative = speculative
        self.limits = limits
        self.index = index
        self.cost_model = cost_model
        self.salt = salt
        self.states: dict[str, RequestState] = {}  # unfinished requests
        self.book = RequestBook()  # what it keeps of requests beside their states
        self.model = place.model if place is not None else None  # on every event
        self.seq = place.seq if place is not None else 0  # the last event's sequence number
        self.step = place.step if place is not None else 0  # the last step scheduled
        self.in_step = False  # between `schedule` and `update_from_output`
        self.dead_reason: str | None = None  # set once the engine can serve no more
        self._events: list[Event] = []  # recorded, not yet taken (`take_events`)
        self._drops: list[Tokens] = []  # prefix entries the index let go, for the store
        self._promote: tuple[Tokens, ...] = ()  # disk entries a plan wants loaded

    # -- reading ------------------------------------------------------------------------

    def state_of(self, request_id: str) -> RequestState | None:
        """A request's state: live, or ended recently (the log has every one)."""
        return self.states.get(request_id) or self.book.finished.get(request_id)

    @property
    def finished(self) -> OrderedDict[str, RequestState]:
        """The recent ended requests' states, oldest first."""
        return self.book.finished

    @property
    def has_work(self) -> bool:
        """Something to run: a request, or executor state to free, drop or load."""
        return bool(self.states or self.book.to_free or self._drops or self._promote)

    def take_events(self) -> list[Event]:
        """The events recorded since the last call, in order (for the event log)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    # -- requests in ----------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: RequestParams,
        checkpoints: Sequence[int] = (),
        client: str | None = None,
        images: Sequence[PromptImage] = (),
        adapter: str | None = None,
        door: str | None = None,
        origin: Origin = "client",
    ) -> None:
        """Admit a request of `client` (None: the anonymous one; the policy shares the slots
        fairly between clients) into the waiting queue, its `max_tokens` cut to what the
        model's context leaves after its prompt (`max_output_tokens`: the `admitted` event
        records the limit it runs to). Raises AdmissionError (EngineDeadError,
        QueueFullError, ...) if it cannot be served. One the full queue refuses is recorded
        as a door's refusal (`refuse`: a lone terminal); one that got as far as the checks of
        its prompt is recorded as admitted and at once rejected, so the log says why. A
        request of `origin` "next-turn" is the engine's own: it takes only what no client's
        request wants (background.py)."""
        if self.book.has_seen(request_id):
            raise AdmissionError(f"request id {request_id!r} was already used: send a new one")
        self.book.remember(request_id)
        ids = tuple(prompt_token_ids)
        check_spans(images, len(ids))
        own = len(ids) - 1
        exact = self.limits.exact_prefixes and params.embed is None  # an embedding: no reuse
        # A next turn's prefill too, on any cache: its client's next request, arriving while
        # it runs, waits for that snapshot rather than computing the prefix beside it.
        if self.index is not None and (exact or origin != "client") and own not in checkpoints:
            # the same prompt sent again then reuses all but its last token
            if own > 0:
                checkpoints = (*checkpoints, own)
                self.book.own_checkpoints[request_id] = own
        if self.index is not None and exact and not images:
            # Where it parts from a cached prompt that has no snapshot there: a client that
            # rewrites the same place every turn (a clock line in its system prompt) parts
            # there again next turn, and finds this one.
            parting = self.index.parting(prompt_key(ids, images, adapter))
            if parting is not None and parting < own:
                checkpoints = (*checkpoints, parting)
        if self.dead_reason is None:
            try:
                check_queue(self.states, self.config, client, background=origin != "client")
            except QueueFullError as exc:
                # Refused before it joins the queue, whatever its prompt: at the door, its
                # kind as the code and the status the API answers it with (`refusal_status`).
                status = self.refusal_status.get(exc.refusal)
                self._refused(request_id, str(exc), code=exc.refusal.value, status=status)
                raise
        refused: AdmissionError | None = None
        try:
            if self.dead_reason is not None:
                raise EngineDeadError(f"the engine is unhealthy: {self.dead_reason}")
            # It ends at the context anyway: its KV is counted (and refused) only up to there.
            max_context = self.limits.max_context
            max_tokens = max_output_tokens(params.max_tokens, len(ids), max_context)
            check_admissible(
                len(ids), max_tokens, max_context, self.config, embedding=params.embed is not None
            )
            if max_tokens < params.max_tokens:
                params = params.model_copy(update={"max_tokens": max_tokens})
        except AdmissionError as exc:
            refused = exc
        self._record(
            Admitted,
            **admitted(request_id, ids, params, checkpoints, client, images, self.salt),
            adapter=adapter,
            door=door,
            origin=origin,
        )
        if refused is not None:
            self._record(
                Terminal, request_id=request_id, reason=FinishReason.REJECTED, message=str(refused)
            )
            raise refused
        drafts = self.speculative is not None and speculates(params) and not images
        drafter = Drafter(self.speculative, ids) if drafts else None
        self.book.admitted(request_id, images, drafter, params.loop_guard)

    def refuse(self, request_id: str, message: str, *, code: str, status: int) -> Terminal | None:
        """Record a request refused before it reached the engine (at an HTTP door: bad
        parameters, a body too large, an unknown model): a lone `terminal`, reason rejected,
        with the error's `code` and HTTP `status`, and nothing of its prompt. Returns the
        event; None for an id the core has seen already (its own events tell its end)."""
        if self.book.has_seen(request_id):
            return None
        self.book.remember(request_id)
        return self._refused(request_id, message, code=code, status=status)

    def _refused(self, request_id: str, message: str, *, code: str, status: int | None) -> Any:
        return self._record(
            Terminal,
            request_id=request_id,
            reason=FinishReason.REJECTED,
            message=message,
            code=code,
            status=status,
        )

    def abort(
        self, request_id: str, reason: FinishReason, message: str | None = None
    ) -> Update | None:
        """End a live request the steps did not end (cancelled, its actor failed, a fault).
        Returns the update for its actor, or None if it had ended already."""
        state = self.states.get(request_id)
        if state is None:
            return None
        self._record(Terminal, request_id=request_id, reason=reason, message=message)
        return Update(num_output_tokens=state.num_output_tokens, finish=reason, message=message)

    def fail(self, reason: str) -> dict[str, Update]:
        """The engine cannot go on: end every live request with an error; admit no more.
        Returns each ended request's update."""
        self.dead_reason = reason
        updates = {
            rid: Update(
                num_output_tokens=s.num_output_tokens, finish=FinishReason.ERROR, message=reason
            )
            for rid, s in self.states.items()
        }
        for rid in updates:
            self._record(Terminal, request_id=rid, reason=FinishReason.ERROR, message=reason)
        self.book.take_frees()
        self._promote = ()
        self.in_step = False
        return updates

    # -- a step -------------------------------------------------------------------------

    def preemptions(self) -> tuple[str, ...]:
        """The engine's own running requests (a next turn's prefill) that a waiting client's
        request needs the seat or the KV of: to end (`abort`, cancelled) before the next step
        (background.py)."""
        if not any(s.is_background for s in self.states.values()):
            return ()
        live = sorted(self.states.values(), key=lambda s: s.admitted_seq)
        return preemptions(live, self.config)

    def stale(self) -> tuple[str, ...]:
        """The engine's own requests (a next turn's prefill) that their client's next request
        made pointless: to end (`abort`, cancelled) before the next step (background.py)."""
        if not any(s.is_background for s in self.states.values()):
            return ()
        return stale(sorted(self.states.values(), key=lambda s: s.admitted_seq))

    def housekeeping(self, *, before_step: bool = False) -> Housekeeping | None:
        """What the executor must do without a step: frees, retirements, entry drops and
        loads, taken once. `before_step`: only when a waiting request may start from a
        cache that ended requests leave (the next turn of a chat); else whenever any."""
        if before_step:
            reusable = any(self.book.to_free.values())  # checked first: usually nothing is
            if not (reusable and any(s.status is Status.WAITING for s in self.states.values())):
                return None
        elif not (self.book.to_free or self._drops or self._promote):
            return None
        return self._take_housekeeping()

    def _take_housekeeping(self) -> Housekeeping:
        frees = self.book.take_frees()
        drops, self._drops = self._drops, []
        promote, self._promote = self._promote, ()
        return Housekeeping(
            free=tuple(frees),
            retire=frozenset(r for r, reusable in frees.items() if reusable),
            drop_entries=tuple(drops),
            promote=promote,
        )

    def schedule(self) -> StepWork | None:
        """The next step's work (its plan, the requests it admits into the executor, and
        the housekeeping that goes first), recorded as a `StepPlanned` event; None if no
        request can run now (what is left to free or load: `housekeeping()`)."""
        prefix = self._plan_prefixes()
        cost = None
        if self.cost_model is not None:
            # A refit (~3 ms of numpy) only when a chunk is to be sized; a decode-only step's
            # prediction, for the log, comes from the last fit.
            chunked = any(s.status is not Status.DECODING for s in self.states.values())
            cost = self.cost_model.cost if chunked else self.cost_model.last
        plan = schedule(
            self.states,
            self.config,
            self.step + 1,
            cost,
            prefix,
            self.book.propose_drafts(self.states),
        )
        self._promote = prefix.promote
        if plan.is_empty:
            return None
        self.book.drafts_planned(plan)
        self.step += 1
        self.in_step = True
        if plan.num_tokens > self.config.max_step_tokens:  # a whole span no step could hold
            spec = self.states[plan.chunks[0].request_id].params.embed
            whole_prompt = spec is not None and spec.whole  # a BERT input (engine/bert.py)
            log.info(
                "prompt_over_budget" if whole_prompt else "image_span_over_budget",
                step=self.step,
                request_id=plan.chunks[0].request_id,
                num_tokens=plan.num_tokens,
                max_step_tokens=self.config.max_step_tokens,
            )
        self._record(StepPlanned, **planned(plan, self.config))
        states = self.states
        starting = [c.request_id for c in plan.chunks] + [e.request_id for e in plan.encodes]
        admit = tuple(
            self._new_request(rid, prefix)
            for rid in starting
            if states[rid].status is Status.WAITING
        )
        return StepWork(plan=plan, admit=admit, **self._take_housekeeping().__dict__)

    def _plan_prefixes(self) -> PrefixPlan:
        if self.index is None or not any(s.status is Status.WAITING for s in self.states.values()):
            return PrefixPlan()
        states = self.states
        candidates = prefix_candidates(
            states,
            lambda rid: prompt_key(
                states[rid].prompt_token_ids or (), states[rid].images, states[rid].adapter
            ),
            self.step + 1,
            self.config,
            self.book.disk_tried,
        )
        prefix = outside_images(plan_prefixes(candidates, self.index), states)
        prefix = whole_prompt_pooled(prefix, states)
        self.book.disk_tried.update(prefix.loading)
        return prefix

    def _new_request(self, rid: str, prefix: PrefixPlan) -> NewRequest:
        state = self.states[rid]
        match = prefix.matches.get(rid)
        if match is not None and self.index is not None:
            self.index.touch(match.tokens)
        if self.index is not None:
            key = prompt_key(state.prompt_token_ids or (), state.images, state.adapter)
            self.book.missed(rid, self.index.explain(key, prefix.cached.get(rid, 0)))
        return NewRequest(
            request_id=rid,
            prompt_token_ids=state.prompt_token_ids or (),
            params=state.params,
            prefix=match.tokens if match is not None else None,
            num_cached_tokens=match.num_tokens if match is not None else 0,
            images=self.book.take_images(rid),
            own_checkpoint=self.book.own_checkpoints.pop(rid, None),
            adapter=state.adapter,
        )

    def update_from_output(
        self, work: StepWork, result: StepResult, ran_under: StepConditions | None = None
    ) -> StepOutcome:
        """Record step `work`'s outcome — its time and what it `ran_under` (the engine's
        warm-up, the host's load), requests the executor dropped, chunks, checkpoints,
        tokens, ends by stop token or length — and return each request's update. Requests no
        longer live (aborted while the step ran) are skipped."""
        plan = work.plan
        ran_under = ran_under or StepConditions()
        self._record(
            StepFinished,
            seconds=result.seconds,
            predicted_seconds=plan.predicted_seconds,
            # still learning its step times: the warm-up's, or a model with no fit yet
            warming_up=ran_under.warming_up
            or (self.cost_model is not None and plan.predicted_seconds is None),
            cpu_share=ran_under.cpu_share,
            load_avg=ran_under.load_avg,
        )
        if self.cost_model is not None:
            self.cost_model.observe(plan.features, result.seconds)
        out = StepOutcome()
        updates = out.updates
        for rid, what in result.failed.items():
            # Its free still goes out with its end: a no-op here, but other ranks of a
            # distributed engine still hold the request.
            update = self.abort(rid, FinishReason.ERROR, what)
            if update is not None:
                updates[rid] = update
        for encode in plan.encodes:
            self._encoded(encode, out)
        for chunk in plan.chunks:
            self._chunk_done(chunk, result, out)
        states = self.states
        drafted = result.drafted
        live = [
            (rid, [*drafted[rid], token] if rid in drafted else [token])
            for rid, token in result.tokens.items()
            if rid in states
        ]
        self.book.drafts_verified(plan.drafts, drafted, live)
        if live:
            self._tokens_sampled(live, result, out)
        self._seat_moves(plan)
        self.in_step = False
        self.apply_prefix_report(result.prefix)
        return out

    def _seat_moves(self, plan: StepPlan) -> None:
        """Record the step's seat changes (the executor made them after its forward): rows
        parked, parked requests back in the batch (those still live)."""
        states = self.states
        for rid in plan.parks:
            if rid in states:  # (not ended by this step's token)
                self._record(Parked, request_id=rid, reason="fair-share")
        for rid in plan.resumes:
            if rid in states:
                self._record(Resumed, request_id=rid)

    def _tokens_sampled(
        self, live: list[tuple[str, list[int]]], result: StepResult, out: StepOutcome
    ) -> None:
        """Record a step's tokens as one event (a row a token: a row that kept drafts has
        several), apply each request's rows with the fold's `apply_sampled`, and end the
        requests a token ends (stop token, length, a loop): the tokens after it are dropped."""
        kept = cut_at_finish(self.states, live, self.limits, self.book.loop_guards)
        event = self._record(
            TokensSampled,
            request_ids=tuple(rid for rid, tokens, _ in kept for _ in tokens),
            token_ids=tuple(token for _, tokens, _ in kept for token in tokens),
        )
        states, logprobs = self.states, result.logprobs
        for rid, tokens, finish in kept:
            before = states[rid]
            after = states[rid] = apply_sampled(before, event, len(tokens))
            logprob = logprobs.get(rid) if logprobs else None
            out.sampled(before, after, tokens, event.ts, logprob, finish)
            if finish is not None:
                self._record(Terminal, request_id=rid, reason=finish, message=None)

    def _encoded(self, encode: ScheduledEncode, out: StepOutcome) -> None:
        """Record an image's encoder units done (a request's first step: its cache hit)."""
        rid = encode.request_id
        state = self.states.get(rid)
        if state is None:
            return
        miss = self.book.take_miss(rid)
        out.encoded(state, encode, miss)
        self._record(
            ImageEncoded,
            request_id=rid,
            image=encode.image,
            start=encode.start,
            end=encode.end,
            num_cached_tokens=encode.cached,
            cache_source=self.book.cache_source(rid) if encode.cached else None,
            **miss,
        )

    def _chunk_done(self, chunk: ScheduledChunk, result: StepResult, out: StepOutcome) -> None:
        rid = chunk.request_id
        state = self.states.get(rid)
        if state is None:
            return
        reached = result.checkpoints.get(rid, ())
        book = self.book
        miss = book.take_miss(rid)
        for cls, fields in chunk_records(state, chunk, reached, book.cache_source(rid), miss):
            self._record(cls, **fields)
        out.prefilled(state, chunk, miss)
        if chunk.is_final and state.params.embed is not None:
            self._embedded(rid, result.embeddings.get(rid), out)

    def _embedded(self, rid: str, vector: tuple[float, ...] | None, out: StepOutcome) -> None:
        """An embedding request's prompt is done: it ends (stop) with its vector, which its
        update carries; the log records the vector's length."""
        if vector is None:  # the executor failed it (`result.failed`): ended already
            return
        self._record(Terminal, request_id=rid, reason=FinishReason.STOP, dimensions=len(vector))
        update = out.updates[rid]
        update.finish = FinishReason.STOP
        update.embedding = vector

    def apply_prefix_report(self, report: PrefixReport | None) -> None:
        """The prefix store's changes (after a step or housekeeping), into the index."""
        if report is None or self.index is None:
            return
        self._drops.extend(self.index.apply(report.new, report.disk_added, report.disk_removed))

    # -- recording -----------------------------------------------------------------------

    def record_model_event(self, cls: type, **fields: Any) -> Any:
        """Record an event of the model's own (`ModelLoaded`, `ModelUnloaded`): in its
        sequence, for the log. Returns the event."""
        return self._record(cls, **fields)

    @property
    def place(self) -> LogPlace | None:
        """Where this model's events stop now (for its next load), in a log of several."""
        return None if self.model is None else LogPlace(self.model, self.seq, self.step)

    def _record(self, cls: type, **fields: Any) -> Any:
        """Record one event: apply it to its request's state (the fold's `apply`) and keep
        it for the log. Returns the event."""
        self.seq += 1
        # Events between steps N and N+1 belong to step N+1, so that folding the log up to
        # step N gives exactly the state the core had when step N ended.
        step = self.step if self.in_step else self.step + 1
        event = cls(seq=self.seq, ts=time.time(), step=step, model=self.model, **fields)
        self._events.append(event)
        rid = event.request_id
        if rid is None:
            return event
        state = apply(self.states.get(rid), event)
        if state.is_finished:
            self.states.pop(rid, None)
            self.book.ended(rid, state)
        else:
            self.states[rid] = state
        return event
