"""Request state as a fold of events: `apply(state, event) -> state`.

The step loop keeps its scheduling state by applying the events it records, with
this same function, so replaying a log rebuilds exactly what the engine knew.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from stepline.events.models import (
    Admitted,
    CheckpointReached,
    ChunkPrefilled,
    Decoding,
    Event,
    FinishReason,
    ImageEncoded,
    ImageRef,
    Origin,
    Parked,
    RequestParams,
    Resumed,
    StepFinished,
    StepPlanned,
    Terminal,
    TokensSampled,
    per_request,
)


class Status(StrEnum):
    WAITING = "waiting"  # admitted, no prompt token computed yet
    PREFILLING = "prefilling"  # some prompt tokens computed, not all
    DECODING = "decoding"  # prompt done, generating
    FINISHED = "finished"  # terminal event seen


@dataclass(frozen=True, kw_only=True)
class RequestState:
    """One request's state: made only by `apply` (from validated events), never changed."""

    request_id: str
    status: Status
    num_prompt_tokens: int
    num_computed_tokens: int  # prompt tokens in the cache (cached prefix included)
    num_cached_tokens: int
    cache_source: str | None = None  # "memory" or "disk" for a prefix-cache hit
    prompt_token_ids: tuple[int, ...] | None
    checkpoints: tuple[int, ...]
    checkpoints_reached: tuple[int, ...] = ()
    # Output tokens are counted, not kept: the request actor owns the text, and a log may
    # leave the ids out (log_outputs=False) yet fold to the same state.
    num_output_tokens: int = 0
    params: RequestParams
    finish_reason: FinishReason | None = None
    admitted_step: int
    # the last step its prompt moved (a chunk), or its admission: the scheduler puts a
    # prompt that has not moved for a few steps before every younger one
    moved_step: int
    admitted_seq: int  # arrival order: the scheduler serves older requests first
    admitted_ts: float
    client: str | None = None  # who sent it (`Admitted.client`): fair share between clients
    # decoding, but out of the decode batch for fair share (`Parked`, until `Resumed`)
    parked: bool = False
    images: tuple[ImageRef, ...] = ()  # its prompt's images, in prompt order
    adapter: str | None = None  # the LoRA adapter it runs with (`Admitted.adapter`)
    origin: Origin = "client"  # who asked for it (`Admitted.origin`)
    encoded: tuple[int, ...] = ()  # of each image, the encoder's units done
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    finished_step: int | None = None
    # False: refused at a door (a lone `terminal`, reason rejected): it never reached the
    # engine, so it has no prompt and no parameters (`params` is `NOT_ADMITTED`)
    admitted: bool = True

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def is_background(self) -> bool:
        """The engine's own request (a next turn's prefill), not a client's: it takes only
        what no client's request wants (actors/scheduler/background.py)."""
        return self.origin != "client"

    def evolve(self, **changes: Any) -> RequestState:
        """A copy with `changes` applied. A plain copy of the fields (what `apply` makes
        every new state with, once per token: ~4x cheaper than `dataclasses.replace`, which
        runs `__init__`); the field names are `apply`'s own, so nothing is checked."""
        new = object.__new__(RequestState)
        fields = new.__dict__
        fields.update(self.__dict__)
        fields.update(changes)
        return new


# What a request refused at a door holds as its parameters: it was never admitted, so it has
# none; these say it generates nothing (`RequestState.admitted` is False).
NOT_ADMITTED = RequestParams(
    max_tokens=0, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None
)


class FoldError(ValueError):
    """An event that cannot apply to the state it meets (a corrupt or reordered log).

    `kind` names the broken rule; replay's verify reports it under that name.
    """

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(message)


_NORMAL_ENDS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.LOOP)


