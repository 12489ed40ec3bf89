"""What the step loop sends the executor and gets back. Plain data, MLX-free."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from stepline.actors.scheduler.plan import StepPlan
from stepline.actors.scheduler.prefix_index import EntryInfo, Tokens
from stepline.actors.scheduler.spans import PromptImage
from stepline.events.models import RequestParams


@dataclass(frozen=True)
class NewRequest:
    """A request the executor has not seen: it gets its own prefill cache."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    # as the core recorded it: max_tokens is its limit, within the context; logprobs among them
    params: RequestParams
    prefix: Tokens | None = None  # the prefix-cache entry it starts from, if any
    num_cached_tokens: int = 0  # of that entry, the tokens it uses (<= len(prefix))
    images: tuple[PromptImage, ...] = ()  # the prompt's images (spans and encoder inputs)
    # the checkpoint the engine added for the prefix cache (`ModelLimits.exact_prefixes`),
    # not the client's: snapshotted into the cache, not handed to the checkpoint hook
    own_checkpoint: int | None = None
    adapter: str | None = None  # the LoRA adapter it runs with (`Admitted.adapter`)


@dataclass(frozen=True)
class Housekeeping:
    """What the executor does before a step's work (or alone, when there is none)."""

    free: tuple[str, ...] = ()  # requests to drop (finished, cancelled)
    # of those, the ones that finished normally: their caches go to the prefix cache
    retire: frozenset[str] = frozenset()
    drop_entries: tuple[Tokens, ...] = ()  # prefix-cache entries the index let go
    promote: tuple[Tokens, ...] = ()  # disk entries to load into memory


@dataclass(frozen=True)
class StepWork(Housekeeping):
    plan: StepPlan = field(default_factory=lambda: StepPlan(step=0))
    admit: tuple[NewRequest, ...] = ()  # requests first scheduled in this step


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), most likely first


@dataclass(frozen=True)
class StepResult:
    # request_id -> the token sampled for it this step (decodes and final chunks)
    tokens: Mapping[str, int] = field(default_factory=dict)
    # request_id -> the drafted tokens it kept this step, before `tokens[request_id]`
    drafted: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # request_id -> its token's logprobs, where asked for
    logprobs: Mapping[str, TokenLogprob] = field(default_factory=dict)
    # request_id -> checkpoint offsets snapshotted this step, in order
    checkpoints: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the MLX work
    prefix: PrefixReport | None = None  # what the prefix store did in this step
    # request_id -> what failed (one of the *_FAILED messages): the executor dropped the
    # request's state (a failed grammar's row stays in the batch until the core frees it);
    # the step's other work stands. The exception went to the log.
    failed: Mapping[str, str] = field(default_factory=dict)
    memory: MemoryCounters | None = None  # MLX's allocator after this step
    # request_id -> its vector, for each embedding request whose final chunk ran this step
    embeddings: Mapping[str, tuple[float, ...]] = field(default_factory=dict)


# What a request fault says (stable, for the terminal event; the detail goes to the log).
ADMISSION_FAILED = "the executor could not set up this request"
PREFILL_FAILED = "the forward pass of this request's prompt failed"
ENCODE_FAILED = "the vision encoder failed on this request's image"
CHECKPOINT_FAILED = "this request's checkpoint (snapshot or on_checkpoint hook) failed"
SAMPLING_FAILED = "sampling this request's next token failed"
VERIFY_FAILED = "the forward pass of this request's drafted tokens failed"
# followed by ": " and llguidance's reason (a limit the schema hit, in `grammar.LIMITS`)
GRAMMAR_FAILED = "the grammar of this request's structured output failed mid-generation"


@dataclass(frozen=True)
class MemoryCounters:
    """MLX's own allocator counters, in bytes (read on the executor thread)."""

    active: int  # held by live arrays
    cache: int  # freed buffers MLX keeps for reuse
    peak: int  # most active memory since the engine started (or the last reset)


@dataclass(frozen=True)
class PrefixReport:
    """The prefix store's changes, for the step loop's index, and its disk tier's counters."""

    new: tuple[EntryInfo, ...] = ()  # entries now held in memory
    disk_added: tuple[EntryInfo, ...] = ()
    disk_removed: tuple[Tokens, ...] = ()
    disk_nbytes: int = 0
    disk_entries: int = 0
    disk_evictions: int = 0


def is_collective_error(exc: BaseException) -> bool:
    """MLX's distributed backends say so when a peer is lost ("[ring] connection to a peer
    was lost"); such an error is the group's, not a request's."""
    return isinstance(exc, RuntimeError) and str(exc).startswith(
        ("[ring]", "[jaccl]", "[mpi]", "[nccl]")
    )
