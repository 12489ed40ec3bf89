"""Typed messages between the actors. Each ask carries its own reply future."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from stepline.actors.mailbox import Mailbox
from stepline.actors.scheduler.spans import PromptImage
from stepline.actors.scheduler.work import TokenLogprob
from stepline.events.models import FinishReason, Origin, PrefixMiss, RequestParams


# --- to the step loop ---------------------------------------------------------
@dataclass(frozen=True)
class Arriving:
    """A request is on its way: being parsed, checked or tokenized by the API, not yet in
    the inbox. An idle step loop waits briefly for those it counts, so that the first step of
    a burst sees the whole burst; `Arrived` (or the request's `Submit` before it) ends it."""


@dataclass(frozen=True)
class Arrived:
    """A request counted by `Arriving` is in the inbox now, or will never be (it failed)."""


@dataclass(frozen=True)
class Refuse:
    """A request a door refused before it reached the engine, to record (a lone `terminal`):
    `StepLoop.log_refusal` records it at once, not through the inbox, so that the door's
    reply comes after it is in the log."""

    request_id: str
    message: str
    code: str
    status: int


@dataclass(frozen=True)
class EndWarmUp:
    """No more warm-up (the engine is shutting down): a turn on the executor ends at its
    next step, and none starts again."""


@dataclass(frozen=True)
class Submit:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: RequestParams
    checkpoints: tuple[int, ...]
    # The request actor's inbox; or the actor itself, which the step loop then drives (one
    # with stop strings: a stop ends it in the step that found it, `RequestActor.take`).
    actor: Mailbox[Update] | Any
    reply: asyncio.Future  # set to the admitted RequestParams, or to the AdmissionError
    client: str | None = None  # who sent it (fair share between clients); None: anonymous
    images: tuple[PromptImage, ...] = ()  # the prompt's images, in order (a vision model)
    adapter: str | None = None  # the LoRA adapter it runs with (engine/lora.py); None: the base
    door: str | None = None  # the HTTP path it came in at (`Admitted.door`); None: Python
    origin: Origin = "client"  # who asked for it (`Admitted.origin`): a client, or the engine


@dataclass(frozen=True)
class Cancel:
    """End a request: the client went away (cancelled), or its actor failed (error); or the
    server is stopping (`message` SHUTDOWN_MESSAGE: a background response is then recovered
    on the next start, api/responses/recovery.py)."""

    request_id: str
    reason: FinishReason = FinishReason.CANCELLED
    message: str | None = None  # None: the client's ("cancelled by the client")


# What a request the engine's stop ends records as its terminal's message.
SHUTDOWN_MESSAGE = "the engine is shutting down"


# --- step loop -> request actor --------------------------------------------------
@dataclass(slots=True)
class Update:
    """Everything one step (or an end outside a step) did for one request: one message per
    request per step."""

    token_ids: list[int] = field(default_factory=list)  # sampled this step
    num_output_tokens: int = 0  # the request's tokens sampled so far, this step's included
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token where asked for
    num_computed_tokens: int = 0  # prompt tokens in the cache so far (0: not said)
    num_cached_tokens: int | None = None  # of those, served by the prefix cache (first chunk)
    # why the cache hit stops there, and how far a cached prefix matched (first step only;
    # `ChunkPrefilled.prefix_miss`): None where it reused all it could, or had no cache
    prefix_miss: PrefixMiss | None = None
    prefix_shared: int = 0
    finish: FinishReason | None = None  # the request ended (by the core: stop, length, ...)
    stop_token: bool = False  # the last token is a stop token: count it, do not print it
    message: str | None = None  # what went wrong, for an error or cancel
    embedding: tuple[float, ...] | None = None  # an embedding request's vector, at its end
