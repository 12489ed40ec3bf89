"""What the scheduler core records of a step, as plain functions of the plan, a request's
state and the executor's result: the fields of its events (`admitted`, `planned`,
`chunk_records`),
where a request's sampled tokens end it (`cut_at_finish`: a stop token, its length, its loop
guard), and what the step did for each
request actor and the metrics (`StepOutcome`). The core stamps and applies the events
(`SchedulerCore._record`); nothing here changes a state.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stepline.actors.messages import TokenLogprob, Update
from stepline.actors.scheduler.loop_guard import LoopGuard
from stepline.actors.scheduler.plan import (
    ScheduledChunk,
    ScheduledEncode,
    SchedulerConfig,
    StepPlan,
)
from stepline.actors.scheduler.spans import PromptImage, inside_image
from stepline.events.fold import RequestState, Status
from stepline.events.models import (
    CheckpointReached,
    ChunkPrefilled,
    FinishReason,
    RequestParams,
    prompt_digest,
)

Record = tuple[type, dict[str, Any]]  # an event's class and its fields, before the core stamps it


@dataclass(frozen=True)
class ModelLimits:
    max_context: int  # prompt + output tokens the model supports
    eos_token_ids: frozenset[int]
    # its cache serves a prefix only at the offset it was taken at (recurrent state, sliding
    # windows: `engine.prefix_cache.exact_only`): with a prefix cache, every prompt is also
    # snapshotted one token before its end
    exact_prefixes: bool = False


def admitted(
    request_id: str,
    ids: tuple[int, ...],
    params: RequestParams,
    checkpoints: Sequence[int],
    client: str | None,
    images: Sequence[PromptImage],
    salt: str | None,
) -> dict[str, Any]:
    """The fields of a request's `Admitted` event: its prompt (and its digest under the
    log's `salt`), its limits as admitted, its client and its images' references."""
    return dict(
        request_id=request_id,
        num_prompt_tokens=len(ids),
        prompt_token_ids=ids,  # the log's writer leaves them out if told to
        prompt_sha256=prompt_digest(salt, ids),
        # none inside an image: a cache hit ending there is cut back to the image's start
        # (`outside_images`), and a whole image's span is computed in one forward
        checkpoints=tuple(
            sorted({c for c in checkpoints if 0 < c <= len(ids) and not inside_image(images, c)})
        ),
        params=params,
        client=client,
        images=tuple(i.ref() for i in images),
    )


def planned(plan: StepPlan, config: SchedulerConfig) -> dict[str, Any]:
    """The fields of step `plan`'s `StepPlanned` event: its rows (the decode rows, then the
    chunks, then the encoder's work, which has no tokens), what sized each chunk, and who
    sat the step out and why."""
    scheduled, encodes = plan.num_scheduled_tokens, plan.encodes
    return dict(
        request_ids=(*scheduled, *(e.request_id for e in encodes)),
        num_tokens=(*scheduled.values(), *(0 for _ in encodes)),
        kinds=("decode",) * len(plan.decodes)
        + ("prefill",) * len(plan.chunks)
        + ("encode",) * len(encodes),
        max_step_tokens=config.max_step_tokens,
        max_num_seqs=config.max_num_seqs,
        limits=(None,) * len(plan.decodes)
        + tuple(c.limit for c in plan.chunks)
        + (None,) * len(encodes),
        held_ids=tuple(rid for rid, _ in plan.held),
        held_reasons=tuple(why for _, why in plan.held),
    )


def first_cached(state: RequestState, chunk: ScheduledChunk) -> int:
    """The tokens a request's cache hit served, where `chunk` is its first: 0 for any other."""
    return chunk.start if state.num_computed_tokens == 0 and chunk.start > 0 else 0


def chunk_records(
    state: RequestState,
    chunk: ScheduledChunk,
    reached: Collection[int],
    cache_source: str,
    miss: Mapping[str, Any] | None = None,
) -> list[Record]:
    """Request `state`'s chunk done: a `chunk-prefilled` for each stretch up to a checkpoint
    or the chunk's end (the first carrying its cache hit, from `cache_source`, and on a
    request's first chunk why the hit stops there, `miss`), and a `checkpoint-reached` at
    each checkpoint the executor `reached`."""
    rid = state.request_id
    cached = first_cached(state, chunk)
    records: list[Record] = []
    pos = chunk.start
    first = True
    # A chunk may end at a checkpoint: each offset is visited once.
    for offset in sorted({*chunk.checkpoints, chunk.end}):
        if offset > pos:
            fields = dict(
                request_id=rid,
                start=pos,
                end=offset,
                num_cached_tokens=cached if first else 0,
                cache_source=cache_source if cached and first else None,
                images=tuple(i.digest for i in state.images if i.start < offset and pos < i.end),
            )
            if first and miss:
                fields.update(miss)
            records.append((ChunkPrefilled, fields))
            first = False
            pos = offset
        if offset in reached:
            records.append((CheckpointReached, dict(request_id=rid, offset=offset)))
    return records


