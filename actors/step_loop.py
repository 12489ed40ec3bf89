"""The step-loop actor: the scheduler core's async shell.

    drain the inbox -> core.add / core.abort
    work = core.schedule()                              pure bookkeeping, no MLX
    result = await executor.call(runner.run, work)      MLX, on the executor thread
    outcome = core.update_from_output(work, result, ran_under)   events -> states
    append the events to the log, give each request actor its update, observe metrics

With nothing to do, it runs the step-time model's warm-up (actors/scheduler/warmup.py) in turns that
end when work arrives, if it has one to run.

Every fact about a request is the core's (actors/scheduler/core.py, which says who owns what); this
loop holds only where each live request's actor is reached and what to wake.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anyio
import structlog
from anyio.streams.memory import MemoryObjectSendStream

from stepline.actors.executor import Executor, ExecutorDeadError
from stepline.actors.host import HostMeter
from stepline.actors.mailbox import Mailbox
from stepline.actors.messages import Arrivals, Cancel, Submit, Update
from stepline.actors.metrics import EngineMetrics
from stepline.actors.scheduler.admission import AdmissionError, Refusal
from stepline.actors.scheduler.core import (
    EngineDeadError,
    LogPlace,
    ModelLimits,
    SchedulerCore,
    StepOutcome,
)
from stepline.actors.scheduler.cost_model import CostModel
from stepline.actors.scheduler.drafter import SpeculativeConfig
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.actors.scheduler.prefix_index import PrefixIndex
from stepline.actors.scheduler.warmup import Warmup
from stepline.actors.scheduler.work import Housekeeping, StepResult, StepWork
from stepline.actors.turns import Turns
from stepline.engine import heap
from stepline.events.fold import RequestState
from stepline.events.models import FinishReason, Terminal

__all__ = ["EngineDeadError", "ModelLimits", "StepLoop"]

log = structlog.get_logger(__name__)

# How long an idle engine that was just sent requests waits for more that the API is still
# parsing or tokenizing (`Arrivals`). Its first step then admits the burst's shortest
# prompts, not whichever was ready first (the others would wait for that whole step). A lone
# request, or one arriving while others run, never waits.
GATHER_S = 0.03
# A loop that never goes idle gives the C heap's free memory back this often (`_trim_heap`).
TRIM_EVERY_S = 60.0


class StepLoop:
    def __init__(
        self,
        *,
        executor: Executor,
        runner: Any,  # engine.runner.ModelRunner, living on the executor thread
        config: SchedulerConfig,
        limits: ModelLimits,
        event_log: Any = None,  # events.log.EventLogWriter (append_many, lag) or None
        metrics: EngineMetrics | None = None,
        inbox_size: int = 256,
        prefix_index: PrefixIndex | None = None,
        cost_model: CostModel | None = None,  # learns step times; None: tokens only
        arrivals: Arrivals | None = None,  # requests the API is preparing
        warmup: Warmup | None = None,  # seeds `cost_model` while this loop idles
        place: LogPlace | None = None,  # in a log several models share (actors/scheduler/core.py)
        turns: Turns | None = None,  # several models' loops share the executor thread
        speculative: SpeculativeConfig
        | None = None,  # drafted decoding (actors/scheduler/drafter.py)
        refusal_status: Mapping[Refusal, int] | None = None,  # the API's status per refusal
    ):
        self.executor = executor
        self.runner = runner
        self.metrics = metrics or EngineMetrics()
        self.arrivals = arrivals or Arrivals()
        self.core = SchedulerCore(
            config,
            limits,
            index=prefix_index,
            cost_model=cost_model,
            salt=getattr(event_log, "salt", None),
            place=place,
            speculative=speculative,
            refusal_status=refusal_status,
        )
        self._event_log = event_log
        self._turns = turns if place is not None else None
        self._in_turn = False  # this loop holds its turn (`_turn`)
        # The next decode forward (if the runner built one) computes on the executor while
        # this step commits: it starts right after the step, without waiting for this loop.
        self._ahead = self._look_ahead()
        self.inbox: MemoryObjectSendStream
        self.inbox, self._inbox = anyio.create_memory_object_stream(inbox_size)
        self._actors: dict[str, Mailbox[Update]] = {}  # live request -> its actor's inbox
        self._idle = True  # nothing has run since the loop last waited for work
        self._warmup = warmup if cost_model is not None else None
        self._trimmed_at = time.monotonic()  # when `_trim_heap` last ran ...
        self._trimmed_at_seq = 0  # ... and the core's last event then
        self._warming = False  # a turn of the warm-up is on the executor
        self._turn_over = threading.Event()  # set: the executor ends the turn at its next step
        self._host = HostMeter()  # what each step ran under (CPU share, load average)
        self.died = anyio.Event()  # set when the engine can serve no more (dead_reason says why)
        self.on_step: Callable[[StepLoop], None] | None = None  # test/inspection hook
        self._changed: anyio.Event | None = None  # set at the next change (`wait_until`)
        self.metrics.watch(
            lambda: self.core.states.values(), index=prefix_index, event_log=event_log
        )

    # -- reading: the core's state ----------------------------------------------------

    @property
    def states(self) -> dict[str, RequestState]:
        """Unfinished requests' states: the fold of every event recorded."""
        return self.core.states

    @property
    def finished(self) -> OrderedDict[str, RequestState]:
        return self.core.finished

    @property
    def step(self) -> int:
        return self.core.step

    @property
    def config(self) -> SchedulerConfig:
        return self.core.config

    @property
    def index(self) -> PrefixIndex | None:
        return self.core.index

    @property
    def cost_model(self) -> CostModel | None:
        return self.core.cost_model

    @cost_model.setter
    def cost_model(self, model: CostModel | None) -> None:
        self.core.cost_model = model

    @property
    def dead_reason(self) -> str | None:
        return self.core.dead_reason

    @property
    def event_log(self) -> Any:
        """The event log's writer (events.log.EventLogWriter), or None."""
        return self._event_log

    @property
    def settled(self) -> bool:
        """Waiting for work, every executor result applied: nothing runs, nothing is left
        to free or drop, and the prefix index has heard of every entry the store holds."""
        return self._idle and not self.core.has_work and not self._warming

    @property
    def warming_up(self) -> bool:
        """The step-time model's warm-up has steps left to measure (it runs while idle)."""
        return self._warmup is not None

    def state_of(self, request_id: str) -> RequestState | None:
        """A request's state: live, or ended recently (the log has every one)."""
        return self.core.state_of(request_id)

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

    # -- the loop ----------------------------------------------------------------------

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            await self._serve()
        finally:
            self._tick()  # a `wait_until` caller checks once more, and no longer waits on us

    async def _serve(self) -> None:
        async with self._inbox:
            while True:
                try:
                    if not self.core.has_work:
                        self._idle = True  # the next step gathers arrivals (`_gather`)
                        self._tick()
                        if self._warmup is not None:
                            await self._warm_up(self._warmup)
                            self._tick()
                        await self._trim_heap(idle=True)
                        try:
                            msg = await self._inbox.receive()  # idle: sleep until work arrives
                        except anyio.EndOfStream:
                            return
                        self._handle([msg, *self._drain()])
                    else:
                        self._handle(self._drain())
                        await self._trim_heap(idle=False)
                    await self._step()
                    self._tick()
                except Exception as exc:
                    # A bug in this loop's own code (the executor's faults are caught where it
                    # is called). Its scheduling state is in doubt, so the engine stops
                    # serving, but says what failed: no client waits on a stream that never ends.
                    log.exception("step_loop_failed")
                    self._die(f"step loop failed: {exc!r}")
                    self._tick()

    async def _step(self) -> None:
        await self._gather()
        if self._turns is None:
            await self._plan_and_run()
            return
        # One turn on the executor for the step and its housekeeping: another model's step
        # never comes between them.
        async with self._turn():
            await self._plan_and_run()

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """This model's turn on the executor while in the block (where several models share
        it; `_run_executor` then takes none of its own)."""
        if self._turns is None or self.core.model is None or self._in_turn:
            yield
            return
        async with self._turns.turn(self.core.model):
            self._in_turn = True
            try:
                yield
            finally:
                self._in_turn = False

    async def _plan_and_run(self) -> None:
        core = self.core
        # Finished requests become prefix-cache entries first: a waiting request may start
        # from one (the next turn of a chat).
        if (before := core.housekeeping(before_step=True)) is not None:
            await self._housekeep(before)
        work = core.schedule()
        self._log_events()  # the step's plan is in the log before it runs (or crashes)
        if work is None:
            if (chores := core.housekeeping()) is not None:
                await self._housekeep(chores)
            elif core.states:
                # Nothing fits now (cannot happen with the policy's admission rules, but
                # never spin): wait for the next message.
                with contextlib.suppress(anyio.EndOfStream):  # the engine is closing
                    self._handle([await self._inbox.receive()])
            return
        self._host.start()
        result = await self._run_executor(self.runner.run, work, after=self._ahead)
        if result is None:
            return
        ran_under = self._host.stop(warming_up=self.warming_up)
        # Cancels that arrived during the step win over its results; requests sent meanwhile
        # are admitted after it, for the first step they can join (they age from there).
        later = self._handle(self._drain(), admit=False)
        outcome = core.update_from_output(work, result, ran_under)
        later += self._deliver(outcome.updates)
        self._observe(work, result, outcome)
        if self.on_step is not None:
            self.on_step(self)  # sees the state as the step left it
        self._handle(later)

    def _look_ahead(self) -> Callable[[], None] | None:
        """What the executor runs after a step (`Executor.call`'s `after`): the runner's
        look-ahead (a distributed runner has none). Where several models share the executor,
        none while another model waits for its turn when the step ends (read on the executor
        thread): its step goes first, and this model's next step computes its own forward (on
        the CPU backend the look-ahead's forward runs before the turn passes)."""
        ahead = getattr(self.runner, "look_ahead", None)
        turns, name = self._turns, self.core.model
        if ahead is None or turns is None or name is None:
            return ahead

        def ahead_unless_waited_for() -> None:
            if not turns.others_waiting(name):
                ahead()

        return ahead_unless_waited_for

    async def _gather(self) -> None:
        """Before the first step after idling, wait (at most GATHER_S) for the requests still
        being prepared: nobody runs yet, so nobody's tokens are delayed."""
        idle, self._idle = self._idle, False
        if not idle or not self.arrivals.preparing:
            return
        with anyio.move_on_after(GATHER_S), contextlib.suppress(anyio.EndOfStream):
            while self.arrivals.preparing:
                self._handle([await self._inbox.receive()])
        self._handle(self._drain())  # those sent while this loop handled others

    async def _warm_up(self, warmup: Warmup) -> None:
        """A turn of the warm-up, until it is done or something arrives for this loop (a
        message, a request being prepared, the inbox closing): the executor checks between
        two of its steps. Its samples seed the cost model it was made for; all of them are
        kept for the next start."""
        model = self.core.cost_model
        inbox, arrivals = self._inbox, self.arrivals
        over = self._turn_over = threading.Event()

        turns, name = self._turns, self.core.model

        def stop() -> bool:  # on the executor thread: reads counters only
            stats = inbox.statistics()
            return (
                over.is_set()
                or (turns is not None and name is not None and turns.others_waiting(name))
                or stats.current_buffer_used > 0
                or stats.open_send_streams == 0
                or arrivals.preparing > 0
            )

        self._warming = True
        try:
            samples = await self._run_executor(warmup.run, stop)
        finally:
            over.set()  # cancelled: the executor's turn ends at its next step
            self._warming = False
        if samples is None:  # the executor died (the loop is dead now)
            self._warmup = None
            return
        for report in warmup.take_prefix_reports():  # a disk write that ended meanwhile
            self.core.apply_prefix_report(report)
        if model is None or model is not self.core.cost_model:  # replaced: not its seed
            self._warmup = None
            return
        for sample in samples:
            model.seed(sample.features, sample.seconds)
        if warmup.done:
            self._warmup = None
            await anyio.to_thread.run_sync(warmup.keep)
            log.info("warmup_measured", samples=len(warmup.samples), turns=warmup.num_turns)

    def end_warm_up(self) -> None:
        """No more warm-up (the engine is shutting down): a turn on the executor ends at its
        next step, and none starts again."""
        self._warmup = None
        self._turn_over.set()

    async def _trim_heap(self, *, idle: bool) -> None:
        """Give the C heap's free memory back to the system (engine/heap.py), on the
        executor's thread: once when the loop goes idle after work, and every
        TRIM_EVERY_S while it never does. Without it RSS stays at a burst's high-water mark."""
        now = time.monotonic()
        worked = self.core.seq != self._trimmed_at_seq
        if not worked or not (idle or now - self._trimmed_at >= TRIM_EVERY_S):
            return
        self._trimmed_at, self._trimmed_at_seq = now, self.core.seq
        if await self._run_executor(heap.trim):
            self.metrics.heap_trims.inc()
            self._tick()

    async def _housekeep(self, chores: Housekeeping) -> None:
        result = await self._run_executor(self.runner.housekeep, chores)
        if result is not None:
            self.core.apply_prefix_report(result.prefix)
            self.metrics.executor_report(result.memory, result.prefix)

    async def _run_executor(
        self, fn: Callable, *args: Any, after: Callable[[], None] | None = None
    ) -> Any:
        """`fn(*args)` on the executor (in this model's turn, where several models share it);
        None once the executor failed (this loop is then dead)."""
        try:
            if self._turns is None or self._in_turn:
                return await self.executor.call(fn, *args, after=after)
            async with self._turn():
                return await self.executor.call(fn, *args, after=after)
        except ExecutorDeadError as exc:
            self._die(f"executor failed: {exc!r}")
        except Exception as exc:
            self.executor.mark_dead(exc)
            self._die(f"executor failed: {exc!r}")
        return None

    # -- messages in, updates out ------------------------------------------------------

    def _drain(self) -> list[Submit | Cancel]:
        """The messages waiting in the inbox; none once the engine closed it (it closes it
        while it shuts down, which may land between two steps of this loop)."""
        msgs = []
        while True:
            try:
                msgs.append(self._inbox.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return msgs

    def _handle(self, msgs: list[Submit | Cancel], *, admit: bool = True) -> list[Submit]:
        """Cancel and admit, in order; with `admit` false the submissions are returned
        instead (to admit after the step that ran meanwhile)."""
        held = []
        for msg in msgs:
            if isinstance(msg, Cancel):
                message = (
                    "cancelled by the client" if msg.reason is FinishReason.CANCELLED else None
                )
                self._end(msg.request_id, msg.reason, message)
            elif admit:
                self._admit(msg)
            else:
                held.append(msg)
        self._log_events()
        return held

    def _admit(self, msg: Submit) -> None:
        if msg.reply.done():  # the submitter was cancelled before we got here
            return
        try:
            self.core.add(
                msg.request_id,
                msg.prompt_token_ids,
                msg.params,
                msg.checkpoints,
                msg.client,
                images=msg.images,
            )
        except AdmissionError as exc:
            msg.reply.set_exception(exc)
            return
        except BaseException:
            # A bug in admitting it: the loop's handler says what failed; the submitter
            # must not wait for a reply that never comes.
            msg.reply.set_exception(EngineDeadError("the engine failed admitting this request"))
            raise
        self._actors[msg.request_id] = msg.actor
        self.metrics.admitted()
        msg.reply.set_result(None)

    def _end(self, request_id: str, reason: FinishReason, message: str | None) -> None:
        """End a live request outside a step's results (a cancel, its actor's own stop, a
        fault) and tell its actor, unless the actor ended it itself."""
        update = self.core.abort(request_id, reason, message)
        actor = self._actors.pop(request_id, None)
        if update is not None and actor is not None and reason is not FinishReason.STOP:
            actor.put(update)

    def _deliver(self, updates: Mapping[str, Update]) -> list[Submit]:
        """Give each request actor its update: one message per request per step. Returns
        the submissions it met in the inbox (it reads it when an actor is gone), to admit
        after those that came before them."""
        gone: list[str] = []
        held: list[Submit] = []
        for rid, update in updates.items():
            actor = self._actors.get(rid)
            if actor is None:
                continue
            if update.finish is not None:
                del self._actors[rid]
            if not actor.put(update):
                gone.append(rid)
        if gone:
            # An actor that is gone ended its request itself (a stop string: its message
            # is in the inbox) or failed without a word.
            held = self._handle(self._drain(), admit=False)
            for rid in gone:
                self._end(rid, FinishReason.ERROR, "the request's actor failed")
        self._log_events()
        return held

    def log_model_event(self, cls: type, **fields: Any) -> Any:
        """Record and log an event of the model's own (`ModelLoaded`, `ModelUnloaded`: a
        server of several models). Returns the event."""
        event = self.core.record_model_event(cls, **fields)
        self._log_events()
        return event

    def log_refusal(
        self, request_id: str, message: str, *, code: str, status: int
    ) -> Terminal | None:
        """Record and log a request a door refused before it reached this engine (`SchedulerCore.
        refuse`: a lone terminal). Nothing without an event log, or for an id the core has
        seen (its own events say how it ended). Not counted among the finished requests'
        metrics: the engine never had it. Returns the event, if recorded."""
        if self._event_log is None:
            return None
        event = self.core.refuse(request_id, message, code=code, status=status)
        if event is not None:
            # The loop logs its own events before each await: the core holds only this one.
            self._event_log.append_many(self.core.take_events())
        return event

    def _log_events(self) -> None:
        events = self.core.take_events()
        if not events:
            return
        if self._event_log is not None:
            self._event_log.append_many(events)
        for event in events:
            if type(event) is Terminal:
                self.metrics.finished(event.reason)

    # -- metrics and the end -------------------------------------------------------------

    def _observe(self, work: StepWork, result: StepResult, outcome: StepOutcome) -> None:
        m = self.metrics
        m.tokens(outcome.gaps, outcome.firsts)
        for num_cached in outcome.cache_lookups:
            m.prefix_lookup(num_cached)
        m.step(work.plan.num_tokens, self.config.max_step_tokens, result.seconds)
        m.executor_report(result.memory, result.prefix)

    def _die(self, reason: str) -> None:
        """The engine cannot go on (`reason` says what failed: the executor or this loop):
        end every in-flight request with an error; admit no more."""
        self.died.set()
        log.error("engine_dead", reason=reason)
        self.metrics.healthy.set(0)
        self._handle(self._deliver(self.core.fail(reason)))  # refused: the engine is dead

    async def shutdown(self) -> None:
        """End every request still in flight (engine closing)."""
        for msg in self._drain():
            if isinstance(msg, Submit) and not msg.reply.done():
                msg.reply.set_exception(RuntimeError("the engine is closed"))
        for rid in list(self.states):
            self._end(rid, FinishReason.CANCELLED, "the engine is shutting down")
        self._log_events()
