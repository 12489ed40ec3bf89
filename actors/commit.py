"""A step's outcome as events: `commit(recorder, plan, result, limits) -> deliveries`.

A plain synchronous function (vLLM's `update_from_output`): it records the events a
step's result implies — chunks, checkpoints, tokens, clean ends — through the
recorder, which applies each to the scheduling state, and returns what each request
actor must be told. Talking to the actors comes after, in the step loop. No MLX, no
awaits: it is tested with hand-made plans and results.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stepline.actors.messages import CacheHit, NewTokens, Progress
from stepline.engine.policy import SchedulerConfig, StepPlan
from stepline.engine.work import StepResult, max_output_tokens
from stepline.events.fold import RequestState, Status, apply
from stepline.events.models import (
    CheckpointReached,
    ChunkPrefilled,
    Decoding,
    FinishReason,
    StepEntry,
    StepPlanned,
    Terminal,
)

_KEEP_FINISHED = 1024  # ended requests' states kept for inspection
# ... and at most this many prompt token ids among them (a 128k-token prompt's state holds
# 128k of them: 1,024 such states would keep gigabytes alive).
_KEEP_FINISHED_TOKENS = 262_144


@dataclass(frozen=True)
class ModelLimits:
    max_context: int  # prompt + output tokens the model supports
    eos_token_ids: frozenset[int]


class Recorder:
    """The one writer of scheduling state: every change is an event, applied with the
    fold's `apply` and appended to the log.

    `states` holds unfinished requests; ended ones move to `finished` (the most recent
    few: at most _KEEP_FINISHED of them, holding at most _KEEP_FINISHED_TOKENS prompt token
    ids together), so neither a step's work nor memory grows with the requests ever served.
    """

    def __init__(self, event_log: Any = None) -> None:
        self.states: dict[str, RequestState] = {}
        self.finished: OrderedDict[str, RequestState] = OrderedDict()
        self._finished_tokens = 0  # prompt token ids held in `finished`
        self.event_log = event_log  # events.log.EventLogWriter (append) or None
        self.seq = 0
        self.step = 0  # number of the last step run
        self.in_step = False  # between planning a step and the end of its commit
        self.on_terminal: Callable[[str, FinishReason], None] = lambda rid, reason: None

    def record(self, cls: type, **fields: Any) -> Any:
        self.seq += 1
        # Events between steps N and N+1 belong to step N+1, so that folding the log up to
        # step N gives exactly the state the loop had when step N ended.
        step = self.step if self.in_step else self.step + 1
        event = cls(seq=self.seq, ts=time.time(), step=step, **fields)
        rid = event.request_id
        if rid is not None:
            state = apply(self.states.get(rid), event)
            if state.is_finished:
                self.states.pop(rid, None)
                self._keep_finished(rid, state)
                self.on_terminal(rid, state.finish_reason or FinishReason.ERROR)
            else:
                self.states[rid] = state
        if self.event_log is not None:
            self.event_log.append(event)
        return event

    def _keep_finished(self, rid: str, state: RequestState) -> None:
        old = self.finished.pop(rid, None)
        if old is not None:
            self._finished_tokens -= _num_ids(old)
        self.finished[rid] = state
        self._finished_tokens += _num_ids(state)
        while len(self.finished) > 1 and (
            len(self.finished) > _KEEP_FINISHED or self._finished_tokens > _KEEP_FINISHED_TOKENS
        ):
            _, dropped = self.finished.popitem(last=False)
            self._finished_tokens -= _num_ids(dropped)


def _num_ids(state: RequestState) -> int:
    return len(state.prompt_token_ids or ())


def record_plan(recorder: Recorder, plan: StepPlan, config: SchedulerConfig) -> None:
    """Record step `plan` (its members, their tokens, the limits it ran under)."""
    states = recorder.states
    recorder.record(
        StepPlanned,
        entries=tuple(
            StepEntry(
                request_id=rid,
                num_tokens=n,
                kind="decode" if states[rid].status is Status.DECODING else "prefill",
            )
            for rid, n in plan.num_scheduled_tokens.items()
        ),
        max_step_tokens=config.max_step_tokens,
        max_num_seqs=config.max_num_seqs,
    )


Delivery = tuple[str, Any]  # (request_id, message for its actor)


def commit(
    recorder: Recorder,
    plan: StepPlan,
    result: StepResult,
    limits: ModelLimits,
    sources: Mapping[str, str] = {},  # noqa: B006 - read only
) -> list[Delivery]:
    """Record step `plan`'s outcome; return the messages for the request actors, in order.

    Requests no longer in `recorder.states` (cancelled while the step ran) are skipped.
    `sources` names where a request's cache hit came from ("memory", "disk").
    """
    states = recorder.states
    out: list[Delivery] = []
    for chunk in plan.chunks:
        rid = chunk.request_id
        state = states.get(rid)
        if state is None:
            continue
        cached = chunk.start if state.num_computed_tokens == 0 and chunk.start > 0 else 0
        pos = chunk.start
        first = True
        # A chunk may end at a checkpoint: each offset is visited once.
        for offset in sorted({*chunk.checkpoints, chunk.end}):
            if offset > pos:
                recorder.record(
                    ChunkPrefilled,
                    request_id=rid,
                    start=pos,
                    end=offset,
                    num_cached_tokens=cached if first else 0,
                    cache_source=sources.get(rid) if cached and first else None,
                )
                first = False
                pos = offset
            if offset in result.checkpoints.get(rid, ()):
                recorder.record(CheckpointReached, request_id=rid, offset=offset)
        if cached:
            out.append((rid, CacheHit(cached)))
        if not chunk.is_final:
            out.append((rid, Progress(chunk.end, states[rid].num_prompt_tokens)))

    for rid, token in result.tokens.items():
        if rid not in states:
            continue
        recorder.record(Decoding, request_id=rid, token_ids=(token,))
        state = states[rid]
        finish = finish_reason(state, token, limits)
        lp = result.logprobs.get(rid)
        out.append(
            (
                rid,
                NewTokens(
                    token_ids=(token,),
                    logprobs=(lp,) if lp is not None else (),
                    finish=finish,
                    stop_token=finish is FinishReason.STOP,
                ),
            )
        )
        if finish is not None:
            recorder.record(Terminal, request_id=rid, reason=finish, message=None)
    return out


def finish_reason(state: RequestState, token: int, limits: ModelLimits) -> FinishReason | None:
    """Whether `token`, just recorded, ends the request: a stop token, or its length."""
    p = state.params
    if token in p.stop_token_ids or (not p.ignore_eos and token in limits.eos_token_ids):
        return FinishReason.STOP
    if state.num_output_tokens >= max_output_tokens(p, state.num_prompt_tokens, limits.max_context):
        return FinishReason.LENGTH
    return None
