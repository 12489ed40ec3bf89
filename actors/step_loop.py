"""The step-loop actor: the engine's central loop.

    plan = schedule(states, config, step)
    result = await executor.call(runner.run, work)
    commit(plan, result)  -> events -> states, tokens -> request actors

Its scheduling state (`states`) changes only by applying the events it records,
with the same `apply` replay uses, so folding its log rebuilds exactly this state.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import structlog
from anyio.streams.memory import MemoryObjectSendStream

from stepline.actors.executor import Executor, ExecutorDeadError
from stepline.actors.messages import Cancel, Finish, NewTokens, Progress, Submit
from stepline.actors.metrics import EngineMetrics
from stepline.engine.cost_model import CostModel
from stepline.engine.policy import (
    AdmissionError,
    SchedulerConfig,
    StepPlan,
    check_admissible,
    schedule,
)
from stepline.engine.work import NewRequest, PrefixLookup, StepResult, StepWork
from stepline.events.fold import RequestState, Status, apply
from stepline.events.models import (
    Admitted,
    CheckpointReached,
    ChunkPrefilled,
    Decoding,
    FinishReason,
    StepEntry,
    StepPlanned,
    Terminal,
)

log = structlog.get_logger(__name__)


_REUSABLE = (FinishReason.STOP, FinishReason.LENGTH)  # ended cleanly: cache worth keeping
_KEEP_FINISHED = 1024  # ended requests' states kept for inspection
_KEEP_IDS = 100_000  # request ids refused as reused within this many requests


class EngineDeadError(AdmissionError):
    """The engine can serve no request: its executor failed."""


@dataclass(frozen=True)
class ModelLimits:
    max_context: int  # prompt + output tokens the model supports
    eos_token_ids: frozenset[int]


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
        cost_model: CostModel | None = None,  # learns step times; None: tokens only
    ):
        self.executor = executor
        self.runner = runner
        self.config = config
        self.limits = limits
        self.metrics = metrics or EngineMetrics()
        self.cost_model = cost_model
        self._event_log = event_log
        self._log_prompts = log_prompts
        self.inbox: MemoryObjectSendStream
        self.inbox, self._inbox = anyio.create_memory_object_stream(inbox_size)
        # The scheduling state: the fold of every event recorded, for requests not yet
        # ended. Ended ones move to `finished` (the most recent few, for inspection), so a
        # step's work does not grow with the number of requests ever served.
        self.states: dict[str, RequestState] = {}
        self.finished: OrderedDict[str, RequestState] = OrderedDict()
        self._recent_ids: OrderedDict[str, None] = OrderedDict()  # to refuse reused ids
        self._actors: dict[str, MemoryObjectSendStream] = {}
        self._pending: dict[str, NewRequest] = {}  # admitted, not yet given to the executor
        # ended since the executor last heard -> whether its cache is worth keeping
        self._to_free: dict[str, bool] = {}
        self._seq = 0
        self.step = 0  # number of the last step run
        self._in_step = False  # between planning a step and the end of its commit
        self.dead_reason: str | None = None
        self.on_step: Callable[[StepLoop], None] | None = None  # test/inspection hook

    # -- events ---------------------------------------------------------------

    def _record(self, cls: type, **fields: Any) -> Any:
        self._seq += 1
        # Events between steps N and N+1 belong to step N+1, so that folding the log up to
        # step N gives exactly the state the loop had when step N ended.
        step = self.step if self._in_step else self.step + 1
        event = cls(seq=self._seq, ts=time.time(), step=step, **fields)
        if event.request_id is not None:
            state = apply(self.states.get(event.request_id), event)
            if state.is_finished:
                self.states.pop(event.request_id, None)
                self._remember(self.finished, event.request_id, state, _KEEP_FINISHED)
            else:
                self.states[event.request_id] = state
        if self._event_log is not None:
            self._event_log.append(event)
        return event

    # -- inbox ----------------------------------------------------------------

    @staticmethod
    def _remember(recent: OrderedDict, key: str, value: Any, limit: int) -> None:
        recent[key] = value
        recent.move_to_end(key)
        while len(recent) > limit:
            recent.popitem(last=False)

    def state_of(self, request_id: str) -> RequestState | None:
        """A request's state: live, or ended recently (the log has every one)."""
        return self.states.get(request_id) or self.finished.get(request_id)

    def _unfinished(self) -> list[RequestState]:
        return list(self.states.values())

    async def _handle(self, msg: Submit | Cancel) -> None:
        if isinstance(msg, Submit):
            await self._submit(msg)
        else:
            await self._cancel(msg.request_id)

    async def _submit(self, msg: Submit) -> None:
        if msg.request_id in self._recent_ids:
            msg.reply.set_exception(
                AdmissionError(f"request id {msg.request_id!r} was already used: send a new one")
            )
            return
        self._remember(self._recent_ids, msg.request_id, None, _KEEP_IDS)
        try:
            if self.dead_reason is not None:
                raise EngineDeadError(f"the engine is unhealthy: {self.dead_reason}")
            check_admissible(
                len(msg.prompt_token_ids),
                msg.params.max_tokens,
                self.limits.max_context,
                self.config,
            )
        except AdmissionError as exc:
            self._reject(msg, exc)
            return
        await self._free_now()  # so requests that just finished can serve this one's prefix
        found = await self._run_executor(
            self.runner.lookup_prefix, msg.request_id, msg.prompt_token_ids
        )
        if found is None:  # the executor died just now
            self._reject(msg, EngineDeadError(f"the engine is unhealthy: {self.dead_reason}"))
            return
        self._admit_event(msg, found)
        self.metrics.prefix_lookup(found.num_tokens)
        self._actors[msg.request_id] = msg.actor
        self._pending[msg.request_id] = NewRequest(
            request_id=msg.request_id,
            prompt_token_ids=msg.prompt_token_ids,
            params=msg.params,
            logprobs=msg.logprobs,
        )
        self.metrics.admitted()
        msg.reply.set_result(found.num_tokens)

    def _reject(self, msg: Submit, exc: AdmissionError) -> None:
        """Log the request as admitted and at once rejected (so the log shows what was
        refused, and why), and raise `exc` in the submitter."""
        self._admit_event(msg)
        self._record(
            Terminal, request_id=msg.request_id, reason=FinishReason.REJECTED, message=str(exc)
        )
        msg.reply.set_exception(exc)

    def _admit_event(self, msg: Submit, found: PrefixLookup | None = None) -> None:
        ids = msg.prompt_token_ids
        digest = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()
        self._record(
            Admitted,
            request_id=msg.request_id,
            num_prompt_tokens=len(ids),
            prompt_token_ids=ids if self._log_prompts else None,
            prompt_sha256=digest,
            checkpoints=tuple(sorted({c for c in msg.checkpoints if 0 < c <= len(ids)})),
            num_cached_tokens=found.num_tokens if found else 0,
            cache_source=found.source if found else None,
            params=msg.params,
        )

    async def _cancel(self, request_id: str) -> None:
        if request_id not in self.states:
            return  # ended already, or never admitted
        await self._end(request_id, FinishReason.CANCELLED, "cancelled by the client")

    async def _end(self, request_id: str, reason: FinishReason, message: str | None) -> None:
        """Record the terminal event, free the request's slot, tell its actor."""
        self._record(Terminal, request_id=request_id, reason=reason, message=message)
        if self._pending.pop(request_id, None) is None:
            self._to_free[request_id] = reason in _REUSABLE
        actor = self._actors.pop(request_id, None)
        if actor is not None:
            with anyio.CancelScope(shield=True):
                await self._tell(actor, Finish(reason, message))
            actor.close()
        self.metrics.finished(reason)

    async def _tell(self, actor: MemoryObjectSendStream, msg: Any) -> bool:
        """Send `msg`; False if the actor is gone (it failed, or the engine is closing)."""
        try:
            await actor.send(msg)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        return True

    def _drain(self) -> list[Submit | Cancel]:
        msgs = []
        while True:
            try:
                msgs.append(self._inbox.receive_nowait())
            except anyio.WouldBlock:
                return msgs

    # -- the loop ------------------------------------------------------------

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox:
            while True:
                try:
                    if not self._unfinished() and not self._to_free:
                        try:
                            msg = await self._inbox.receive()  # idle: sleep until work arrives
                        except anyio.EndOfStream:
                            return
                        await self._handle(msg)
                    for msg in self._drain():
                        await self._handle(msg)
                    await self._step()
                except Exception as exc:
                    # A bug here must not leave clients waiting on streams that never end:
                    # fail like a dead executor (every request ends with an error).
                    log.exception("step_loop_failed")
                    self.executor.mark_dead(exc)
                    self._in_step = False
                    await self._die(exc)

    async def _step(self) -> None:
        cost = self.cost_model.cost if self.cost_model is not None else None
        plan = schedule(self.states, self.config, self.step + 1, cost)
        if plan.is_empty:
            if self._to_free:
                await self._free_now()
            elif self._unfinished():
                # Nothing fits now (cannot happen with the policy's admission rules,
                # but never spin): wait for the next message.
                await self._handle(await self._inbox.receive())
            return
        self.step += 1
        self._in_step = True
        try:
            await self._run_step(plan)
        finally:
            self._in_step = False
        if self.on_step is not None:
            self.on_step(self)

    async def _run_step(self, plan: StepPlan) -> None:
        self._record(
            StepPlanned,
            entries=tuple(
                StepEntry(
                    request_id=rid,
                    num_tokens=n,
                    kind="decode" if self.states[rid].status is Status.DECODING else "prefill",
                )
                for rid, n in plan.num_scheduled_tokens.items()
            ),
            max_step_tokens=self.config.max_step_tokens,
            max_num_seqs=self.config.max_num_seqs,
        )
        admit = tuple(
            self._pending.pop(c.request_id) for c in plan.chunks if c.request_id in self._pending
        )
        frees, retire = self._take_frees()
        work = StepWork(plan=plan, admit=admit, free=frees, retire=retire)
        result = await self._run_executor(self.runner.run, work)
        if result is None:
            return
        if self.cost_model is not None:
            self.cost_model.observe(plan.features, result.seconds)
        # Cancels that arrived during the step win over its results.
        for msg in self._drain():
            await self._handle(msg)
        await self._commit(plan, result)
        self.metrics.step(plan.num_tokens, self.config.max_step_tokens, result.seconds)
        self.metrics.prefix_cache(result.prefix_cache)

    def _take_frees(self) -> tuple[tuple[str, ...], frozenset[str]]:
        """Requests ended since the executor last heard, and those whose caches are worth
        keeping (they ended cleanly)."""
        frees, self._to_free = self._to_free, {}
        return tuple(frees), frozenset(r for r, reusable in frees.items() if reusable)

    async def _free_now(self) -> None:
        if self._to_free:
            await self._run_executor(self.runner.free, *self._take_frees())

    async def _run_executor(self, fn: Callable, *args: Any) -> Any:
        try:
            return await self.executor.call(fn, *args)
        except ExecutorDeadError as exc:
            await self._die(exc)
        except Exception as exc:
            self.executor.mark_dead(exc)
            await self._die(exc)
        return None

    async def _die(self, exc: BaseException) -> None:
        """The executor failed: end every in-flight request with an error; admit no more."""
        self.dead_reason = f"executor failed: {exc!r}"
        log.error("engine_dead", reason=self.dead_reason)
        self.metrics.healthy.set(0)
        for state in self._unfinished():
            await self._end(state.request_id, FinishReason.ERROR, self.dead_reason)
        self._to_free.clear()

    async def _commit(self, plan: StepPlan, result: StepResult) -> None:
        for chunk in plan.chunks:
            rid = chunk.request_id
            if rid not in self.states:
                continue  # cancelled while the step ran
            pos = chunk.start
            for offset in (*chunk.checkpoints, chunk.end):
                if offset > pos:
                    self._record(ChunkPrefilled, request_id=rid, start=pos, end=offset)
                    pos = offset
                if offset in result.checkpoints.get(rid, ()):
                    self._record(CheckpointReached, request_id=rid, offset=offset)
            if not chunk.is_final:
                await self._tell(
                    self._actors[rid], Progress(chunk.end, self.states[rid].num_prompt_tokens)
                )

        asks: list[tuple[str, asyncio.Future, FinishReason | None]] = []
        loop = asyncio.get_running_loop()
        for rid, token in result.tokens.items():
            before = self.states.get(rid)
            if before is None:
                continue  # cancelled while the step ran
            self._record(Decoding, request_id=rid, token_ids=(token,))
            state = self.states[rid]
            first = before.num_output_tokens == 0
            since = before.admitted_ts if first else before.last_token_ts
            self.metrics.token(state.last_token_ts - since, first)
            finish = self._finish_reason(state, token)
            # Only an actor with stop strings can end its request: only it is asked.
            reply = loop.create_future() if state.params.stop else None
            lp = result.logprobs.get(rid)
            delivered = await self._tell(
                self._actors[rid],
                NewTokens(
                    token_ids=(token,),
                    logprobs=(lp,) if lp is not None else (),
                    finish=finish,
                    stop_token=finish is FinishReason.STOP,
                    reply=reply,
                ),
            )
            if not delivered:  # the actor failed earlier and is gone
                await self._end(rid, FinishReason.ERROR, "the request's actor failed")
            elif reply is not None:
                asks.append((rid, reply, finish))
            elif finish is not None:
                self._finished(rid, finish)
        for rid, reply, finish in asks:
            try:
                stop_string = await reply
            except Exception as exc:  # the actor failed on this request
                await self._end(rid, FinishReason.ERROR, f"request actor failed: {exc!r}")
                continue
            if finish is None and stop_string:
                finish = FinishReason.STOP
            if finish is not None:
                self._finished(rid, finish)
        self.metrics.gauges(self.states.values(), getattr(self._event_log, "lag", 0))

    def _finished(self, rid: str, reason: FinishReason) -> None:
        """The request ended cleanly; its actor already sent its last output and stops."""
        self._actors.pop(rid).close()
        self._record(Terminal, request_id=rid, reason=reason, message=None)
        self._to_free[rid] = True
        self.metrics.finished(reason)

    def _finish_reason(self, state: RequestState, token: int) -> FinishReason | None:
        p = state.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.limits.eos_token_ids):
            return FinishReason.STOP
        limit = min(p.max_tokens, self.limits.max_context - state.num_prompt_tokens)
        if state.num_output_tokens >= limit:
            return FinishReason.LENGTH
        return None

    async def shutdown(self) -> None:
        """End every request still in flight (engine closing)."""
        for state in self._unfinished():
            await self._end(state.request_id, FinishReason.CANCELLED, "the engine is shutting down")