def apply(state: RequestState | None, event: Event | Decoding) -> RequestState:
    """Return the request's state after `event`, one request's event (a step's
    `TokensSampled` is applied per request: `decodings()`, or `apply_sampled` for each row).
    A `terminal` (rejected) with no state before it is a request refused at a door: it starts
    and ends there. Raises FoldError on an impossible event."""
    if isinstance(event, Admitted):
        if state is not None:
            raise FoldError(
                "admitted-twice", f"request {event.request_id} admitted twice (seq {event.seq})"
            )
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
            moved_step=event.step,
            admitted_seq=event.seq,
            admitted_ts=event.ts,
            client=event.client,
            images=event.images,
            encoded=(0,) * len(event.images),
            adapter=event.adapter,
            origin=event.origin,
        )
    rid = getattr(event, "request_id", None)
    if state is None:
        if isinstance(event, Terminal) and event.reason is FinishReason.REJECTED:
            return _refused(event)
        raise FoldError(
            "unknown-request",
            f"{event.type} for request {rid}, which was never admitted (seq {event.seq})",
        )
    if state.is_finished:
        if isinstance(event, Terminal):
            raise FoldError(
                "two-terminals",
                f"request {rid} ends twice: {state.finish_reason}, then {event.reason.value} "
                f"(seq {event.seq})",
            )
        raise FoldError(
            "event-after-terminal",
            f"{event.type} for request {rid} after its terminal event (seq {event.seq})",
        )
    if isinstance(event, ChunkPrefilled):
        return _apply_chunk(state, event)
    if isinstance(event, ImageEncoded):
        return _apply_encoded(state, event)
    if isinstance(event, CheckpointReached):
        if event.offset > state.num_computed_tokens:
            raise FoldError(
                "checkpoint-ahead-of-prefill",
                f"request {rid} snapshotted at {event.offset} with only "
                f"{state.num_computed_tokens} prompt tokens computed (seq {event.seq})",
            )
        return state.evolve(checkpoints_reached=(*state.checkpoints_reached, event.offset))
    if isinstance(event, Decoding):
        return apply_sampled(state, event, event.num_tokens)
    if isinstance(event, Parked | Resumed):
        return _apply_seat(state, event)
    if isinstance(event, Terminal):
        if event.reason in _NORMAL_ENDS and state.num_computed_tokens != state.num_prompt_tokens:
            raise FoldError(
                "prompt-not-covered",
                f"request {rid} finished ({event.reason.value}) with "
                f"{state.num_computed_tokens} of its {state.num_prompt_tokens} prompt tokens "
                f"computed (seq {event.seq})",
            )
        return state.evolve(
            status=Status.FINISHED,
            finish_reason=event.reason,
            finished_step=event.step,
        )
    raise FoldError("not-a-request-event", f"not a request event: {event.type}")


def _refused(event: Terminal) -> RequestState:
    """The state of a request refused at a door: ended (rejected) where it arrived, with no
    prompt, no parameters and nothing computed."""
    return RequestState(
        request_id=event.request_id,
        status=Status.FINISHED,
        num_prompt_tokens=0,
        num_computed_tokens=0,
        num_cached_tokens=0,
        prompt_token_ids=None,
        checkpoints=(),
        params=NOT_ADMITTED,
        finish_reason=FinishReason.REJECTED,
        admitted_step=event.step,
        moved_step=event.step,
        admitted_seq=event.seq,
        admitted_ts=event.ts,
        finished_step=event.step,
        admitted=False,
    )


def _apply_seat(state: RequestState, event: Parked | Resumed) -> RequestState:
    """A decoding request leaves its seat (`Parked`) or takes one again (`Resumed`)."""
    parks = isinstance(event, Parked)
    if state.status is not Status.DECODING or state.parked is parks:
        now = "parked" if state.parked else state.status.value
        raise FoldError(
            "park-out-of-turn",
            f"request {state.request_id} is {event.type} while {now} (seq {event.seq})",
        )
    return state.evolve(parked=parks)


def apply_sampled(
    state: RequestState, event: TokensSampled | Decoding, num_tokens: int
) -> RequestState:
    """The state of a live request after `num_tokens` of its tokens, sampled in `event` (a
    step's `TokensSampled`, or that request's `Decoding` view of it). The scheduler core
    applies a step's rows with this, without building the per-request views."""
    if state.status is not Status.DECODING:
        raise FoldError(
            "prompt-not-covered",
            f"request {state.request_id} got tokens with {state.num_computed_tokens} of its "
            f"{state.num_prompt_tokens} prompt tokens computed (seq {event.seq})",
        )
    if state.parked:
        raise FoldError(
            "tokens-while-parked",
            f"request {state.request_id} got tokens while parked (seq {event.seq})",
        )
    return state.evolve(
        num_output_tokens=state.num_output_tokens + num_tokens,
        first_token_ts=state.first_token_ts or event.ts,
        last_token_ts=event.ts,
    )


