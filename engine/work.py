"""What the step loop sends the executor and gets back. Plain data, MLX-free."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from stepline.engine.policy import StepPlan
from stepline.events.models import RequestParams


@dataclass(frozen=True)
class NewRequest:
    """A request the executor has not seen: it gets its own prefill cache."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: RequestParams
    logprobs: int | None = None  # None: no logprobs; k: chosen token's + top k


@dataclass(frozen=True)
class StepWork:
    plan: StepPlan
    admit: tuple[NewRequest, ...] = ()  # requests first scheduled in this step
    free: tuple[str, ...] = ()  # requests to drop before the step runs (finished, cancelled)
    # of those, the ones that finished normally: their caches go to the prefix cache
    retire: frozenset[str] = frozenset()


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), most likely first


@dataclass(frozen=True)
class StepResult:
    # request_id -> the token sampled for it this step (decodes and final chunks)
    tokens: Mapping[str, int] = field(default_factory=dict)
    # request_id -> its token's logprobs, where asked for
    logprobs: Mapping[str, TokenLogprob] = field(default_factory=dict)
    # request_id -> checkpoint offsets snapshotted this step, in order
    checkpoints: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the MLX work
    prefix_cache: PrefixCacheCounters | None = None  # after this step


@dataclass(frozen=True)
class PrefixCacheCounters:
    nbytes: int
    entries: int
    evictions: int  # since the engine started
    disk_nbytes: int = 0  # disk tier: file bytes held
    disk_entries: int = 0
    disk_evictions: int = 0  # files removed to stay under the cap, since the engine started


@dataclass(frozen=True)
class PrefixLookup:
    num_tokens: int  # prompt tokens already in the cache the request starts from
    source: str | None  # where they came from ("memory" or "disk"), None on a miss
