"""Typed messages between the actors. Each ask carries its own reply future."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from anyio.streams.memory import MemoryObjectSendStream

from stepline.engine.work import TokenLogprob
from stepline.events.models import FinishReason, RequestParams


# --- to the step loop ---------------------------------------------------------
@dataclass
class Arrivals:
    """Requests on their way to the step loop: being parsed, checked or tokenized by the API,
    not yet in its inbox. The API counts them; an idle step loop waits briefly for them, so
    that the first step of a burst sees the whole burst."""

    preparing: int = 0

    def arrive(self) -> Arrival:
        self.preparing += 1
        return Arrival(self)


class Arrival:
    """One request's count in `Arrivals.preparing`; `done` takes it back (once)."""

    def __init__(self, arrivals: Arrivals) -> None:
        self._arrivals = arrivals
        self.open = True

    def done(self) -> None:
        if self.open:
            self.open = False
            self._arrivals.preparing -= 1


@dataclass(frozen=True)
class Submit:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: RequestParams
    checkpoints: tuple[int, ...]
    logprobs: int | None
    actor: MemoryObjectSendStream  # the request actor's inbox
    reply: asyncio.Future  # set to None when admitted, or to the AdmissionError


@dataclass(frozen=True)
class Cancel:
    """End a request: the client went away (cancelled), or its actor found a stop string
    (stop: the few tokens computed past it are never shown)."""

    request_id: str
    reason: FinishReason = FinishReason.CANCELLED


# --- step loop -> request actor --------------------------------------------------
@dataclass(frozen=True)
class Progress:
    num_computed_tokens: int  # prompt tokens in the cache so far
    num_prompt_tokens: int


@dataclass(frozen=True)
class CacheHit:
    num_cached_tokens: int  # prompt tokens the request started with from the prefix cache


@dataclass(frozen=True)
class NewTokens:
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]  # one per token where asked for, else empty
    finish: FinishReason | None  # set when the step loop ends the request (length, stop token)
    stop_token: bool  # the last token is a stop token: count it, do not print it


@dataclass(frozen=True)
class Finish:
    """The request ended without new tokens (cancelled, error)."""

    reason: FinishReason
    message: str | None = None
