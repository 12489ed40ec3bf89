"""The step-loop actor: the engine's central loop.

    prefix = plan_prefixes(...)                     where waiting requests start
    plan = schedule(states, config, step, prefix)   pure
    result = await executor.call(runner.run, work)  MLX, on the executor thread
    deliveries = commit(recorder, plan, result)     events -> states; then tell the actors

Its scheduling state (`states`) changes only by applying the events it records, with
the same `apply` replay uses, so folding its log rebuilds exactly this state. It owns
the prefix index: which cached prefix a request starts from is decided here, when its
first chunk is scheduled; the executor only stores the arrays.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import structlog
from anyio.streams.memory import MemoryObjectSendStream

from stepline.actors.commit import Delivery, ModelLimits, Recorder, commit, record_plan
from stepline.actors.executor import Executor, ExecutorDeadError
from stepline.actors.messages import Arrivals, Cancel, Finish, Submit
from stepline.actors.metrics import EngineMetrics
from stepline.engine.cost_model import CostModel
from stepline.engine.policy import (
    AdmissionError,
    SchedulerConfig,
    StepPlan,
    check_admissible,
    check_queue,
    prefix_candidates,
    schedule,
)
from stepline.engine.prefix_index import (
    PrefixIndex,
    PrefixPlan,
    Tokens,
    plan_prefixes,
)
from stepline.engine.work import Housekeeping, NewRequest, StepResult, StepWork
from stepline.events.fold import RequestState, Status
from stepline.events.models import (
    Admitted,
    FinishReason,
    StepFinished,
    Terminal,
    prompt_digest,
)

__all__ = ["EngineDeadError", "ModelLimits", "StepLoop"]

log = structlog.get_logger(__name__)

_REUSABLE = (FinishReason.STOP, FinishReason.LENGTH)  # ended cleanly: cache worth keeping
_KEEP_IDS = 100_000  # request ids refused as reused within this many requests
# How long an idle engine that was just sent requests waits for more that the API is still
# parsing or tokenizing (`Arrivals`). Its first step then admits the burst's shortest
# prompts, not whichever was ready first (the others would wait for that whole step). A lone
# request, or one arriving while others run, never waits.
GATHER_S = 0.03


class EngineDeadError(AdmissionError):
    """The engine can serve no request: its executor failed."""


class StepLoop:
    def __init__(
        self,
        *,
        executor: Executor,
        runner: Any,  # engine.runner.ModelRunner, living on the executor thread
        config: SchedulerConfig,
        limits: ModelLimits,
        event_log: Any = None,  # events.log.EventLogWriter (append, lag) or None
        metrics: EngineMetrics | None = None,
        log_prompts: bool = True,
        inbox_size: int = 256,
        prefix_index: PrefixIndex | None = None,
        cost_model: CostModel | None = None,  # learns step times; None: tokens only
        arrivals: Arrivals | None = None,  # requests the API is preparing
    ):
        self.executor = executor
        self.runner = runner
        self.config = config
        self.limits = limits
        self.metrics = metrics or EngineMetrics()
        self.cost_model = cost_model
        self.arrivals = arrivals or Arrivals()
        self._event_log = event_log
        self._log_prompts = log_prompts
        self.inbox: MemoryObjectSendStream
        self.inbox, self._inbox = anyio.create_memory_object_stream(inbox_size)
        self.recorder = Recorder(event_log)
        self.recorder.on_terminal = self._ended
        self.index = prefix_index  # None: no prefix cache
        # Live requests' submissions: prompt, logprobs, actor inbox. One entry per
        # request in `states`; everything else about a request is in its state.
        self._requests: dict[str, Submit] = {}
        self._closing: dict[str, MemoryObjectSendStream] = {}  # ended: last message pending
        self._recent_ids: OrderedDict[str, None] = OrderedDict()  # to refuse reused ids
        # ended since the executor last heard -> whether its cache is worth keeping
        self._to_free: dict[str, bool] = {}
        self._drops: list[Tokens] = []  # prefix entries the index let go, for the store
        self._disk_tries: set[str] = set()  # requests a disk entry was loaded for
        # Submits that arrived while a step ran: admitted once it ended, so that a request
        # is logged as admitted for the first step it can join (it ages from there).
        self._held: list[Submit] = []
        self._idle = True  # nothing has run since the loop last waited for work
        self.dead_reason: str | None = None
        self.died = anyio.Event()  # set when the engine can serve no more (dead_reason says why)
        self.on_step: Callable[[StepLoop], None] | None = None  # test/inspection hook
        self._changed: anyio.Event | None = None  # set at the next change (`wait_until`)

    # -- state ---------------------------------------------------------------

    @property
    def states(self) -> dict[str, RequestState]:
        """Unfinished requests' states: the fold of every event recorded."""
        return self.recorder.states

    @property
    def finished(self) -> OrderedDict[str, RequestState]:
        return self.recorder.finished

    @property
    def event_log(self) -> Any:
        """The event log's writer (events.log.EventLogWriter), or None."""
        return self._event_log

    @property
    def step(self) -> int:
        return self.recorder.step

    @property
    def settled(self) -> bool:
        """Waiting for work, every executor result applied: nothing runs, nothing is left
        to free or drop, and the prefix index has heard of every entry the store holds."""
        return self._idle and not self._has_work()

    def _has_work(self) -> bool:
        return bool(self.states or self._to_free or self._drops)

    def state_of(self, request_id: str) -> RequestState | None:
        """A request's state: live, or ended recently (the log has every one)."""
        return self.states.get(request_id) or self.finished.get(request_id)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds, checking it again after each turn of this loop
        (a message handled, a step or a housekeeping call ended, the loop gone idle). For
        inspection and tests: bound it with `anyio.fail_after`."""
        while not predicate():
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    def _tick(self) -> None:
        """Wake the `wait_until` callers: this loop's state may have changed."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _record(self, cls: type, **fields: Any) -> Any:
        return self.recorder.record(cls, **fields)

    def _ended(self, rid: str, reason: FinishReason) -> None:
        """Every terminal event comes through here: free the request's slot."""
        submit = self._requests.pop(rid, None)
        if submit is not None:
            self._closing[rid] = submit.actor  # closed once its last message is sent
            self._to_free[rid] = reason in _REUSABLE
        self._disk_tries.discard(rid)
        self.metrics.finished(reason)

    # -- inbox ----------------------------------------------------------------

    async def _handle(self, msg: Submit | Cancel) -> None:
        if not isinstance(msg, Submit):
            await self._cancel(msg)
        elif self.recorder.in_step:
            self._held.append(msg)  # a cancel for it cannot come before its admission
        else:
            self._submit(msg)

    def _submit(self, msg: Submit) -> None:
        try:
            self._admit(msg)
        except BaseException:
            # A bug in admitting it: the loop's handler says what failed; the submitter
            # must not wait for a reply that never comes.
            if not msg.reply.done():
                msg.reply.set_exception(EngineDeadError("the engine failed admitting this request"))
            raise

    def _admit(self, msg: Submit) -> None:
        if msg.reply.done():  # the submitter was cancelled before we got here
            return
        if msg.request_id in self._recent_ids:
            msg.reply.set_exception(
                AdmissionError(f"request id {msg.request_id!r} was already used: send a new one")
            )
            return
        self._recent_ids[msg.request_id] = None
        while len(self._recent_ids) > _KEEP_IDS:
            self._recent_ids.popitem(last=False)
        try:
            if self.dead_reason is not None:
                raise EngineDeadError(f"the engine is unhealthy: {self.dead_reason}")
            check_queue(self.states, self.config)
            check_admissible(
                len(msg.prompt_token_ids),
                msg.params.max_tokens,
                self.limits.max_context,
                self.config,
            )
        except AdmissionError as exc:
            self._reject(msg, exc)
            return
        self._admit_event(msg)
        self._requests[msg.request_id] = msg
        self.metrics.admitted()
        msg.reply.set_result(None)

    def _reject(self, msg: Submit, exc: AdmissionError) -> None:
        """Log the request as admitted and at once rejected (so the log shows what was
        refused, and why), and raise `exc` in the submitter."""
        self._admit_event(msg)
        self._record(
            Terminal, request_id=msg.request_id, reason=FinishReason.REJECTED, message=str(exc)
        )
        msg.reply.set_exception(exc)

    def _admit_event(self, msg: Submit) -> None:
        ids = msg.prompt_token_ids
        digest = prompt_digest(getattr(self._event_log, "salt", None), ids)
        self._record(
            Admitted,
            request_id=msg.request_id,
            num_prompt_tokens=len(ids),
            prompt_token_ids=ids if self._log_prompts else None,
            prompt_sha256=digest,
            checkpoints=tuple(sorted({c for c in msg.checkpoints if 0 < c <= len(ids)})),
            params=msg.params,
        )

    async def _cancel(self, msg: Cancel) -> None:
        if msg.request_id not in self.states:
            return  # ended already, or never admitted
        message = "cancelled by the client" if msg.reason is FinishReason.CANCELLED else None
        await self._end(msg.request_id, msg.reason, message)

    async def _end(self, request_id: str, reason: FinishReason, message: str | None) -> None:
        """End a request the step did not end: record its terminal event, tell its actor."""
        actor = self._requests[request_id].actor if request_id in self._requests else None
        if actor is not None and reason is not FinishReason.STOP:
            with anyio.CancelScope(shield=True):
                await self._tell(actor, Finish(reason, message))
        self._record(Terminal, request_id=request_id, reason=reason, message=message)
        self._close_ended()

    def _close_ended(self) -> None:
        for actor in self._closing.values():
            actor.close()
        self._closing.clear()

    async def _tell(self, actor: MemoryObjectSendStream, msg: Any) -> bool:
        """Send `msg`; False if the actor is gone (it failed, or the engine is closing).
        Without waiting while its mailbox has room: a step's deliveries then cost one turn
        of the event loop, not one per request (anyio's `send` yields on every call)."""
        try:
            try:
                actor.send_nowait(msg)
            except anyio.WouldBlock:
                await actor.send(msg)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        return True

    async def _handle_pending(self) -> None:
        for msg in self._drain():
            await self._handle(msg)

    def _drain(self) -> list[Submit | Cancel]:
        """The messages waiting in the inbox; none once the engine closed it (it closes it
        while it shuts down, which may land between two steps of this loop)."""
        msgs = []
        while True:
            try:
                msgs.append(self._inbox.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):
                return msgs

    # -- the loop ------------------------------------------------------------

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox:
            while True:
                try:
                    while self._held:  # one at a time: a failure leaves the rest held
                        self._submit(self._held.pop(0))
                    if not self._has_work():
                        self._idle = True  # the next step gathers arrivals (`_gather`)
                        self._gauges()  # what /metrics shows while idle: nothing running
                        self._tick()
                        try:
                            msg = await self._inbox.receive()  # idle: sleep until work arrives
                        except anyio.EndOfStream:
                            return
                        await self._handle(msg)
                    await self._handle_pending()
                    await self._step()
                    self._tick()
                except Exception as exc:
                    # A bug in this loop's own code (the executor's faults are caught where it
                    # is called). Its scheduling state is in doubt, so the engine stops
                    # serving, but says what failed: no client waits on a stream that never ends.
                    log.exception("step_loop_failed")
                    self.recorder.in_step = False
                    await self._die(f"step loop failed: {exc!r}")
                    self._tick()

    async def _step(self) -> None:
        await self._gather()
        if self._waiting() and any(self._to_free.values()):
            # Finished requests become prefix-cache entries first: a waiting request may
            # start from one (the next turn of a chat).
            await self._housekeep()
        prefix = self._plan_prefixes()
        cost = None
        if self.cost_model is not None:
            # A refit (~3 ms of numpy on this loop) only when a chunk is to be sized; a
            # decode-only step's prediction, for the log, comes from the last fit.
            chunked = any(s.status is not Status.DECODING for s in self.states.values())
            cost = self.cost_model.cost if chunked else self.cost_model.last
        plan = schedule(self.states, self.config, self.step + 1, cost, prefix)
        if plan.is_empty:
            if self._to_free or self._drops or prefix.promote:
                await self._housekeep(prefix.promote)
            elif self.states:
                # Nothing fits now (cannot happen with the policy's admission rules,
                # but never spin): wait for the next message.
                with contextlib.suppress(anyio.EndOfStream):  # the engine is closing
                    await self._handle(await self._inbox.receive())
            return
        self.recorder.step += 1
        self.recorder.in_step = True
        try:
            await self._run_step(plan, prefix)
        finally:
            self.recorder.in_step = False
        if self.on_step is not None:
            self.on_step(self)

    async def _gather(self) -> None:
        """Before the first step after idling, wait (at most GATHER_S) for the requests still
        being prepared: nobody runs yet, so nobody's tokens are delayed."""
        idle, self._idle = self._idle, False
        if not idle or not self.arrivals.preparing:
            return
        with anyio.move_on_after(GATHER_S), contextlib.suppress(anyio.EndOfStream):
            while self.arrivals.preparing:
                await self._handle(await self._inbox.receive())
        await self._handle_pending()  # those sent while this loop handled others

    def _waiting(self) -> bool:
        return any(s.status is Status.WAITING for s in self.states.values())

    def _plan_prefixes(self) -> PrefixPlan:
        if self.index is None or not self._waiting():
            return PrefixPlan()
        candidates = prefix_candidates(
            self.states,
            lambda rid: self._requests[rid].prompt_token_ids,
            self.step + 1,
            self.config,
            self._disk_tries,
        )
        prefix = plan_prefixes(candidates, self.index)
        self._disk_tries.update(prefix.loading)
        return prefix

    async def _run_step(self, plan: StepPlan, prefix: PrefixPlan) -> None:
        record_plan(self.recorder, plan, self.config)
        admit = tuple(
            self._new_request(c.request_id, prefix)
            for c in plan.chunks
            if self.states[c.request_id].status is Status.WAITING
        )
        work = StepWork(plan=plan, admit=admit, **self._housekeeping(prefix.promote).__dict__)
        # The next decode forward (if the runner built one) computes on the executor while
        # this step commits: it starts right after the step, without waiting for this loop.
        ahead = getattr(self.runner, "look_ahead", None)  # a distributed runner has none
        result = await self._run_executor(self.runner.run, work, after=ahead)
        if result is None:
            return
        self._record(StepFinished, seconds=result.seconds, predicted_seconds=plan.predicted_seconds)
        if self.cost_model is not None:
            self.cost_model.observe(plan.features, result.seconds)
        await self._handle_pending()  # cancels that arrived during the step win over its results
        # A request that waited while its entry was loaded from disk was served from disk.
        sources = {
            rid: "disk" if rid in self._disk_tries else m.source
            for rid, m in prefix.matches.items()
        }
        await self._end_failed(result.failed)
        before = {rid: self.states[rid] for rid in result.tokens if rid in self.states}
        deliveries = commit(self.recorder, plan, result, self.limits, sources)
        self._update_index(result)
        await self._deliver(deliveries)
        self.metrics.tokens(before, self.state_of)
        for new in admit:
            self.metrics.prefix_lookup(new.num_cached_tokens)
        self.metrics.step(plan.num_tokens, self.config.max_step_tokens, result.seconds)
        self.metrics.memory(result.memory)
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.gauges(self.states.values())
        self.metrics.event_log(self._event_log)

    async def _end_failed(self, failed: Mapping[str, str]) -> None:
        """End the requests the executor could not serve (it already dropped their state);
        the step's results for the others stand."""
        for rid, what in failed.items():
            if rid in self.states:  # else: cancelled while the step ran
                log.error("request_ended_by_fault", request_id=rid, what=what)
                await self._end(rid, FinishReason.ERROR, what)
            # Its free still goes out: a no-op here, but other ranks of a distributed
            # engine still hold the request.

    def _new_request(self, rid: str, prefix: PrefixPlan) -> NewRequest:
        submit = self._requests[rid]
        match = prefix.matches.get(rid)
        if match is not None and self.index is not None:
            self.index.touch(match.tokens)
        return NewRequest(
            request_id=rid,
            prompt_token_ids=submit.prompt_token_ids,
            params=submit.params,
            logprobs=submit.logprobs,
            prefix=match.tokens if match is not None else None,
            num_cached_tokens=match.num_tokens if match is not None else 0,
        )

    def _housekeeping(self, promote: tuple[Tokens, ...] = ()) -> Housekeeping:
        """What the executor must do before the next step: frees, retirements, entry
        drops and loads. Taken once: the executor will have done it."""
        frees, self._to_free = self._to_free, {}
        drops, self._drops = self._drops, []
        return Housekeeping(
            free=tuple(frees),
            retire=frozenset(r for r, reusable in frees.items() if reusable),
            drop_entries=tuple(drops),
            promote=promote,
        )

    async def _housekeep(self, promote: tuple[Tokens, ...] = ()) -> None:
        result = await self._run_executor(self.runner.housekeep, self._housekeeping(promote))
        if result is not None:
            self._update_index(result)

    def _update_index(self, result: StepResult) -> None:
        report = result.prefix
        if report is None or self.index is None:
            return
        self._drops.extend(self.index.apply(report.new, report.disk_added, report.disk_removed))
        self.metrics.prefix_cache(self.index, report)

    async def _deliver(self, deliveries: list[Delivery]) -> None:
        for rid, msg in deliveries:
            submit = self._requests.get(rid)
            actor = submit.actor if submit is not None else self._closing.get(rid)
            if actor is None:
                continue
            if not await self._tell(actor, msg):
                # The actor is gone: it ended the request itself (a stop string, or it
                # failed) and its message is on the way, or it failed silently.
                await self._handle_pending()
                if rid in self.states:
                    await self._end(rid, FinishReason.ERROR, "the request's actor failed")
        self._close_ended()

    async def _run_executor(
        self, fn: Callable, *args: Any, after: Callable[[], None] | None = None
    ) -> Any:
        try:
            return await self.executor.call(fn, *args, after=after)
        except ExecutorDeadError as exc:
            await self._die(f"executor failed: {exc!r}")
        except Exception as exc:
            self.executor.mark_dead(exc)
            await self._die(f"executor failed: {exc!r}")
        return None

    async def _die(self, reason: str) -> None:
        """The engine cannot go on (`reason` says what failed: the executor or this loop):
        end every in-flight request with an error; admit no more."""
        self.dead_reason = reason
        self.died.set()
        log.error("engine_dead", reason=self.dead_reason)
        self.metrics.healthy.set(0)
        for rid in list(self.states):
            await self._end(rid, FinishReason.ERROR, self.dead_reason)
        self._to_free.clear()

    async def shutdown(self) -> None:
        """End every request still in flight (engine closing)."""
        held, self._held = self._held, []
        for submit in held:
            if not submit.reply.done():
                submit.reply.set_exception(RuntimeError("the engine is closed"))
        for rid in list(self.states):
            await self._end(rid, FinishReason.CANCELLED, "the engine is shutting down")
