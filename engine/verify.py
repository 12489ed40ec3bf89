"""A drafting row's step on the executor (actors/scheduler/drafter.py): its last token and its
drafts through the model against its own KV cache, the drafts the target model agrees with
kept, the rest trimmed from the cache."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from stepline.actors.scheduler.drafter import accept
from stepline.actors.scheduler.work import SAMPLING_FAILED, VERIFY_FAILED, is_collective_error
from stepline.engine.sampling import Sampler
from stepline.engine.sequences import Seq
from stepline.engine.step_sampling import Fail


@dataclass(eq=False)
class Verify:
    """One drafting row of a step: `seq`'s last token and `drafts`, and (once its forward
    ran) their logits, one row a position."""

    seq: Seq
    drafts: tuple[int, ...]
    logits: mx.array | None = None  # (1 + len(drafts), V)

    @property
    def num_tokens(self) -> int:
        return 1 + len(self.drafts)

    def inputs(self) -> mx.array:
        return mx.array([self.seq.last_token, *self.drafts], dtype=mx.int32)

    def accept(self, targets: list[int]) -> list[int]:
        """The row's new tokens from the target model's token at each position (`targets`),
        at most what its `max_tokens` leaves: into its output, and its cache cut back to
        hold every token but the newest (as every decoding row's does)."""
        seq = self.seq
        kept = accept(self.drafts, targets)
        del kept[max(1, seq.params.max_tokens - seq.num_generated) :]
        rejected = self.num_tokens - len(kept)
        if rejected:
            for layer in seq.cache or ():
                layer.trim(rejected)
        seq.output.extend(kept)
        return kept


def verify_rows(
    model: Any,
    sampler: Sampler,
    solo: list[Verify],
    apart: list[Verify],
    tokens: dict[str, int],
    failed: Mapping[str, str],
    fail: Fail,
) -> dict[str, tuple[int, ...]]:
    """A step's drafting rows (`solo`): the forwards of those not in the step's fused one
    (`apart`, each on its own; a fault there is that request's, `fail`), then each place's
    pick by its row's own sampling, at the output index it would have been sampled at
    without drafts (a seeded row's noise is keyed by it), and every row's kept drafts and
    the pick after them (`Verify.accept`). Each row's last token goes in `tokens`; returns
    the drafts each kept. Rows of requests in `failed` are skipped."""
    for v in apart:
        try:
            v.logits = model(v.inputs()[None], cache=v.seq.cache)[0]
        except Exception as exc:
            fail(v.seq.request_id, VERIFY_FAILED, exc)
    ready = [v for v in solo if v.logits is not None and v.seq.request_id not in failed]
    if not ready:
        return {}
    rows = [v.seq.sampling for v in ready for _ in range(v.num_tokens)]
    positions = [v.seq.num_generated + j for v in ready for j in range(v.num_tokens)]
    try:
        logits = mx.concatenate([v.logits for v in ready if v.logits is not None])
        targets = sampler.sample(logits, rows, positions).tokens
    except Exception as exc:
        if is_collective_error(exc):
            raise
        for v in ready:
            fail(v.seq.request_id, SAMPLING_FAILED, exc)
        return {}
    drafted: dict[str, tuple[int, ...]] = {}
    start = 0
    for v in ready:
        kept = v.accept(targets[start : start + v.num_tokens])
        start += v.num_tokens
        tokens[v.seq.request_id] = kept[-1]
        drafted[v.seq.request_id] = tuple(kept[:-1])
    return drafted


def check_speculation(model: object) -> int | None:
    """Raise ValueError, in words, if a drafting row's rejected tokens could not be taken
    back out of `model`'s caches: plain KV caches are cut back, and a sliding window's ring
    while it has not wrapped (a recurrent layer's state would need a snapshot from before
    the drafts). Returns the smallest such window (the most tokens a drafting request may
    hold, `ModelLimits.draft_window`), None where every layer is plain KV."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    caches = make_prompt_cache(model)
    kinds = sorted({type(c).__name__ for c in caches if type(c) not in (KVCache, RotatingKVCache)})
    if kinds:
        raise ValueError(
            "speculative decoding needs a model whose every layer keeps a KV cache; this "
            f"one has {', '.join(kinds)} layers (a recurrent state cannot be cut back past "
            "rejected drafts): serve it without --speculative-config"
        )
    windows = [c.max_size for c in caches if type(c) is RotatingKVCache]
    return min(windows) if windows else None
