"""What the scheduler is told and what it answers: its configuration (`SchedulerConfig`) and
a step's plan (`StepPlan`: decode rows, prefill chunks, encoder work, drafts, and who sat the
step out and why), plain frozen data that the policy (policy.py) builds and the executor
runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from stepline.actors.scheduler.cost_model import StepFeatures
from stepline.events.models import ChunkLimit, HeldReason

# A step every 100 ms is 10 tokens/s for every stream while a long prompt prefills: still
# faster than anyone reads, and long enough that a chunk's fixed cost (a forward call, the
# step's own overhead) stays small beside its work, so prompts are not slowed much.
DEFAULT_MAX_STEP_MS = 100.0


@dataclass(frozen=True)
class SchedulerConfig:
    max_step_tokens: int = 512  # the token budget of one step
    max_num_seqs: int = 32  # most requests running (prefilling or decoding) at once
    long_prefill_cap: int | None = None  # most prompt tokens one request gets per step
    max_kv_tokens: int | None = None  # KV capacity in tokens; None = unbounded
    # fixed KV cost of each running request (recurrent state, the room its KV buffer grows
    # by: engine.memory.KVFootprint.tokens_per_seq), in units of one token's KV
    kv_tokens_per_seq: int = 0
    kv_bytes_per_token: int = 0  # one token's KV in bytes, for messages (0 = not measured)
    max_waiting: int = 1024  # most requests waiting for their first chunk; beyond: QueueFullError
    # target time of a step with decode rows, given a cost model; None = tokens only
    max_step_ms: float | None = DEFAULT_MAX_STEP_MS
    # the executor runs a step's decode rows inside its chunks' forward (engine/fused.py)
    fused_steps: bool = False

    def __post_init__(self) -> None:
        if self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_seqs > self.max_step_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must not exceed max_step_tokens "
                f"({self.max_step_tokens}): every running request decodes one token every step"
            )
        if self.long_prefill_cap is not None and self.long_prefill_cap < 1:
            raise ValueError(f"long_prefill_cap must be >= 1, got {self.long_prefill_cap}")
        if self.max_kv_tokens is not None and self.max_kv_tokens < 1:
            raise ValueError(f"max_kv_tokens must be >= 1, got {self.max_kv_tokens}")
        if self.kv_tokens_per_seq < 0 or self.kv_bytes_per_token < 0:
            raise ValueError("kv_tokens_per_seq and kv_bytes_per_token must be >= 0")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            raise ValueError(f"max_step_ms must be > 0 (or None), got {self.max_step_ms}")

    @property
    def chunk_cap(self) -> int:
        return self.long_prefill_cap or self.max_step_tokens

    @property
    def max_waiting_per_client(self) -> int:
        """Most requests one client may have waiting: the last quarter of the queue is kept
        for the others (none is, in a queue of 3 or fewer)."""
        return self.max_waiting - self.max_waiting // 4


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    start: int  # first prompt position computed in this step
    end: int  # one past the last
    checkpoints: tuple[int, ...]  # checkpoint offsets in (start, end]: snapshot there
    is_final: bool  # end == prompt length: logits of the last position are sampled
    # what sized it (budget.py `StepBudget._chunk_size` says which); None: made by hand
    limit: ChunkLimit | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ScheduledEncode:
    """Vision-encoder work for one image of a request's prompt: units [start, end)."""

    request_id: str
    image: int  # which of the prompt's images (prompt order)
    start: int
    end: int
    cached: int = 0  # a request's first step: the prompt tokens its cache hit serves

    @property
    def num_units(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class StepPlan:
    step: int
    decodes: tuple[str, ...] = ()  # request ids, one token each
    chunks: tuple[ScheduledChunk, ...] = ()  # prefill work, in scheduling order
    encodes: tuple[ScheduledEncode, ...] = ()  # vision-encoder work (no tokens)
    # request_id -> tokens scheduled (the decode rows first, then the chunks); decodes count 1
    num_scheduled_tokens: Mapping[str, int] = field(default_factory=dict)
    features: StepFeatures = StepFeatures()  # what the step computes, as the cost model sees it
    predicted_seconds: float | None = None  # the cost model's prediction; None without one
    # (request_id, why) of the oldest requests that could have joined and did not: at most
    # MAX_HELD, oldest first (actors/scheduler/held.py)
    held: tuple[tuple[str, HeldReason], ...] = ()
    # request_id -> the drafted tokens its decode row carries (actors/scheduler/drafter.py), for
    # every decode row that drafts (() where none were found or fit this step): the executor
    # runs those with drafts, and those already drafting, against their own caches
    # (`Drafter.planned`); its scheduled tokens count them
    drafts: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # decode rows that leave the batch after this step, their caches kept (fair share:
    # actors/scheduler/seats.py), and parked requests that join it after this step
    parks: tuple[str, ...] = ()
    resumes: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.chunks and not self.encodes
