"""Request state as a fold of events: `apply(state, event) -> state`.

The step loop keeps its scheduling state by applying the events it records, with
this same function, so replaying a log rebuilds exactly what the engine knew.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from stepline.events.models import (
    Admitted,
    CheckpointReached,
    ChunkPrefilled,
    Decoding,
    Event,
    FinishReason,
    RequestParams,
    StepPlanned,
    Terminal,
)


class Status(StrEnum):
    WAITING = "waiting"  # admitted, no prompt token computed yet
    PREFILLING = "prefilling"  # some prompt tokens computed, not all
    DECODING = "decoding"  # prompt done, generating
    FINISHED = "finished"  # terminal event seen


class RequestState(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str
    status: Status
    num_prompt_tokens: int
    num_computed_tokens: int  # prompt tokens in the cache (cached prefix included)
    num_cached_tokens: int
    cache_source: str | None = None  # "memory" or "disk" for a prefix-cache hit
    prompt_token_ids: tuple[int, ...] | None
    checkpoints: tuple[int, ...]
    checkpoints_reached: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    params: RequestParams
    finish_reason: FinishReason | None = None
    admitted_step: int
    admitted_seq: int  # arrival order: the scheduler serves older requests first
    admitted_ts: float
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    finished_step: int | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


class FoldError(ValueError):
    """An event that cannot apply to the state it meets (a corrupt or reordered log)."""


def apply(state: RequestState | None, event: Event) -> RequestState:
    """Return the request's state after `event`. Raises FoldError on an impossible event."""
    if isinstance(event, Admitted):
        if state is not None:
            raise FoldError(f"request {event.request_id} admitted twice (seq {event.seq})")
        computed = event.num_cached_tokens
        return RequestState(
            request_id=event.request_id,
            status=Status.WAITING,
            num_prompt_tokens=event.num_prompt_tokens,
            num_computed_tokens=computed,
            num_cached_tokens=event.num_cached_tokens,
            cache_source=event.cache_source,
            prompt_token_ids=event.prompt_token_ids,
            checkpoints=event.checkpoints,
            params=event.params,
            admitted_step=event.step,
            admitted_seq=event.seq,
            admitted_ts=event.ts,
        )
    if state is None:
        raise FoldError(f"{event.type} for unknown request (seq {event.seq})")
    if state.is_finished:
        raise FoldError(f"{event.type} after terminal for {state.request_id} (seq {event.seq})")
    if isinstance(event, ChunkPrefilled):
        if event.num_cached_tokens:
            if state.status is not Status.WAITING or state.num_computed_tokens:
                raise FoldError(
                    f"cache hit for {state.request_id} after its prefill began (seq {event.seq})"
                )
            state = state.model_copy(
                update={
                    "num_computed_tokens": event.num_cached_tokens,
                    "num_cached_tokens": event.num_cached_tokens,
                    "cache_source": event.cache_source,
                }
            )
        if event.start != state.num_computed_tokens or event.end <= event.start:
            raise FoldError(
                f"chunk [{event.start}, {event.end}) of {state.request_id} does not continue "
                f"at {state.num_computed_tokens} (seq {event.seq})"
            )
        if event.end > state.num_prompt_tokens:
            raise FoldError(f"chunk past the prompt of {state.request_id} (seq {event.seq})")
        done = event.end == state.num_prompt_tokens
        return state.model_copy(
            update={
                "num_computed_tokens": event.end,
                "status": Status.DECODING if done else Status.PREFILLING,
            }
        )
    if isinstance(event, CheckpointReached):
        return state.model_copy(
            update={"checkpoints_reached": (*state.checkpoints_reached, event.offset)}
        )
    if isinstance(event, Decoding):
        if state.status is not Status.DECODING:
            raise FoldError(f"tokens for {state.request_id} before its prompt is done")
        return state.model_copy(
            update={
                "output_token_ids": state.output_token_ids + event.token_ids,
                "first_token_ts": state.first_token_ts or event.ts,
                "last_token_ts": event.ts,
            }
        )
    if isinstance(event, Terminal):
        return state.model_copy(
            update={
                "status": Status.FINISHED,
                "finish_reason": event.reason,
                "finished_step": event.step,
            }
        )
    raise FoldError(f"not a request event: {event.type}")


def fold(events: Iterable[Event], *, until_step: int | None = None) -> dict[str, RequestState]:
    """Every request's state after `events` (only those of steps <= until_step if given)."""
    states: dict[str, RequestState] = {}
    for event in events:
        if until_step is not None and event.step > until_step:
            break
        if isinstance(event, StepPlanned):
            continue
        states[event.request_id] = apply(states.get(event.request_id), event)
    return states
