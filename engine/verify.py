"""A drafting row's step on the executor (engine/speculative.py): its last token and its
drafts through the model against its own KV cache, the drafts the target model agrees with
kept, the rest trimmed from the cache."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from stepline.engine.sequences import Seq
from stepline.engine.speculative import accept


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


def check_speculation(model: object) -> None:
    """Raise ValueError, in words, if a drafting row's rejected tokens could not be taken
    back out of `model`'s caches: only plain KV caches are cut back (a sliding window's
    ring and a recurrent layer's state would need a snapshot from before the drafts)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache})
    if kinds:
        raise ValueError(
            "speculative decoding needs a model whose every layer keeps a plain KV cache; this "
            f"one has {', '.join(kinds)} layers (a sliding window or a recurrent state cannot "
            "be cut back past rejected drafts): serve it without --speculative-config"
        )
