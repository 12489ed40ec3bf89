"""Admission: whether a request can ever be served, and whether the waiting queue has room
for it now; each refusal an `AdmissionError` that says what to do, with a `Refusal` kind
where the caller answers it other than as a bad request (the HTTP server maps the kind to
its status: api/pipeline/errors.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.events.fold import RequestState, Status


class Refusal(StrEnum):
    """Why a request the engine could serve at another time was refused now: its lone
    `terminal`'s `code` (the API layer says how it is answered: `REFUSAL_STATUS`)."""

    QUEUE_FULL = "queue_full"  # the waiting queue, or the client's share of it, is full


class AdmissionError(ValueError):
    """A request that can never be served under this configuration."""


def max_output_tokens(
    requested: int | None,
    num_prompt_tokens: int,
    max_context: int,
    config: SchedulerConfig | None = None,
) -> int:
    """The most tokens a request of `num_prompt_tokens` may generate: `requested` (None: as
    many as there is room for), no more than the model's context leaves after the prompt,
    and, given `config`, no more than its KV budget leaves (`max_kv_tokens` less the prompt
    and `kv_tokens_per_seq`; at least 1, so that a prompt that alone overflows the budget is
    refused by `check_admissible`, which says why). 0 or less only for a prompt that fills
    the context (`check_admissible` refuses it).

    The scheduler core records a request's `max_tokens` as this (without `config`) when it
    admits it: the core, the runner and the request actor read that one value."""
    room = max_context - num_prompt_tokens
    if config is not None and config.max_kv_tokens is not None:
        fits = config.max_kv_tokens - num_prompt_tokens - config.kv_tokens_per_seq
        room = min(room, max(fits, 1))
    return room if requested is None else min(requested, room)


def check_admissible(
    num_prompt_tokens: int,
    max_tokens: int,
    max_context: int,
    config: SchedulerConfig,
    *,
    embedding: bool = False,
) -> None:
    """Raise AdmissionError (subclass by cause) if the request (`embedding`: an embedding
    request's input) can never run. `max_tokens` is its limit within the context
    (`max_output_tokens`): its KV is counted up to there."""
    if num_prompt_tokens < 1:
        raise EmptyPromptError("the prompt is empty: send at least one token")
    if num_prompt_tokens >= max_context:
        raise ContextLengthExceededError(num_prompt_tokens, max_context, embedding=embedding)
    needed = num_prompt_tokens + max_tokens + config.kv_tokens_per_seq
    if config.max_kv_tokens is not None and needed > config.max_kv_tokens:
        raise KVBudgetExceededError(needed, num_prompt_tokens, max_tokens, config)


def check_queue(
    states: Mapping[str, RequestState],
    config: SchedulerConfig,
    client: str | None = None,
    *,
    background: bool = False,
) -> None:
    """Raise QueueFullError if `max_waiting` requests already wait for their first chunk, or
    `max_waiting_per_client` of `client`'s do. The engine's own requests (background.py) do
    not count against a client's request; one of them (`background`) counts every request
    waiting, and waits behind at most half the queue (it is an extra)."""
    num_waiting = mine = 0
    for s in states.values():
        if s.status is Status.WAITING and (background or not s.is_background):
            num_waiting += 1
            mine += s.client == client
    limit = max(1, config.max_waiting // 2) if background else config.max_waiting
    if num_waiting >= limit:
        raise QueueFullError(num_waiting, limit)
    if mine >= config.max_waiting_per_client:
        raise QueueFullError(mine, config.max_waiting_per_client, per_client=True)


class KVBudgetExceededError(AdmissionError):
    """The request's KV can never fit in the engine's KV budget, even with nothing else running."""

    def __init__(
        self, needed: int, num_prompt_tokens: int, max_tokens: int, config: SchedulerConfig
    ):
        assert config.max_kv_tokens is not None
        self.num_kv_tokens = needed
        self.max_kv_tokens = config.max_kv_tokens

        def size(tokens: int) -> str:
            per = config.kv_bytes_per_token
            return f"{tokens} tokens, {tokens * per / 2**30:.3g} GB" if per else f"{tokens} tokens"

        fixed = (
            f" plus its cache's fixed cost ({config.kv_tokens_per_seq} tokens' worth: the room"
            " its KV buffer grows by, and any recurrent state)"
            if config.kv_tokens_per_seq
            else ""
        )
        super().__init__(
            f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}){fixed} needs "
            f"KV for {size(needed)}, more than the engine holds ({size(config.max_kv_tokens)}, "
            "max_kv_tokens / --max-kv-gb): shorten the prompt or lower max_tokens"
        )


class EmptyPromptError(AdmissionError):
    pass


class QueueFullError(AdmissionError):
    """The waiting queue is full, or the client's share of it (`per_client`: then the
    numbers are the client's): try again later (over HTTP, a 429 with Retry-After)."""

    refusal = Refusal.QUEUE_FULL

    def __init__(
        self,
        num_waiting: int,
        max_waiting: int,
        retry_after_s: float = 1.0,
        *,
        per_client: bool = False,
    ):
        self.num_waiting = num_waiting
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.per_client = per_client
        if per_client:
            message = (
                f"this client already has {num_waiting} requests waiting, the most one client "
                "may have (the rest of the engine's waiting queue is kept for other clients): "
                "retry later"
            )
        else:
            message = (
                f"the engine's waiting queue is full ({num_waiting} of {max_waiting} requests "
                "waiting): retry later"
            )
        super().__init__(message)


class ContextLengthExceededError(AdmissionError):
    """The prompt does not fit the model's context. An `embedding` request's input may have
    one token less than the context (`max_context - 1`), as a prompt may, though no token
    is generated: the message says so in an embedding's terms."""

    def __init__(self, num_prompt_tokens: int, max_context: int, *, embedding: bool = False):
        self.num_prompt_tokens = num_prompt_tokens
        self.max_context = max_context
        self.embedding = embedding
        if embedding:
            message = embedding_too_long(str(num_prompt_tokens), max_context)
        else:
            message = (
                f"the prompt has {num_prompt_tokens} tokens but the model's context is "
                f"{max_context} tokens (prompt must be at most {max_context - 1} so one token "
                "can be generated): shorten the prompt"
            )
        super().__init__(message)


def embedding_too_long(count: str, max_context: int) -> str:
    """What an embedding input of `count` tokens past the model's limit is told."""
    return (
        f"the input has {count} tokens, but this model embeds at most {max_context - 1}: "
        "shorten it, or split it"
    )


class EngineDeadError(AdmissionError):
    """The engine can serve no request: its executor failed."""
