"""A drafting row's step on the executor (actors/scheduler/drafter.py): its last token and its
drafts through the model against its own cache, the drafts the target model agrees with
kept, the rest taken back out of the cache (engine/rollback.py): trimmed from KV layers, and
where a layer cannot be cut back (a recurrent state, a sliding window's ring the drafts
wrapped), every layer put back as it was before the verify and the kept tokens run through
the model again. That extra forward is paid only in a step that rejected a draft.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from stepline.actors.scheduler.drafter import accept
from stepline.actors.scheduler.work import SAMPLING_FAILED, VERIFY_FAILED, is_collective_error
from stepline.engine.forward import body_of
from stepline.engine.lora import Routes
from stepline.engine.rollback import Held, can_take_back
from stepline.engine.sampling import Sampler
from stepline.engine.sequences import Seq
from stepline.engine.step_sampling import Fail


@dataclass(eq=False)
class Verify:
    """One drafting row of a step: `seq`'s last token and `drafts`, and (once its forward
    ran) their logits, one row a position. Made before its forward: its cache is held then
    (`held`), so that the drafts it rejects can be taken back."""

    seq: Seq
    drafts: tuple[int, ...]
    logits: mx.array | None = None  # (1 + len(drafts), V)
    held: Held | None = field(default=None, init=False)
    # the tokens to run through the model again after `accept` (its cache put back)
    again: mx.array | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.drafts and self.seq.cache is not None:
            self.held = Held(self.seq.cache, self.num_tokens)

    @property
    def num_tokens(self) -> int:
        return 1 + len(self.drafts)

    def inputs(self) -> mx.array:
        return mx.array([self.seq.last_token, *self.drafts], dtype=mx.int32)

    def accept(self, targets: list[int]) -> list[int]:
        """The row's new tokens from the target model's token at each position (`targets`),
        at most what its `max_tokens` leaves: into its output, and its cache cut back to
        hold every token but the newest (as every decoding row's does), or put back as it
        was before the verify with `again` the tokens to run through it (`verify_rows`)."""
        seq = self.seq
        kept = accept(self.drafts, targets)
        del kept[max(1, seq.params.max_tokens - seq.num_generated) :]
        rejected = self.num_tokens - len(kept)
        if rejected and self.held is not None and self.held.take_back(rejected):
            self.again = self.inputs()[: len(kept)]
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
    routes: Routes | None = None,
) -> dict[str, tuple[int, ...]]:
    """A step's drafting rows (`solo`): the forwards of those not in the step's fused one
    (`apart`, each on its own; a fault there is that request's, `fail`), then each place's
    pick by its row's own sampling, at the output index it would have been sampled at
    without drafts (a seeded row's noise is keyed by it), and every row's kept drafts and
    the pick after them (`Verify.accept`). Each row's last token goes in `tokens`; returns
    the drafts each kept. Rows of requests in `failed` are skipped."""
    routes = routes or Routes()
    for v in apart:
        try:
            with routes.rows([v.seq.adapter]):
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
    for rid in _run_again(model, [v for v in ready if v.again is not None], fail, routes):
        del tokens[rid], drafted[rid]
    return drafted


def _run_again(model: Any, rows: list[Verify], fail: Fail, routes: Routes) -> list[str]:
    """Each row's kept tokens (`Verify.again`) through the model's body into its cache, put
    back as it was before the verify; evaluated, so that the step's time holds them. A
    fault is that row's request's (`fail`): returns the requests that failed."""
    body = body_of(model) or model
    failed, done = [], []
    for v in rows:
        try:
            with routes.rows([v.seq.adapter]):
                body(v.again[None], cache=v.seq.cache)
            done.append(v)
        except Exception as exc:
            fail(v.seq.request_id, VERIFY_FAILED, exc)
            failed.append(v.seq.request_id)
        v.again = None
    try:
        mx.eval([[c.state for c in v.seq.cache or ()] for v in done])
    except Exception as exc:
        if is_collective_error(exc):
            raise
        for v in done:
            fail(v.seq.request_id, VERIFY_FAILED, exc)
            failed.append(v.seq.request_id)
    return failed


def check_speculation(model: object) -> None:
    """Raise ValueError, in words, if a drafting row's rejected tokens could not be taken
    back out of `model`'s caches (engine/rollback.py: KV layers, sliding windows' rings and
    recurrent state can; another kind of cache, such as a chunked or a composite one, not)."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    kinds = sorted({type(c).__name__ for c in caches if not can_take_back(c)})
    if kinds:
        raise ValueError(
            f"speculative decoding cannot take rejected drafts back out of this model's "
            f"{', '.join(kinds)} layers: serve it without --speculative-config"
        )
