"""Quantized KV caches, a request's and the decode batch's (`--kv-bits`, `--kv-group-size`).

mlx-lm's `QuantizedKVCache` keeps a request's keys and values as `mx.quantize` makes them
(packed integers, a scale and a bias per group of `group_size` numbers of a head's vector),
and its attention (`base.scaled_dot_product_attention`, on any cache with `bits`) multiplies
by them quantized. It has no batch form and no `merge`, so mlx-lm's own server cannot batch
it. Here:

- `QuantizedKVCache`: mlx-lm's class with the two verbs the decode batch asks of a
  request's cache (`size`, `merge`); same name and state, so a prefix-cache file of one is
  what mlx-lm's `load_prompt_cache` reads.
- `BatchQuantizedKVCache`: the batch of them, as mlx-lm's `BatchKVCache` is of `KVCache`s
  (left padding, `filter`, `extend`, `extract`, `merge`), its arrays the quantized triples.
- `make_cache`: the model's prompt cache with every full-attention `KVCache` layer quantized;
  a recurrent layer (`ArraysCache`) keeps its state, and a sliding window
  (`RotatingKVCache`) stays unquantized (mlx-lm has no quantized ring).

Every token is quantized once, as it enters the cache, by its own groups: what a request
attends to is the same whether its prompt came in one chunk or many, alone or in a batch,
and the same as mlx-lm's `generate_step` over a `QuantizedKVCache` built from the first
token (`quantized_kv_start=0`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache

# What `mx.quantize` takes (MLX 0.32): groups of 32, 64 or 128 numbers. Bits: those the
# option offers (8: what mlx-lm's exactness is checked at; 4: a third of the memory).
GROUP_SIZES = (32, 64, 128)
BITS = (4, 8)


class KVQuantError(ValueError):
    """The model's KV cannot be quantized as asked (its heads' width and the group size)."""


@dataclass(frozen=True)
class KVQuant:
    """How the KV of a model's attention layers is held: `bits` per number, in groups of
    `group_size` numbers of a head's vector, each group with its own scale and bias."""

    bits: int
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise KVQuantError(f"kv_bits must be one of {BITS}, not {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise KVQuantError(
                f"kv_group_size must be one of {GROUP_SIZES} (what MLX quantizes), "
                f"not {self.group_size}"
            )

    def bytes_per_number(self, dtype: mx.Dtype) -> float:
        """One number's bytes, its share of its group's scale and bias included."""
        return self.bits / 8 + 2 * dtype.size / self.group_size


def kv_quant(bits: int | None, group_size: int = 64) -> KVQuant | None:
    """The option as given (`kv_bits` None: unquantized). Raises KVQuantError."""
    return None if bits is None else KVQuant(bits, group_size)


class QuantizedKVCache(mlx_cache.QuantizedKVCache):
    """A request's quantized KV (mlx-lm's class, see the module docstring)."""

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.group_size, self.bits

    @state.setter
    def state(self, v: Any) -> None:
        keys, values, self.offset, self.group_size, self.bits = v
        # (a file's state comes back as lists: `tree_unflatten`'s)
        self.keys = tuple(keys) if keys is not None else None
        self.values = tuple(values) if values is not None else None

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


def make_cache(model: Any, kv: KVQuant | None) -> list[Any]:
    """`model`'s prompt cache (mlx-lm's `make_prompt_cache`), its full-attention `KVCache`
    layers quantized as `kv` says (None: as mlx-lm makes them)."""
    cache = make_prompt_cache(model)
    if kv is None:
        return cache
    return [
        QuantizedKVCache(group_size=kv.group_size, bits=kv.bits) if type(c) is KVCache else c
        for c in cache
    ]