def finish_reason(
    state: RequestState, num_output_tokens: int, token: int, limits: ModelLimits
) -> FinishReason | None:
    """Whether `token`, the request's `num_output_tokens`-th, ends it: a stop token, or its
    length (its `max_tokens`, cut to the context when it was admitted)."""
    p = state.params
    if token in p.stop_token_ids or (not p.ignore_eos and token in limits.eos_token_ids):
        return FinishReason.STOP
    if num_output_tokens >= p.max_tokens:
        return FinishReason.LENGTH
    return None


Sampled = tuple[str, list[int], FinishReason | None]  # a request, its tokens, how they end it


def cut_at_finish(
    states: Mapping[str, RequestState],
    live: Sequence[tuple[str, list[int]]],
    limits: ModelLimits,
    loop_guards: Mapping[str, LoopGuard] | None = None,
) -> list[Sampled]:
    """Each live request's tokens of a step (a row that kept drafts has several), cut after
    the first that ends it (stop token, length, or where it has a loop guard in
    `loop_guards`, the token that closes a loop: each token kept goes into its guard), with
    why it ended (None: it goes on)."""
    kept: list[Sampled] = []
    guards = loop_guards or {}
    for rid, tokens in live:
        before = states[rid]
        guard = guards.get(rid)
        finish = None
        for i, token in enumerate(tokens):
            finish = finish_reason(before, before.num_output_tokens + i + 1, token, limits)
            if finish is None and guard is not None and guard.add(token):
                finish = FinishReason.LOOP
            if finish is not None:
                del tokens[i + 1 :]
                break
        kept.append((rid, tokens, finish))
    return kept


@dataclass
class StepOutcome:
    """What one step did, beyond its events: each request actor's update and the figures
    the metrics take."""

    updates: dict[str, Update] = field(default_factory=dict)  # request_id -> its update
    # seconds since the request's previous token, for each token but a request's first ...
    gaps: list[float] = field(default_factory=list)
    # ... and since its admission, for each first token
    firsts: list[float] = field(default_factory=list)
    cache_lookups: list[int] = field(default_factory=list)  # cached tokens of each first chunk

    def encoded(
        self, state: RequestState, encode: ScheduledEncode, miss: Mapping[str, Any]
    ) -> None:
        """An image's encoder units done; a request's first step: its cache hit (and why it
        stops there, `miss`: `Bookkeeping.take_miss`'s fields)."""
        if state.status is Status.WAITING:
            self.cache_lookups.append(encode.cached)
            self._missed(state.request_id, miss)
            if encode.cached:  # its first step: the cache hit it starts from
                update = self.updates.setdefault(state.request_id, Update())
                update.num_cached_tokens = update.num_computed_tokens = encode.cached

    def prefilled(
        self, state: RequestState, chunk: ScheduledChunk, miss: Mapping[str, Any]
    ) -> None:
        """A chunk of the request's prompt done (`state`: before it; `miss` as `encoded`)."""
        cached = first_cached(state, chunk)
        if state.status is Status.WAITING:
            self.cache_lookups.append(cached)
            self._missed(state.request_id, miss)
        update = self.updates.setdefault(state.request_id, Update())
        update.num_computed_tokens = chunk.end
        if cached:
            update.num_cached_tokens = cached

    def _missed(self, request_id: str, miss: Mapping[str, Any]) -> None:
        if miss:
            update = self.updates.setdefault(request_id, Update())
            update.prefix_miss, update.prefix_shared = miss["prefix_miss"], miss["prefix_shared"]

    def sampled(
        self,
        before: RequestState,
        after: RequestState,
        tokens: list[int],
        ts: float,
        logprob: TokenLogprob | None,
        finish: FinishReason | None,
    ) -> None:
        """A request's tokens of the step (`before` and `after` they were applied, at
        `ts`): into its update, and its gap since the last token (or its first's wait)."""
        if before.last_token_ts is None:
            self.firsts.append(ts - before.admitted_ts)
        else:
            self.gaps.append(ts - before.last_token_ts)
        update = self.updates.get(before.request_id)
        if update is None:  # a decode row (a final chunk has one already)
            update = self.updates[before.request_id] = Update(token_ids=tokens)
        else:
            update.token_ids.extend(tokens)
        update.num_output_tokens = after.num_output_tokens
        if logprob is not None:
            update.logprobs.append(logprob)
        if finish is not None:
            update.finish = finish
            update.stop_token = finish is FinishReason.STOP
