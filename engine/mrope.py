"""3-D M-RoPE (Qwen2.5-VL's) in the batched engine: each request's positions are its
own, and ride the same forwards as every other request's.

An M-RoPE model rotates a token's query and key by three positions, one per section of the
head's frequencies: time, height and width. Text tokens have all three equal; an image's
tokens take the image grid's (t, h, w) from where the text before them stood, and the text
after an image goes on from the largest of them plus one, so a token's position is no longer
its index in the prompt. mlx-vlm computes a prompt's positions with `get_rope_index` (a pure
function of the prompt's ids and its images' grids) and, past the prompt, the position of
token i is i + `rope_delta`, the request's delta (the prompt's last position + 1 minus its
length: negative after an image, 0 for text).

Here the text model's rope modules are mlx-vlm's own rotary embedding (`MRope`), called with
whatever `cache.offset` says, which the engine sets per forward:
- a prompt chunk reads its slice of the request's 3-D positions (`positioned`: each layer's
  cache seen through a `PositionedCache`, whose offset is a `Positions`);
- a decode row of the batch reads its row of the batch cache's offset, which mlx-lm keeps
  for rope only (its masks and storage count `_idx` and the left padding): a row joining the
  batch has its delta added there (`shift_rows`), and loses it when it leaves (mlx-lm's
  `extract` makes a plain cache of its keys), so every join adds it again;
- a fused forward's prompt chunks take their positions from the request's
  (`engine/fused.py`'s `Segment.positions`): a text chunk's one section, a chunk with media
  tokens all three, every row of that step then read as a `RowPositions`.
A request with images never drafts (the scheduler core's rule), so no drafting row needs a
delta.

Positions are a function of the prompt, so a prefix-cache entry needs no position state of
its own: the keys it holds were rotated at the positions of its tokens, which are the same in
every prompt that shares them (the prefix index keys an image's span by its digest, and the
grid is the image's), and a request that starts from one computes its own positions, delta
included, from its whole prompt (`prompt_positions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class Positions:
    """A chunk's 3-D positions (3, L), given to the rope as `cache.offset`."""

    __slots__ = ("array",)

    def __init__(self, array: mx.array) -> None:
        self.array = array


class RowPositions:
    """A fused step's 3-D positions (3, N), one token a row (`engine/fused.py`: a media
    chunk's rows beside other segments'), given to the rope as `cache.offset`."""

    __slots__ = ("array",)

    def __init__(self, array: mx.array) -> None:
        self.array = array


class MRope(nn.Module):
    """An mlx-lm attention's rope, done as mlx-vlm's M-RoPE: `offset` is an int (the first
    token's position, all three sections equal), an array (B,) (each row's first), or
    `Positions` (the chunk's 3-D positions, one sequence), or `RowPositions` (a fused
    step's, a row a token)."""

    def __init__(self, rotary: Any) -> None:
        super().__init__()
        self._rotary = rotary  # mlx-vlm's rotary embedding of the layer (no parameters)

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        batch, _, length, _ = x.shape
        if isinstance(offset, Positions):
            ids = offset.array[:, None, :]  # (3, 1, L)
        elif isinstance(offset, RowPositions):
            ids = offset.array[:, :, None]  # (3, N, 1): N rows of one token
        else:
            start = mx.array(offset, dtype=mx.int32).reshape(-1, 1)  # (1 or B, 1)
            rows = start + mx.arange(length, dtype=mx.int32)[None]
            ids = mx.broadcast_to(rows[None], (3, batch, length))
        rotated, _ = self._rotary.apply_rotary(x, x[:, :1], ids, unsqueeze_dim=1)
        return rotated


class Deepstack(nn.Module):
    """A text layer that adds, after itself, what the chunk's cache carries for it at image
    tokens (Qwen3-VL's deepstack: features of the vision tower's middle blocks, added to the
    hidden states of the first text layers, as mlx-vlm's text model adds them)."""

    def __init__(self, layer: Any, index: int) -> None:
        super().__init__()
        self.layer = layer
        self.index = index

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h = self.layer(x, mask, cache)
        extra = getattr(cache, "deepstack", None)  # a `PositionedCache`'s, of an image chunk
        return h if extra is None else h + extra[self.index].astype(h.dtype)


def install(text_model: Any, vlm: Any) -> None:
    """Give each attention layer of `text_model` (an mlx-lm model, its weights loaded) the
    rotary embedding of the same layer of `vlm`'s language model (mlx-vlm's), as an `MRope`;
    where the vision tower feeds the first text layers (Qwen3-VL), wrap them in `Deepstack`."""
    body = text_model.model if hasattr(text_model, "model") else text_model
    theirs = vlm.language_model.model.layers
    for layer, source in zip(body.layers, theirs, strict=True):
        layer.self_attn.rope = MRope(source.self_attn.rotary_emb)
    stacked = getattr(vlm.vision_tower, "deepstack_visual_indexes", None) or ()
    for i in range(len(stacked)):
        body.layers[i] = Deepstack(body.layers[i], i)


def prompt_positions(
    vlm: Any, prompt: Sequence[int], grids: Sequence[np.ndarray]
) -> tuple[mx.array, int]:
    """A prompt's 3-D positions (3, L) and its rope delta, as mlx-vlm's `get_rope_index`
    makes them from its ids and its images' grids (`image_grid_thw`, in prompt order)."""
    ids = mx.array([list(prompt)], dtype=mx.int32)
    grid = None
    if grids:
        grid = mx.array(np.concatenate([np.asarray(g).reshape(-1, 3) for g in grids]))
    positions, delta = vlm.language_model.get_rope_index(ids, grid)
    return positions[:, 0, :].astype(mx.int32), int(np.asarray(delta).reshape(-1)[0])


class PositionedCache:
    """One layer's cache of a request, as a forward sees it: its own in every way but
    `offset`, which the rope reads (a chunk's `Positions`)."""

    def __init__(self, cache: Any, offset: Any, deepstack: mx.array | None = None) -> None:
        self._cache = cache
        self._offset = offset
        self.deepstack = deepstack  # (k, 1, L, D): what the first k layers add (`Deepstack`)

    @property
    def offset(self) -> Any:
        return self._offset

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def positioned(
    cache: list[Any], positions: mx.array, deepstack: mx.array | None = None
) -> list[Any]:
    """`cache` (a request's, per layer) for a forward of the tokens at `positions` (3, L),
    with what the first layers add at its image tokens (`Deepstack`), if any."""
    offset = Positions(positions)
    return [PositionedCache(layer, offset, deepstack) for layer in cache]


def shift_rows(batch: list[Any], deltas: Sequence[int]) -> list[Any]:
    """The per-layer batch caches `batch` (mlx-lm's `BatchKVCache`, just made of requests'
    own caches, a row each) with each row's delta added to the offset its rope reads."""
    if any(deltas):
        shift = mx.array(list(deltas), dtype=mx.int32)
        for layer in batch:
            layer.offset = layer.offset + shift
    return batch