def check_model(model: Any, kv: KVQuant | None) -> None:
    """Raise KVQuantError, naming the widths, where `kv`'s group size does not divide the
    heads of `model`'s attention layers (MLX quantizes whole groups of a vector), or where
    the model has no layer it would quantize. One token's forward, on the executor."""
    if kv is None:
        return
    cache = make_prompt_cache(model)
    model(mx.array([[1]]), cache=cache)
    widths = sorted(
        {int(a.shape[-1]) for c in cache if type(c) is KVCache for a in (c.keys, c.values)}
    )
    if not widths:
        kinds = ", ".join(sorted({type(c).__name__ for c in cache}))
        raise KVQuantError(
            f"kv_bits: this model has no full-attention KV layer to quantize (its layers: "
            f"{kinds}); serve it without --kv-bits"
        )
    bad = [w for w in widths if w % kv.group_size]
    if bad:
        fits = [g for g in GROUP_SIZES if all(w % g == 0 for w in widths)]
        hint = f"use --kv-group-size {fits[-1]}" if fits else "serve it without --kv-bits"
        raise KVQuantError(
            f"kv_group_size {kv.group_size} does not divide this model's {bad[0]}-wide "
            f"attention heads (MLX quantizes groups of {', '.join(map(str, GROUP_SIZES))} "
            f"numbers of a head's vector): {hint}"
        )


Triple = tuple[mx.array, mx.array, mx.array]  # mx.quantize's packed values, scales, biases

_NIBBLES = (0, 4, 8, 12, 16, 20, 24, 28)  # where a uint32 keeps its eight 4-bit numbers


