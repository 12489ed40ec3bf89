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
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import anyio
import structlog
from anyio.streams.memory import MemoryObjectSendStream

from stepline.actors.executor import Executor, ExecutorDeadError
from stepline.actors.host import HostMeter
from stepline.actors.idle import IdleWork
from stepline.actors.mailbox import Mailbox
from stepline.actors.messages import (
    SHUTDOWN_MESSAGE,
    Arrived,
    Arriving,
    Cancel,
    EndWarmUp,
    Refuse,
    Submit,
    Update,
)
from stepline.actors.metrics import EngineMetrics
from stepline.actors.request import RequestActor
from stepline.actors.scheduler.admission import AdmissionError, Refusal
from stepline.actors.scheduler.background import PREEMPTED, STALE
from stepline.actors.scheduler.core import (
    EngineDeadError,
    LogPlace,
    ModelLimits,
    SchedulerCore,
)
from stepline.actors.scheduler.cost_model import CostModel
from stepline.actors.scheduler.drafter import SpeculativeConfig
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.actors.scheduler.prefix_index import PrefixIndex
from stepline.actors.scheduler.warmup import Warmup
from stepline.actors.scheduler.work import Housekeeping
from stepline.actors.turns import Seat, Turns
from stepline.events.feed import EventFeed
from stepline.events.fold import RequestState, Status
from stepline.events.models import Event, FinishReason, Terminal

__all__ = ["EngineDeadError", "LoopSnapshot", "ModelLimits", "StepLoop"]

log = structlog.get_logger(__name__)

# How long an idle engine that was just sent requests waits for more that the API is still
# parsing or tokenizing (`Arriving`). Its first step then admits the burst's shortest
# prompts, not whichever was ready first (the others would wait for that whole step). A lone
# request, or one arriving while others run, never waits.
GATHER_S = 0.03

Message: TypeAlias = Submit | Cancel | Arriving | Arrived | EndWarmUp
# Messages that change no request: an idle loop that gets only these does not step.
_NO_STEP = (Arriving, Arrived, EndWarmUp)


@dataclass(frozen=True)
class LoopSnapshot:
    """What the step loop published after its last turn, for the API and the worker
    endpoints to read (they never read the loop's own state): its live requests' states
    (frozen values), the requests on their way, its health and its warm-up."""

    states: tuple[RequestState, ...] = ()  # live requests, oldest first
    num_preparing: int = 0  # requests the API is preparing (`Arriving`)
    dead_reason: str | None = None  # why the engine can serve no more; None: healthy
    warming_up: bool = False  # the step-time model's warm-up has steps left

    @property
    def live_ids(self) -> tuple[str, ...]:
        return tuple(s.request_id for s in self.states)

    @property
    def num_live(self) -> int:
        return len(self.states)

    @property
    def num_waiting(self) -> int:
        """Live requests whose first chunk has not run."""
        return sum(s.status is Status.WAITING for s in self.states)

    @property
    def num_tokens(self) -> int:
        """The live requests' prompt and output tokens: what they hold or will hold in KV."""
        return sum(s.num_prompt_tokens + s.num_output_tokens for s in self.states)


class Recipients:
    """Where each live request's actor is reached: its inbox, or the actor itself, which
    the step loop then drives (`Submit.actor`)."""

    def __init__(self) -> None:
        self.actors: dict[str, Mailbox[Update] | RequestActor] = {}  # live request -> its actor

    def deliver(
        self, updates: Mapping[str, Update]
    ) -> tuple[list[str], list[tuple[str, FinishReason]]]:
        """Give each actor its update. Returns the requests whose actor is gone, and those
        an actor driven here ended itself, and how (a stop string it found in this update);
        neither has an actor here any more."""
        gone: list[str] = []
        ended: list[tuple[str, FinishReason]] = []
        for rid, update in updates.items():
            actor = self.actors.get(rid)
            if actor is None:
                continue
            if update.finish is not None:
                del self.actors[rid]
            if isinstance(actor, RequestActor):
                if (own := actor.take(update)) is not None:
                    self.actors.pop(rid, None)
                    ended.append((rid, own))
            elif not actor.put(update):
                gone.append(rid)
        return gone, ended


