"""Gated DeltaNet's recurrence over a prompt in blocks of matrix products, for the CPU.

mlx-lm computes a Gated DeltaNet layer's prompt (Qwen3-Next, Qwen3.5/3.6, OLMo hybrid,
Kimi Linear, ...) with a Metal kernel on a Mac and, anywhere else, with `gated_delta_ops`:
one compiled step per token, so a 512-token chunk is 512 small evaluations in a row per
layer, each too small to keep two cores busy. That loop, not the projections or the
experts, is where a hybrid model's prefill goes on Linux.

The recurrence (per head, state `S` of shape (Dv, Dk), scalar gate `g_t`, `beta_t`):

    S_t = g_t * S_{t-1} + beta_t * (v_t - g_t * S_{t-1} k_t) k_t^T,    y_t = S_t q_t

has the chunkwise form of the Gated DeltaNet paper (Yang, Kautz and Hatamizadeh, 2024,
after the WY representation of DeltaNet's): within a block of C tokens, with `L` the
running sum of log g from the block's start and `G[t, i] = exp(L_t - L_i)` for i <= t,

    (I + A) U = diag(beta) (V - diag(exp L) K S_0^T),  A[t, i] = beta_t G[t, i] k_t.k_i  (i < t)
    Y   = diag(exp L) Q S_0^T + (Q K^T * G) U
    S_C = exp(L_C) S_0 + U^T diag(exp(L_C - L)) K

so a block is a handful of batched matrix products, and only the blocks (C = 32 tokens)
follow one another. Everything that does not depend on `S_0` (the triangular inverse, the
block's own products) is computed for every block at once, before the loop.

It is the same function as mlx-lm's, computed in another order: equal up to float32
rounding, as the fused step's forwards are (`fused._close`). `install` swaps it in, by the
name the model's modules import (`gated_delta_update`), for calls it covers (scalar gates,
no padding mask, a prompt of at least `MIN_TOKENS`, the CPU); anything else goes to
mlx-lm's own function unchanged. tests/test_gated_delta.py holds it to mlx-lm's, layer by
layer and through a whole hybrid model's greedy answers.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import structlog
from mlx_lm.models import gated_delta

log = structlog.get_logger(__name__)

# Block length: the quadratic work inside a block against the blocks that follow one another
# (32 is quickest on a 2-core CPU from 16 to 2,048 tokens, benchmarks/cpu_layers.py).
BLOCK = 32
# Below this many tokens mlx-lm's per-token loop is as quick (a decode row is one step).
MIN_TOKENS = 8
_ORIGINAL: Callable[..., tuple[mx.array, mx.array]] = gated_delta.gated_delta_update


def chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    block: int = BLOCK,
) -> tuple[mx.array, mx.array]:
    """`gated_delta.gated_delta_ops` (q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g, beta:
    [B, T, Hv]; state: [B, Hv, Dv, Dk]) in blocks of `block` tokens: (y, new state)."""
    batch, length, key_heads, _ = q.shape
    heads = v.shape[-2]
    out_dtype = q.dtype
    if (repeat := heads // key_heads) > 1:
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    block = min(block, 1 << (length - 1).bit_length())  # a short prompt: one block
    pad = -length % block
    blocks = (length + pad) // block

    def blocked(x: mx.array, fill: float) -> mx.array:
        # [B, T, H, ...] -> [B, H, N, C, ...] in float32, the tail padded with `fill`
        x = mx.moveaxis(x.astype(mx.float32), 1, 2)
        if pad:
            widths = [(0, 0)] * x.ndim
            widths[2] = (0, pad)
            x = mx.pad(x, widths, constant_values=fill)
        return x.reshape(*x.shape[:2], blocks, block, *x.shape[3:])

    # Padding tokens change nothing: no key, no value, beta 0 and a gate of 1.
    q, k, v = blocked(q, 0.0), blocked(k, 0.0), blocked(v, 0.0)
    log_g = mx.log(blocked(g, 1.0))
    beta = blocked(beta, 0.0)

    running = mx.cumsum(log_g, axis=-1)  # L: [B, H, N, C]
    causal = mx.tril(mx.ones((block, block), dtype=mx.bool_))
    strict = mx.tril(mx.ones((block, block), dtype=mx.bool_), k=-1)
    gaps = running[..., :, None] - running[..., None, :]
    decay = mx.where(causal, mx.exp(mx.where(causal, gaps, 0.0)), 0.0)  # G
    keys_t = mx.swapaxes(k, -1, -2)
    a = mx.where(strict, beta[..., None] * (k @ keys_t) * decay, 0.0)
    inverse = mx.linalg.tri_inv(a + mx.eye(block), upper=False, stream=mx.cpu)
    scale = mx.exp(running)[..., None]
    w = inverse @ (beta[..., None] * scale * k)  # what S_0 takes off U
    u0 = inverse @ (beta[..., None] * v)
    attend = (q @ keys_t) * decay
    q_scaled = q * scale
    end = running[..., -1:]
    keys_end = k * mx.exp(end - running)[..., None]
    end_decay = mx.exp(end)[..., None]  # [B, H, N, 1, 1]

    s = state.astype(mx.float32)
    ys = []
    for n in range(blocks):
        s_t = mx.swapaxes(s, -1, -2)
        u = u0[:, :, n] - w[:, :, n] @ s_t
        ys.append(q_scaled[:, :, n] @ s_t + attend[:, :, n] @ u)
        s = end_decay[:, :, n] * s + mx.swapaxes(u, -1, -2) @ keys_end[:, :, n]
    y = mx.concatenate(ys, axis=2)[:, :, :length]
    return mx.moveaxis(y, 1, 2).astype(out_dtype), s


def update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,  # noqa: N803 - mlx-lm's name
    dt_bias: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    **kwargs: Any,
) -> tuple[mx.array, mx.array]:
    """`gated_delta.gated_delta_update`, its prompt's recurrence in blocks (`chunked`) on
    the CPU for a prompt of `MIN_TOKENS` or more with one gate per head and no padding mask
    (a batch's right-padded rows); anything else is mlx-lm's own call."""
    lower_bound = kwargs.get("lower_bound")
    takes = (
        mask is None
        and q.shape[1] >= MIN_TOKENS
        and not kwargs.get("allow_neg_eigval")
        and mx.default_device() == mx.cpu
    )
    if takes:
        if lower_bound is None:
            g = gated_delta.compute_g(A_log, a, dt_bias)
        else:
            g = gated_delta.compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
        takes = g.ndim == 3  # per-key gates (B, T, H, Dk): mlx-lm's
    if not takes:
        return _ORIGINAL(q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)
    if state is None:
        batch, _, _, key_dim = q.shape
        heads, value_dim = v.shape[-2:]
        state = mx.zeros((batch, heads, value_dim, key_dim), dtype=mx.float32)
    return chunked(q, k, v, g, mx.sigmoid(b), state)


def install(model: Any) -> bool:
    """Swap `update` in for `gated_delta_update` in the mlx-lm modules `model`'s layers come
    from (once; idempotent), on the CPU backend only. False where nothing was swapped
    (another device; a model without Gated DeltaNet layers)."""
    if mx.default_device() != mx.cpu:
        return False
    swapped = False
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        if getattr(module, "gated_delta_update", None) is _ORIGINAL:
            module.gated_delta_update = update  # type: ignore[union-attr]
            log.debug("gated_delta_chunked", module=name)
        swapped = swapped or getattr(module, "gated_delta_update", None) is update
    return swapped


@contextlib.contextmanager
def mlx_lm_own() -> Iterator[None]:
    """mlx-lm's own recurrence in every module while inside (a reference run, a peer's
    baseline in a benchmark), `update` back where it was swapped in afterwards."""
    swapped = [
        module
        for module in list(sys.modules.values())
        if getattr(module, "gated_delta_update", None) is update
    ]
    for module in swapped:
        module.gated_delta_update = _ORIGINAL  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in swapped:
            module.gated_delta_update = update  # type: ignore[attr-defined]
