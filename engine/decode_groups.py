"""The decode batch's KV caches, as groups of rows of similar length.

mlx-lm's batch cache (`BatchKVCache`) left-pads every row to the longest one, and every
decode step attends over the padding too. On SmolLM2, a 2,000-token prompt joining 4 chats
of 400 tokens made each decode step attend over 5 x 2,000 keys instead of 3,600 (0.22
against 0.11 s a step for the 4 chats alone), and its join copied every chat's cache out to
2,000 tokens (a 0.73 s step).

Where a step's rows run as one fused forward (`engine/fused.py`: the projections and MLPs
once over every row, attention per segment), the batch is kept in groups instead: each
group is a batch cache of its own, and a group is one more segment of the forward. A row
that joins goes to the group it pads least, or starts a group of its own where that would
add more than `SPLIT_KEYS` padded keys to every step (actors/scheduler/batch_geometry.py
`place_rows`). Without fusion the batch is one group, as mlx-lm keeps it.

The batch's row order is the groups' rows, group after group. The step-time model prices
the decode rows' attention by the same placement (`batch_geometry.padded_decode_context`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from stepline.actors.scheduler.batch_geometry import place_rows
from stepline.engine import fused, mrope
from stepline.engine.forward import output_head
from stepline.engine.kv_quant import BatchQuantizedKVCache, QuantizedKVCache
from stepline.engine.sequences import Cache, Seq


class DecodeCaches:
    """The decode batch's per-layer caches, one list per group (see the module docstring).
    `split`: whether rows may go in more than one group (the model runs fused forwards)."""

    def __init__(self, split: bool):
        self.split = split
        self.groups: list[Cache] = []  # each group's per-layer batch caches
        self.sizes: list[int] = []  # each group's rows

    def join(self, batch: Sequence[Seq], joining: Sequence[Seq]) -> list[Seq]:
        """Merge the prefilled caches of `joining` into the groups (each `Seq.cache` is taken);
        the batch's new row order (`batch`: its rows now, in order)."""
        if self.split:
            shapes = [  # a sliding window's layers hold fewer keys: the longest layer's
                (rows, max(layer.size() for layer in group))
                for rows, group in zip(self.sizes, self.groups, strict=True)
            ]
            lengths = [max(layer.size() for layer in s.cache or []) for s in joining]
            _, where = place_rows(shapes, lengths, split=True)
        else:
            where = [0] * len(joining)
        order, start = [], 0
        for i in range(max([len(self.groups) - 1, *where]) + 1):
            seqs = [s for s, g in zip(joining, where, strict=True) if g == i]
            kept = self.sizes[i] if i < len(self.sizes) else 0
            order += [*batch[start : start + kept], *seqs]
            start += kept
            if not seqs:
                continue
            if i < len(self.groups):
                for mine, theirs in zip(self.groups[i], _merged(seqs), strict=True):
                    mine.extend(theirs)
                self.sizes[i] += len(seqs)
            else:
                own = _own_batch(seqs[0]) if len(seqs) == 1 else None
                self.groups.append(own or _merged(seqs))
                self.sizes.append(len(seqs))
            for s in seqs:
                s.cache = None
        return order

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only the batch rows `keep` (ascending row indices); empty groups go."""
        groups, sizes, start, k = [], [], 0, 0
        for group, size in zip(self.groups, self.sizes, strict=True):
            mine = []
            while k < len(keep) and keep[k] < start + size:
                mine.append(keep[k] - start)
                k += 1
            if len(mine) == size:
                groups.append(group)
            elif mine:
                for layer in group:
                    layer.filter(mine)
                groups.append(group)
            start += size
            if mine:
                sizes.append(len(mine))
        self.groups, self.sizes = groups, sizes

    def extract(self, row: int) -> Cache:
        """Batch row `row`'s cache, a request's own (mlx-lm's `extract`)."""
        for group, size in zip(self.groups, self.sizes, strict=True):
            if row < size:
                return [layer.extract(row) for layer in group]
            row -= size
        raise IndexError(row)

    def can_fuse(self) -> bool:
        return all(fused.can_fuse(group, is_batch=True) for group in self.groups)

    def segments(self, inputs: mx.array) -> list[fused.Segment]:
        """Each group's rows as one segment of a fused forward (`inputs` (B,): every row's)."""
        out, start = [], 0
        for group, size in zip(self.groups, self.sizes, strict=True):
            out.append(fused.Segment(inputs[start : start + size], group, is_batch=True))
            start += size
        return out

    def forward(self, model: Any, inputs: mx.array) -> mx.array:
        """The batch's forward on `inputs` (B,), one token per row: (B, V) logits."""
        if len(self.groups) == 1:
            return model(inputs.astype(mx.int32)[:, None], cache=self.groups[0])[:, -1, :]
        return output_head(model, fused.body(model, self.segments(inputs)))[:, -1, :]


def _merged(seqs: Sequence[Seq]) -> Cache:
    """The prefilled caches of `seqs` as one batch cache per layer (mlx-lm's `merge`), each
    row's rope at its request's positions (`mrope.shift_rows`)."""
    layers = zip(*(s.cache or [] for s in seqs), strict=True)
    merged = [type(mine[0]).merge(list(mine)) for mine in layers]
    return mrope.shift_rows(merged, [s.rope_delta for s in seqs])


def _own_batch(seq: Seq) -> Cache | None:
    """A request's own KV cache, plain or quantized, as a batch of one row, sharing its
    arrays (mlx-lm's `merge` copies them: 0.2 s for 2,000 tokens of SmolLM2, twice, as the
    copy has no room for the next token); None for other cache kinds."""
    cache = seq.cache
    if not cache or any(type(layer) not in (KVCache, QuantizedKVCache) for layer in cache):
        return None
    out: Cache = []
    for layer in cache:
        if type(layer) is QuantizedKVCache:
            out.append(BatchQuantizedKVCache.of_one(layer))
            continue
        batch = BatchKVCache([0])
        n = layer.offset
        batch.state = (layer.keys, layer.values, mx.array([n]), mx.array([0]), n)
        out.append(batch)
    return mrope.shift_rows(out, [seq.rope_delta])
