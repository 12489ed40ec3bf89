"""Event models: one frozen pydantic model per kind, one discriminated union.

Every event carries a monotonically increasing sequence number (`seq`, contiguous
from 1 within one log), a wall-clock timestamp, the engine step it belongs to and
the request id (the `step` record belongs to no request).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

SCHEMA_VERSION = 1


class FinishReason(StrEnum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # the client went away or cancelled
    ERROR = "error"  # the engine failed while serving it
    REJECTED = "rejected"  # never admitted: it cannot be served (too long, engine dead)


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: int  # position in the log, contiguous from 1
    ts: float  # time.time() when the step loop recorded it
    step: int  # engine step; 0 = before the first step


class RequestParams(BaseModel):
    """What re-execution needs to run a request again: its sampling parameters."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


class Admitted(_Event):
    """The engine accepted the request into its waiting queue."""

    type: Literal["admitted"] = "admitted"
    request_id: str
    num_prompt_tokens: int
    # The prompt's token ids, or None when the engine runs with log_prompts=False.
    prompt_token_ids: tuple[int, ...] | None
    prompt_sha256: str  # hash of the token ids, always present
    checkpoints: tuple[int, ...] = ()  # prompt offsets where the cache is snapshotted
    # Logs before the prefix lookup moved to scheduling time recorded cache hits here;
    # now the first `chunk-prefilled` event does, and these stay 0 / None.
    num_cached_tokens: int = 0
    cache_source: str | None = None
    params: RequestParams


class StepEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str
    num_tokens: int  # tokens scheduled for this request in this step
    kind: Literal["prefill", "decode"]


class StepPlanned(_Event):
    """A step's plan: its members and their tokens, and the limits it ran under."""

    type: Literal["step"] = "step"
    request_id: None = None
    entries: tuple[StepEntry, ...]
    max_step_tokens: int
    max_num_seqs: int


class ChunkPrefilled(_Event):
    """Prompt tokens [start, end) of the request were computed into its cache.

    A request's first chunk says how many prompt tokens it started with from the prefix
    cache (then `start` equals that number) and where they came from.
    """

    type: Literal["chunk-prefilled"] = "chunk-prefilled"
    request_id: str
    start: int
    end: int
    num_cached_tokens: int = 0
    cache_source: str | None = None  # "memory" or "disk" when num_cached_tokens > 0


class CheckpointReached(_Event):
    """The request's cache was snapshotted at exactly `offset` prompt tokens."""

    type: Literal["checkpoint-reached"] = "checkpoint-reached"
    request_id: str
    offset: int


class Decoding(_Event):
    """Tokens sampled for the request in this step (the first comes with its last chunk)."""

    type: Literal["decoding"] = "decoding"
    request_id: str
    token_ids: tuple[int, ...]


class Terminal(_Event):
    """The request ended. Exactly one per request; nothing of it follows."""

    type: Literal["terminal"] = "terminal"
    request_id: str
    reason: FinishReason
    message: str | None = None  # for error / rejected: what went wrong


Event = Annotated[
    Admitted | StepPlanned | ChunkPrefilled | CheckpointReached | Decoding | Terminal,
    Field(discriminator="type"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


class LogHeader(BaseModel):
    """First line of every log file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["header"] = "header"
    schema_version: int = SCHEMA_VERSION
    created: float
    model: str | None = None
    config: dict = Field(default_factory=dict)  # the engine config the run used
    log_prompts: bool = True