def _cache_hit(state: RequestState, event: ChunkPrefilled | ImageEncoded) -> RequestState:
    """`state` with the prefix-cache hit its first step names (none: as it was)."""
    if not event.num_cached_tokens:
        return state
    if state.status is not Status.WAITING or state.num_computed_tokens:
        raise FoldError(
            "cache-hit-mid-prefill",
            f"request {state.request_id} starts from the prefix cache after its prefill began "
            f"(seq {event.seq})",
        )
    return state.evolve(
        num_computed_tokens=event.num_cached_tokens,
        num_cached_tokens=event.num_cached_tokens,
        cache_source=event.cache_source,
    )


def _apply_encoded(state: RequestState, event: ImageEncoded) -> RequestState:
    rid = state.request_id
    state = _cache_hit(state, event)
    i = event.image
    if not 0 <= i < len(state.images):
        raise FoldError(
            "unknown-image", f"request {rid} has no image {i} to encode (seq {event.seq})"
        )
    done, units = state.encoded[i], state.images[i].units
    if not done == event.start < event.end <= units:
        raise FoldError(
            "non-contiguous-encoding",
            f"request {rid} encodes units [{event.start}, {event.end}) of image {i}, which had "
            f"{done} of {units} done (seq {event.seq})",
        )
    status = Status.PREFILLING if state.status is Status.WAITING else state.status
    return with_encoded(state, i, event.end).evolve(status=status, moved_step=event.step)


def with_encoded(state: RequestState, image: int, units: int) -> RequestState:
    """`state` with `units` of its image number `image`'s encoder work done."""
    encoded = (*state.encoded[:image], units, *state.encoded[image + 1 :])
    return state.evolve(encoded=encoded)


def _apply_chunk(state: RequestState, event: ChunkPrefilled) -> RequestState:
    rid = state.request_id
    state = _cache_hit(state, event)
    computed = state.num_computed_tokens
    if event.end <= event.start:
        raise FoldError(
            "non-contiguous-chunk",
            f"request {rid} has an empty chunk [{event.start}, {event.end}) (seq {event.seq})",
        )
    if event.start > computed:
        raise FoldError(
            "non-contiguous-chunk",
            f"request {rid} skips prompt tokens [{computed}, {event.start}): its chunk starts "
            f"at {event.start} (seq {event.seq})",
        )
    if event.start < computed:
        raise FoldError(
            "non-contiguous-chunk",
            f"request {rid} computes prompt tokens [{event.start}, {min(event.end, computed)}) "
            f"twice (seq {event.seq})",
        )
    if event.end > state.num_prompt_tokens:
        raise FoldError(
            "chunk-past-prompt",
            f"request {rid} has a chunk ending at {event.end}, past its "
            f"{state.num_prompt_tokens}-token prompt (seq {event.seq})",
        )
    for i, image in enumerate(state.images):
        what = "audio clip" if image.medium == "audio" else "image"  # one rule for both
        if event.end > image.start and image.end > event.start and state.encoded[i] < image.units:
            raise FoldError(
                "chunk-before-encoding",
                f"request {rid} has a chunk [{event.start}, {event.end}) in its {what}'s span "
                f"[{image.start}, {image.end}) before the {what} was encoded (seq {event.seq})",
            )
        if image.whole and image.start < event.end < image.end:
            raise FoldError(
                "chunk-splits-image",
                f"request {rid} has a chunk ending at {event.end}, inside its {what}'s span "
                f"[{image.start}, {image.end}) (seq {event.seq})",
            )
    embed = state.params.embed
    if (
        embed is not None
        and embed.whole
        and (event.start, event.end) != (0, state.num_prompt_tokens)
    ):
        raise FoldError(
            "chunk-splits-prompt",
            f"request {rid} has a chunk [{event.start}, {event.end}) of its "
            f"{state.num_prompt_tokens}-token prompt, which goes whole (a non-causal model's; "
            f"seq {event.seq})",
        )
    done = event.end == state.num_prompt_tokens
    return state.evolve(
        num_computed_tokens=event.end,
        status=Status.DECODING if done else Status.PREFILLING,
        moved_step=event.step,
    )


def fold(events: Iterable[Event], *, until_step: int | None = None) -> dict[str, RequestState]:
    """Every request's state after `events` (only those of steps <= until_step if given)."""
    states: dict[str, RequestState] = {}
    for event in events:
        if until_step is not None and event.step > until_step:
            break
        if isinstance(event, StepPlanned | StepFinished):
            continue
        for one in per_request(event):
            rid = one.request_id
            assert rid is not None
            states[rid] = apply(states.get(rid), one)
    return states
