"""Typed messages between the actors. Each ask carries its own reply future."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from stepline.actors.mailbox import Mailbox
from stepline.actors.scheduler.spans import PromptImage
from stepline.actors.scheduler.work import TokenLogprob
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
    actor: Mailbox[Update]  # the request actor's inbox
    reply: asyncio.Future  # set to None when admitted, or to the AdmissionError
    client: str | None = None  # who sent it (fair share between clients); None: anonymous
    images: tuple[PromptImage, ...] = ()  # the prompt's images, in order (a vision model)


@dataclass(frozen=True)
class Cancel:
    """End a request: the client went away (cancelled), or its actor found a stop string
    (stop: the few tokens computed past it are never shown)."""

    request_id: str
    reason: FinishReason = FinishReason.CANCELLED


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
    finish: FinishReason | None = None  # the request ended (by the core: stop, length, ...)
    stop_token: bool = False  # the last token is a stop token: count it, do not print it
    message: str | None = None  # what went wrong, for an error or cancel