class StepLoop:
    def __init__(
        self,
        *,
        executor: Executor,
        runner: Any,  # engine.runner.ModelRunner, living on the executor thread
        config: SchedulerConfig,
        limits: ModelLimits,
        event_log: Any = None,  # events.log.EventLogWriter (append_many, lag) or None
        feed: EventFeed | None = None,  # live readers' events (GET /v1/events), or None
        metrics: EngineMetrics | None = None,
        inbox_size: int = 256,
        prefix_index: PrefixIndex | None = None,
        cost_model: CostModel | None = None,  # learns step times; None: tokens only
        warmup: Warmup | None = None,  # seeds `cost_model` while this loop idles
        place: LogPlace | None = None,  # in a log several models share (actors/scheduler/core.py)
        turns: Turns | None = None,  # several models' loops share the executor thread
        speculative: SpeculativeConfig
        | None = None,  # drafted decoding (actors/scheduler/drafter.py)
        refusal_status: Mapping[Refusal, int] | None = None,  # the API's status per refusal
    ):
        self.executor = executor
        self.runner = runner
        self.limits = limits  # the model's: fixed for the loop's life
        self.metrics = metrics or EngineMetrics()
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
        self.feed = feed
        self._seat = Seat(executor, turns if place is not None else None, self.core.model)
        # The next decode forward (if the runner built one; a distributed runner has none)
        # computes on the executor while this step commits: it starts right after the step.
        self._ahead = self._seat.look_ahead(getattr(runner, "look_ahead", None))
        self.inbox: MemoryObjectSendStream
        self.inbox, self._inbox = anyio.create_memory_object_stream(inbox_size)
        self._recipients = Recipients()  # where each live request's actor is reached
        # Requests on their way: `Arriving` less `Arrived` (below 0 for a moment where a full
        # inbox reordered the two)
        self._num_preparing = 0
        self._idle = True  # nothing has run since the loop last waited for work
        self._idle_work = IdleWork(warmup if cost_model is not None else None)
        self._host = HostMeter()  # what each step ran under (CPU share, load average)
        self.died = anyio.Event()  # set when the engine can serve no more (dead_reason says why)
        self.snapshot = LoopSnapshot(warming_up=self.warming_up)  # see `_publish`
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
        return self._idle and not self.core.has_work and not self._idle_work.warming

    @property
    def warming_up(self) -> bool:
        """The step-time model's warm-up has steps left to measure (it runs while idle)."""
        return self._idle_work.warmup is not None

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
        self._publish()
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _publish(self) -> None:
        """Publish what the API reads (`snapshot`), as this loop's turn left it."""
        self.snapshot = LoopSnapshot(
            tuple(self.core.states.values()),
            self._num_preparing,
            self.core.dead_reason,
            self.warming_up,
        )

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
                        if self.warming_up and self._num_preparing <= 0:
                            await self._warm_up()
                            self._tick()
                        await self._trim_heap(idle=True)
                        try:
                            msg = await self._inbox.receive()  # idle: sleep until work arrives
                        except anyio.EndOfStream:
                            return
                        msgs = [msg, *self._drain()]
                        self._handle(msgs)
                        if all(isinstance(m, _NO_STEP) for m in msgs):
                            continue  # no request yet: the first step waits for one (`_gather`)
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
        async with self._seat.turn():  # the step and its housekeeping: one turn
            await self._plan_and_run()

    async def _plan_and_run(self) -> None:
        core = self.core
        # Finished requests become prefix-cache entries first: a waiting request may start
        # from one (the next turn of a chat).
        if (before := core.housekeeping(before_step=True)) is not None:
            await self._housekeep(before)
        for rid in core.stale():  # a next turn's prefill its client's next request outran
            self._end(rid, FinishReason.CANCELLED, STALE)
        for rid in core.preemptions():  # a next turn's prefill in a client's way
            self._end(rid, FinishReason.CANCELLED, PREEMPTED)
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
        self.metrics.observe_step(work, result, outcome, self.config.max_step_tokens)
        if self.on_step is not None:
            self.on_step(self)  # sees the state as the step left it
        self._handle(later)

    async def _gather(self) -> None:
        """Before the first step after idling, wait (at most GATHER_S) for the requests still
        being prepared: nobody runs yet, so nobody's tokens are delayed."""
        idle, self._idle = self._idle, False
        if not idle or self._num_preparing <= 0:
            return
        with anyio.move_on_after(GATHER_S), contextlib.suppress(anyio.EndOfStream):
            while self._num_preparing > 0:
                self._handle([await self._inbox.receive()])
        self._handle(self._drain())  # those sent while this loop handled others

    async def _warm_up(self) -> None:
        """A turn of the warm-up (`IdleWork.warm_up`), until something arrives for this loop
        (a message, the inbox closing: a request being prepared has sent its `Arriving`) or
        another model waits for its turn."""
        inbox, seat = self._inbox, self._seat

        def wanted() -> bool:  # on the executor thread: reads counters only
            stats = inbox.statistics()
            return (
                seat.others_waiting()
                or stats.current_buffer_used > 0
                or stats.open_send_streams == 0
            )

        await self._idle_work.warm_up(self.core, self._run_executor, wanted)

    async def _trim_heap(self, *, idle: bool) -> None:
        if await self._idle_work.trim_heap(self.core.seq, self._run_executor, idle=idle):
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
            return await self._seat.call(fn, *args, after=after)
        except ExecutorDeadError as exc:
            self._die(f"executor failed: {exc!r}")
        except Exception as exc:
            self.executor.mark_dead(exc)
            self._die(f"executor failed: {exc!r}")
        return None

    # -- messages in, updates out ------------------------------------------------------

    def _drain(self) -> list[Message]:
        """The messages waiting in the inbox; none once the engine closed it (it closes it
        while it shuts down, which may land between two steps of this loop)."""
        msgs = []
        while True:
            try:
                msgs.append(self._inbox.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return msgs

    def _handle(self, msgs: list[Message], *, admit: bool = True) -> list[Submit]:
        """Cancel and admit, in order; with `admit` false the submissions are returned
        instead (to admit after the step that ran meanwhile). Arrivals and the warm-up's end
        are taken at once."""
        held = []
        for msg in msgs:
            if isinstance(msg, Submit):
                if admit:
                    self._admit(msg)
                else:
                    held.append(msg)
            elif isinstance(msg, Cancel):
                message = msg.message or (
                    "cancelled by the client" if msg.reason is FinishReason.CANCELLED else None
                )
                self._end(msg.request_id, msg.reason, message)
            elif isinstance(msg, Arriving | Arrived):
                self._num_preparing += 1 if isinstance(msg, Arriving) else -1
            else:
                self._idle_work.end_warm_up()
        self._log_events()
        self._publish()
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
                adapter=msg.adapter,
                door=msg.door,
                origin=msg.origin,
            )
        except AdmissionError as exc:
            msg.reply.set_exception(exc)
            return
        except BaseException:
            # A bug in admitting it: the loop's handler says what failed; the submitter
            # must not wait for a reply that never comes.
            msg.reply.set_exception(EngineDeadError("the engine failed admitting this request"))
            raise
        self._recipients.actors[msg.request_id] = msg.actor
        self.metrics.admitted(msg.origin)
        msg.reply.set_result(self.core.states[msg.request_id].params)  # as admitted

    def _end(self, request_id: str, reason: FinishReason, message: str | None) -> None:
        """End a live request outside a step's results (a cancel, its actor's own stop, a
        fault) and tell its actor, unless the actor ended it itself."""
        update = self.core.abort(request_id, reason, message)
        actor = self._recipients.actors.pop(request_id, None)
        if update is not None and actor is not None and reason is not FinishReason.STOP:
            actor.put(update)

    def _deliver(self, updates: Mapping[str, Update]) -> list[Submit]:
        """Give each request actor its update: one message per request per step. An actor
        this loop drives says at once whether it ended its request (a stop string): the end
        is recorded in this step. Returns the submissions it met in the inbox (it reads it
        when an actor is gone), to admit after those that came before them."""
        gone, ended = self._recipients.deliver(updates)
        held: list[Submit] = []
        for rid, reason in ended:  # its last output is sent: nothing more to tell it
            self._end(rid, reason, None)
        if gone:
            # An actor that is gone failed (its message is in the inbox) or went without a word.
            held = self._handle(self._drain(), admit=False)
            for rid in gone:
                self._end(rid, FinishReason.ERROR, "the request's actor failed")
        self._log_events()
        self._publish()
        return held

    def log_model_event(self, cls: type, **fields: Any) -> Any:
        """Record and log an event of the model's own (`ModelLoaded`, `ModelUnloaded`: a
        server of several models). Returns the event."""
        event = self.core.record_model_event(cls, **fields)
        self._log_events()
        return event

    def log_refusal(self, msg: Refuse) -> None:
        """Record and log a request a door refused (`SchedulerCore.refuse`: a lone terminal;
        nothing for an id the core has seen), without an event log or a feed nothing. Not
        counted among the finished requests' metrics: the engine never had it."""
        if self._event_log is None and self.feed is None:
            return
        self._log_events()  # in order, before the refusal
        if self.core.refuse(msg.request_id, msg.message, code=msg.code, status=msg.status):
            _hand_over(self._event_log, self.feed, self.core.take_events())

    def _log_events(self) -> None:
        events = self.core.take_events()
        if not events:
            return
        _hand_over(self._event_log, self.feed, events)
        for event in events:
            if type(event) is Terminal:
                state = self.core.state_of(event.request_id)
                self.metrics.finished(event.reason, state.origin if state else "client")

    # -- metrics and the end -------------------------------------------------------------

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
            self._end(rid, FinishReason.CANCELLED, SHUTDOWN_MESSAGE)
        self._log_events()
        self._publish()


def _hand_over(event_log: Any, feed: EventFeed | None, events: list[Event]) -> None:
    """Hand `events` to the log's writer and the live feed (neither waits)."""
    if event_log is not None:
        event_log.append_many(events)
    if feed is not None:
        feed.publish(events)
