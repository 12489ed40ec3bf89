"""Prompt attention on MLX's CPU backend, in blocks of queries that stay in the CPU's cache.

On the CPU, `mx.fast.scaled_dot_product_attention` for a prompt chunk is MLX's fallback:
the whole (heads x queries x keys) score matrix, then a softmax whose `exp` is scalar code
(~15 ns an element). At long context that is most of a prefill: on SmolLM2-135M in
float32 on a 2-core CPU, a 40-token chunk at offset 1,800 spent ~380 of its ~550 ms there,
~8 of every ~12 ms a layer in the softmax. Here a chunk's queries go in blocks sized so
that a block's scores (~2 MB) stay in cache, each block against only the keys it can see
(the causal triangle is skipped, not masked), and the softmax's `exp` is built from MLX's
vector-friendly elementwise ops: 2^n x 2^f, 2^f from its Taylor series on [-1/2, 1/2]
(relative error ~1e-7, float32's own rounding) and 2^n from the exponent bits; the product
reads no subnormal weight (`weights`). Per layer (9 query heads, 3 KV heads): 128 queries
at 2,048 keys 28 ms against MLX's 36; a whole 160-token prompt 2.2 against 3.6 ms.

MLX's CPU backend runs each stream's elementwise ops on that stream's one thread (only its
matrix products are multi-threaded, by the BLAS), so a chunk's softmax kept one core of two
busy: a 197-token SmolLM2 chunk at offset 3,800 ran at 1.05 cores. The blocks of queries are
independent, so they alternate between `STREAMS` CPU streams, each its own thread: one
block's `exp` runs beside another's, and the results are the same numbers (each block's
arithmetic is unchanged; MLX orders the streams' work by the data it shares).

Decode rows at long context (`row_attention`) take the same softmax.

`install` wraps a model module's `scaled_dot_product_attention` (the name mlx-lm's models
import from `mlx_lm.models.base`) on the CPU for float32 prompt chunks under a causal mask
and for decode rows over `ROW_MIN_KEYS` keys or more (no mask, or a batch cache's row
mask); a quantized cache's keys and values (`--kv-bits`) are dequantized first
(`DEQUANTIZE`); everything else (attention sinks, other masks, other dtypes, other
devices) goes to mlx-lm's own function unchanged.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from stepline.engine.forward import body_of, wrap_attention

_LOG2E = 1.4426950408889634
# exp(f ln 2) = sum (f ln 2)^k / k!: degree 6 on |f| <= 1/2 errs by ~1e-7 relative
_TAYLOR = tuple(math.log(2) ** k / math.factorial(k) for k in range(7))
# Scores of one block of queries: at most this many floats (2 MB), at least MIN_BLOCK rows
BLOCK_ELEMENTS = 1 << 19
MIN_BLOCK = 8
# Quantized KV (`--kv-bits`): dequantized each step (`kv_quant.dequantize`) into the float
# attention below, not mlx-lm's `quantized_matmul` over the packed keys, which MLX's CPU
# backend runs slowly: SmolLM2, 4 rows at 800 tokens, a decode step 189 against 340 ms at
# 8 bits (203 unquantized), 288 against 325 at 4 (benchmarks/kv_quant.py, a busy machine).
DEQUANTIZE = True
# Decode rows gain from it only at long context: 5 rows beside 2,000 keys, a SmolLM2 decode
# step 0.25 against 0.30 s; at 400 keys no faster.
ROW_MIN_KEYS = 1024
# CPU streams a chunk's blocks of queries alternate between (each stream is one thread of
# elementwise work): 2, the cores of the machine it was measured on (benchmarks/README.md)
STREAMS = 2
_streams = threading.local()  # per thread: the executor's own streams


def _block_streams() -> list[mx.Stream]:
    """The streams a chunk's blocks go to, in turn: this thread's default CPU stream, then
    `STREAMS - 1` of its own (made once per thread: a stream belongs to whoever made it)."""
    made = getattr(_streams, "streams", None)
    if made is None or len(made) != STREAMS:
        made = [mx.default_stream(mx.cpu)] + [mx.new_stream(mx.cpu) for _ in range(STREAMS - 1)]
        _streams.streams = made
    return made


def fast_exp(x: mx.array) -> mx.array:
    """exp(x) for float32 `x` <= 0 (softmax arguments): -inf and anything under 2^-125.5
    become 2^-125.5 (~2.5e-38), not 0, which a softmax's sum does not notice; never a
    subnormal float (`weights` says why)."""
    t = mx.maximum(x * _LOG2E, -125.5)
    n = mx.round(t)
    f = t - n
    p = mx.array(_TAYLOR[-1], dtype=mx.float32)
    for c in reversed(_TAYLOR[:-1]):
        p = p * f + c
    return p * ((n.astype(mx.int32) + 127) << 23).view(mx.float32)


def causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Attention of the last L positions (`q` (B, H, L, D)) over `k`, `v` (B, Hk, S, D),
    each query seeing the keys up to its own position; H a multiple of Hk (grouped
    queries). What `mx.fast.scaled_dot_product_attention(..., mask="causal")` computes."""
    b, h, length, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    group = h // hk
    block = max(MIN_BLOCK, BLOCK_ELEMENTS // (h * s))
    # a group's query heads as rows of one matrix per key head: (B, Hk, group, L, D)
    q = (q * scale).reshape(b, hk, group, length, d)
    outs = []
    starts = range(0, length, block)
    streams = _block_streams() if len(starts) > 1 else [mx.default_stream(mx.cpu)]
    for i, start in enumerate(starts):
        end = min(length, start + block)
        seen = s - length + end  # the block's last query sees keys [0, seen)
        with mx.stream(streams[i % len(streams)]):
            rows = q[:, :, :, start:end].reshape(b, hk, group * (end - start), d)
            scores = rows @ k[:, :, :seen].swapaxes(-1, -2)  # (B, Hk, group * n, seen)
            if end - start > 1:
                position = mx.arange(s - length + start, seen)[:, None]
                visible = position >= mx.arange(seen)[None]  # (n, seen)
                scores = scores.reshape(b, hk, group, end - start, seen)
                scores = mx.where(visible, scores, -mx.inf).reshape(b, hk, -1, seen)
            out = _attend(scores, v[:, :, :seen])  # (B, Hk, group * n, D)
            outs.append(out.reshape(b, hk, group, end - start, d))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(b, h, length, d)


def row_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None
) -> mx.array:
    """Attention of one query per row (`q` (B, H, 1, D): decode rows) over `k`, `v`
    (B, Hk, S, D), under `mask` (None, or boolean or additive, broadcastable to
    (B, 1, 1, S) as a batch cache makes it for its left padding)."""
    b, h, _, d = q.shape
    hk = k.shape[1]
    rows = (q * scale).reshape(b, hk, h // hk, d)
    scores = rows @ k.swapaxes(-1, -2)  # (B, Hk, group, S)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, -mx.inf)
        else:
            scores = scores + mask
    return _attend(scores, v).reshape(b, h, 1, d)


def _attend(scores: mx.array, v: mx.array) -> mx.array:
    """softmax(`scores`) @ `v`, its division by the softmax's sum made on the product (D
    wide, not keys wide): see `weights`."""
    w, inverse_sum = weights(scores)
    return (w @ v) * inverse_sum


def weights(scores: mx.array) -> tuple[mx.array, mx.array]:
    """A softmax over the last axis, unnormalized: `fast_exp` of the scores less their
    maximum, and 1 / their sum. Each weight is a normal float, and stays one as the
    product reads it: x86 CPUs read subnormal operands ~50x slower, and masked keys'
    weights divided by the sum were subnormal (a 160-token chunk's masked triangle made
    SmolLM2's whole prefill 2.4x slower than MLX's own attention)."""
    w = fast_exp(scores - scores.max(axis=-1, keepdims=True))
    return w, 1.0 / w.sum(axis=-1, keepdims=True)


def dequantized(keys: Any, values: Any, cache: Any) -> tuple[mx.array, mx.array]:
    """A quantized cache's keys and values (triples: `engine/kv_quant.py`) as numbers."""
    from stepline.engine.kv_quant import dequantize

    group_size, bits = cache.group_size, cache.bits
    return dequantize(keys, group_size, bits), dequantize(values, group_size, bits)


def _wrap(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, **kwargs):
        if DEQUANTIZE and hasattr(cache, "bits") and kwargs.get("sinks") is None:
            keys, values = dequantized(keys, values, cache)
            cache = None  # (the numbers' attention, below or mlx-lm's)
        if (
            not hasattr(cache, "bits")  # quantized caches have their own path (keys: triples)
            and queries.dtype == mx.float32
            and keys.dtype == mx.float32
            and kwargs.get("sinks") is None
        ):
            if queries.shape[2] > 1 and isinstance(mask, str) and mask == "causal":
                return causal_attention(queries, keys, values, scale)
            long = keys.shape[2] >= ROW_MIN_KEYS
            if queries.shape[2] == 1 and long and (mask is None or _row_mask(mask, keys)):
                return row_attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    scaled_dot_product_attention.original = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def _row_mask(mask: Any, keys: mx.array) -> bool:
    """Whether `mask` is one `row_attention` applies: (B or 1, 1, 1, S)."""
    return (
        isinstance(mask, mx.array)
        and mask.ndim == 4
        and mask.shape[1:3] == (1, 1)
        and mask.shape[0] in (1, keys.shape[0])
        and mask.shape[3] == keys.shape[2]
    )


def install(model: Any) -> bool:
    """Wrap the attention function of `model`'s mlx-lm module (once), on the CPU backend
    only. False where it does not apply (another device; a module that does not call
    `scaled_dot_product_attention` by that name)."""
    if mx.default_device() != mx.cpu:
        return False
    body = body_of(model)  # a wrapper's attention is its language model's
    return wrap_attention(type(body or model).__module__, "stepline_cpu", _wrap)
