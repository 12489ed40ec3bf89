"""Taking tokens back out of a request's cache, on every cache kind mlx-lm models use: what
a drafting row's rejected drafts need (engine/verify.py, engine/draft_model.py).

A KV layer is cut back by `trim`: its keys stay, its offset moves back. So is a sliding
window's ring (`RotatingKVCache`) while the forward's tokens do not wrap it. A recurrent
layer (`ArraysCache`: Gated DeltaNet, Mamba2, short convolutions) folds every token into
one state that cannot be cut back, and a wrapped ring has written over its oldest keys:
those layers are held (`Held`) before the forward — their arrays by reference, each a
handle of its own, so an update written in place into the ring copies it rather than
overwrite what is held — and put back as they were, the other layers trimmed to where
they were, and the caller runs the tokens it keeps through the model again.

A forward that failed part-way (`FusedForwards._forward`: a fused step that could not be
built) is undone the same way, whatever it wrote: `Held.put_back` puts every layer back as
it was, the decode batch's too (its KV layers cut back by `trim`, its windows' rings and
recurrent rows restored).
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, RotatingKVCache
from mlx_lm.models.cache import QuantizedKVCache as MlxQuantizedKVCache

from stepline.engine.kv_quant import BatchQuantizedKVCache, QuantizedKVCache

# Layers `trim` cuts back after any number of tokens (mlx-lm's and stepline's quantized one,
# a request's own or the decode batch's).
_TRIMMED = (KVCache, QuantizedKVCache, MlxQuantizedKVCache, BatchKVCache, BatchQuantizedKVCache)
# The batch's: `offset` is each row's position, `_idx` the slots in use (what `trim` cuts).
_BATCHED = (BatchKVCache, BatchQuantizedKVCache)


def can_take_back(layer: Any) -> bool:
    """Whether `Held` takes tokens back out of `layer`'s kind of cache."""
    return (
        type(layer) in _TRIMMED or type(layer) is RotatingKVCache or isinstance(layer, ArraysCache)
    )


def _trims(layer: Any, num_tokens: int) -> bool:
    """Whether `layer` can drop any of the next `num_tokens` it takes by `trim`."""
    if type(layer) in _TRIMMED:
        return True
    return type(layer) is RotatingKVCache and layer.offset + num_tokens <= layer.max_size


def _size(layer: Any) -> int:
    """How many tokens `trim` would cut back to take `layer` back to where it is now."""
    return layer._idx if type(layer) in _BATCHED else layer.offset


def _own(a: Any) -> Any:
    """A handle of its own on array `a` (the same values, no copy), or `a` if not an array."""
    return a[...] if hasattr(a, "shape") and a.ndim > 0 else a


class Held:
    """`cache` (a request's layers) as it was before a forward of at most `num_tokens`
    tokens: each layer's offset, and the state of each layer that `trim` could not cut back
    over them (see the module docstring). Cheap: no array is copied."""

    __slots__ = ("cache", "_offsets", "_states")

    def __init__(self, cache: list[Any], num_tokens: int):
        self.cache = cache
        self._offsets: dict[int, int] = {}
        self._states: dict[int, tuple] = {}
        for i, layer in enumerate(cache):
            if _trims(layer, num_tokens):
                self._offsets[i] = _size(layer)
            elif isinstance(layer, ArraysCache):  # (`advance` moves its lengths in place)
                self._states[i] = (
                    [_own(a) for a in layer.cache],
                    _own(layer.left_padding),
                    _own(layer.lengths),
                )
            else:  # a ring the forward may wrap
                self._states[i] = tuple(_own(a) for a in layer.state)

    @property
    def trims(self) -> bool:
        """Whether every layer is cut back by `trim` (no forward again)."""
        return not self._states

    def take_back(self, num_tokens: int) -> bool:
        """The last `num_tokens` of what the cache took since it was held, out of it: each
        layer trimmed (False); or, where a layer cannot be, every layer as it was when held
        (True: the tokens taken since and kept are for the caller to run again)."""
        if self.trims:
            for layer in self.cache:
                layer.trim(num_tokens)
            return False
        self.put_back()
        return True

    def put_back(self) -> None:
        """Every layer as it was when held, whatever a forward since wrote into it (all of
        its tokens or some, some layers or all)."""
        for i, layer in enumerate(self.cache):
            if i in self._offsets:
                layer.trim(_size(layer) - self._offsets[i])
            elif isinstance(layer, ArraysCache):
                arrays, layer.left_padding, layer.lengths = self._states[i]
                layer.cache = list(arrays)
            else:
                layer.state = self._states[i]