def dequantize(triple: Any, group_size: int, bits: int) -> mx.array:
    """`mx.dequantize(*triple, ...)`, the same numbers, in elementwise ops: on the CPU
    backend MLX's own is ~3x slower at 8 bits (0.98 against 0.32 ms for 800 keys of
    SmolLM2's 3 heads x 4 rows) and ~1.2x at 4. Packing as `mx.quantize`'s: lowest bits
    first, so 8-bit numbers are the uint32's bytes in order."""
    packed, scales, biases = triple
    if bits == 8:
        ints = packed.view(mx.uint8)
    else:
        shifts = mx.array(_NIBBLES, dtype=mx.uint32)
        ints = ((packed[..., None] >> shifts) & 0xF).reshape(*packed.shape[:-1], -1)
    shape = ints.shape
    grouped = ints.astype(scales.dtype).reshape(*shape[:-1], shape[-1] // group_size, group_size)
    return (grouped * scales[..., None] + biases[..., None]).reshape(shape)


class BatchQuantizedKVCache(mlx_cache._BaseCache):
    """Quantized KV of the decode batch's rows, left-padded as mlx-lm's `BatchKVCache` pads
    its rows (a row's padding: zeros, which its mask hides). `keys` and `values` are each a
    triple of arrays (B, H, S, ·); `offset` (B,) is each row's position, `_idx` the slots in
    use. `bits` and `group_size` make mlx-lm's attention take its quantized path."""

    step = 256

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        self.keys: Triple | None = None
        self.values: Triple | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        num_batch, num_heads, num_steps, _ = keys.shape
        prev = self._idx
        if self.keys is None or prev + num_steps > self.keys[0].shape[-2]:
            new_steps = (self.step + num_steps - 1) // self.step * self.step
            shape = (num_batch, num_heads, new_steps)
            if self.keys is not None and self.values is not None:
                old_keys = tree_map(lambda x: x[..., :prev, :], self.keys)
                old_values = tree_map(lambda x: x[..., :prev, :], self.values)
                self.keys = _grow(old_keys, shape)
                self.values = _grow(old_values, shape)
            else:
                self.keys = _zeros(shape, keys.shape[-1], keys.dtype, self)
                self.values = _zeros(shape, values.shape[-1], values.dtype, self)
        self._idx += num_steps
        self.offset = self.offset + num_steps
        for mine, new in ((self.keys, keys), (self.values, values)):
            quantized = mx.quantize(new, group_size=self.group_size, bits=self.bits)
            for i in range(3):
                mine[i][..., prev : self._idx, :] = quantized[i]
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        assert self.keys is not None and self.values is not None
        cut = self._idx
        return _cut(self.keys, 0, cut), _cut(self.values, 0, cut)

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:  # noqa: N803 - mlx-lm's name
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))

    # -- the batch's verbs (mlx-lm's `BatchKVCache`'s) --------------------------

    def filter(self, batch_indices: Any) -> None:
        """Keep only the rows `batch_indices`, in place; padding every row shares goes."""
        if self.keys is not None and self.values is not None:
            self.keys = tree_map(lambda x: x[batch_indices], self.keys)
            self.values = tree_map(lambda x: x[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None and self.values is not None:
                self.keys = _cut(self.keys, shift, None)
                self.values = _cut(self.values, shift, None)
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append `other`'s rows, in place: both right-aligned at the longer one's slots."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        parts = [c._aligned(idx) for c in (self, other)]
        self.keys = _concat([p[0] for p in parts])
        self.values = _concat([p[1] for p in parts])
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([p[2] for p in parts])
        self._idx = idx

    def _aligned(self, idx: int) -> tuple[Triple, Triple, mx.array]:
        """Its keys, values (slots [0, idx): padded on the left) and left padding, as rows
        of a batch whose slots in use are `idx` (at least its own)."""
        left = idx - self._idx
        keys, values = self.keys, self.values
        if keys is None or values is None:  # (rows join the batch after their prefill)
            raise ValueError("extend a batch of rows with no tokens by one with tokens")
        keys, values = _cut(keys, 0, self._idx), _cut(values, 0, self._idx)
        if left:
            keys, values = _pad_left(keys, left), _pad_left(values, left)
        return keys, values, self.left_padding + left

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row `idx` as a request's own cache, its padding cut off, in buffers of its own."""
        assert self.keys is not None and self.values is not None
        padding = int(self.left_padding[idx].item())
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        row = slice(idx, idx + 1)
        cache.keys = tuple(mx.contiguous(x[row, :, padding : self._idx]) for x in self.keys)
        cache.values = tuple(mx.contiguous(x[row, :, padding : self._idx]) for x in self.values)
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        """Requests' own `QuantizedKVCache`s as one batch, each row right-aligned."""
        first = caches[0]
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        batch = cls(padding, group_size=first.group_size, bits=first.bits)
        if longest == 0:
            return batch
        rows = [
            (_pad_left(_cut(c.keys, 0, c.offset), p), _pad_left(_cut(c.values, 0, c.offset), p))
            for c, p in zip(caches, padding, strict=True)
            if c.keys is not None
        ]
        if len(rows) != len(caches):
            raise ValueError("merge requests with no tokens into a batch of some")
        batch.keys = _concat([r[0] for r in rows])
        batch.values = _concat([r[1] for r in rows])
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    @classmethod
    def of_one(cls, cache: QuantizedKVCache) -> BatchQuantizedKVCache:
        """A request's own cache as a batch of one row, sharing its arrays (no copy)."""
        batch = cls([0], group_size=cache.group_size, bits=cache.bits)
        n = cache.offset
        batch.state = (cache.keys, cache.values, mx.array([n]), mx.array([0]), n)
        return batch


def _zeros(shape: tuple[int, ...], dim: int, dtype: mx.Dtype, c: Any) -> Triple:
    per_int = 32 // c.bits
    groups = (*shape, dim // c.group_size)
    return (
        mx.zeros((*shape, dim // per_int), dtype=mx.uint32),
        mx.zeros(groups, dtype=dtype),
        mx.zeros(groups, dtype=dtype),
    )


def _grow(triple: Triple, shape: tuple[int, ...]) -> Triple:
    """`triple` with zeros appended on the token axis up to a multiple of the block."""
    out = []
    for x in triple:
        extra = mx.zeros((*shape, x.shape[-1]), dtype=x.dtype)
        out.append(mx.concatenate([x, extra], axis=-2))
    return (out[0], out[1], out[2])


def _cut(triple: Triple, start: int, stop: int | None) -> Triple:
    a, b, c = (x[..., start:stop, :] for x in triple)
    return (a, b, c)


def _pad_left(triple: Triple, n: int) -> Triple:
    if n == 0:
        return triple
    a, b, c = (mx.pad(x, [(0, 0), (0, 0), (n, 0), (0, 0)]) for x in triple)
    return (a, b, c)


def _concat(triples: list[Triple]) -> Triple:
    a, b, c = (mx.concatenate([t[i] for t in triples]) for i in range(3))
    return (a, b, c)
