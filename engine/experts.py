"""A mixture-of-experts layer's experts as one matrix product per expert, on the CPU.

mlx-lm's expert layers (`SwitchGLU`, `SwitchMLP`: Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE,
gpt-oss, GLM, DeepSeek, Granite MoE, ...) compute with `mx.gather_mm`, which on MLX's CPU
backend multiplies each (token, expert) pair on its own: a vector against the expert's
whole matrix, so a step's tokens read an expert's weights once for every token routed to
it. On the Qwen3-Next-shaped demo (8 experts, top 2) the experts were 69% of a burst's
forward time, for stepline and mlx-lm's `BatchGenerator` alike
(`benchmarks/where_time_goes.py`), and a 79-token chunk's experts took 44 ms a layer.

Here the tokens are sorted by expert (as mlx-lm itself sorts them above 64 pairs), the
number each expert takes is read on the host (one small synchronisation a layer), and
each expert with any tokens multiplies them all at once, its weights read once: the same
79 tokens take 14 ms, 512 take 36 against 272 (`benchmarks/cpu_layers.py`). The numbers are
the expert's own products of other shapes: equal up to float32 rounding, as the fused
step's are (`fused._close`).

`install` swaps the two classes' `__call__` (once) for one that takes this path on the CPU
for plain (not quantized) expert weights and at least `PAIRS_PER_EXPERT` (token, expert)
pairs for each of the layer's experts;
anything else (a decode step of a row or two, quantized experts, another device) runs
mlx-lm's own code unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear, SwitchMLP

# Fewer (token, expert) pairs than this many a layer's expert: mlx-lm's gather is as quick
# (at 8 experts, 16 pairs are slower grouped and 24 quicker).
PAIRS_PER_EXPERT = 3

_OWN: dict[type, Callable[..., mx.array]] = {
    SwitchGLU: SwitchGLU.__call__,
    SwitchMLP: SwitchMLP.__call__,
}


def _linear(layer: SwitchLinear, x: mx.array, expert: int) -> mx.array:
    y = x @ layer["weight"][expert].T
    if "bias" in layer:
        y = y + layer["bias"][expert]
    return y


def grouped(
    x: mx.array, indices: mx.array, experts: Callable[[mx.array, int], mx.array]
) -> mx.array:
    """Each of `x`'s tokens ([..., D]) through the experts `indices` ([..., K]) names,
    `experts(tokens, e)` computing expert e over all its tokens at once: [..., K, D_out]."""
    k = indices.shape[-1]
    flat = indices.reshape(-1)
    order = mx.argsort(flat)
    routed = x.reshape(-1, x.shape[-1])[order // k]
    taken = flat[order]
    # How many pairs each expert takes, on the host: where each one's rows start and end.
    names: list[int] = taken.tolist()  # type: ignore[assignment]
    firsts = [i for i, name in enumerate(names) if i == 0 or name != names[i - 1]]
    ends = [*firsts[1:], flat.shape[0]]
    outputs = [
        experts(routed[start:end], names[start]) for start, end in zip(firsts, ends, strict=True)
    ]
    y = mx.concatenate(outputs, axis=0)[mx.argsort(order)]
    return y.reshape(*indices.shape, y.shape[-1])


def _glu(module: SwitchGLU, tokens: mx.array, expert: int) -> mx.array:
    up = _linear(module.up_proj, tokens, expert)
    gate = _linear(module.gate_proj, tokens, expert)
    return _linear(module.down_proj, module.activation(up, gate), expert)


def _mlp(module: SwitchMLP, tokens: mx.array, expert: int) -> mx.array:
    hidden = module.activation(_linear(module.fc1, tokens, expert))
    return _linear(module.fc2, hidden, expert)


def _takes(layers: tuple[Any, ...], indices: mx.array) -> bool:
    return (
        all(type(layer) is SwitchLinear for layer in layers)
        and indices.size >= PAIRS_PER_EXPERT * layers[0]["weight"].shape[0]
        and mx.default_device() == mx.cpu
    )


def _glu_call(self: SwitchGLU, x: mx.array, indices: mx.array) -> mx.array:
    if not _takes((self.up_proj, self.gate_proj, self.down_proj), indices):
        return _OWN[SwitchGLU](self, x, indices)
    return grouped(x, indices, lambda tokens, e: _glu(self, tokens, e))


def _mlp_call(self: SwitchMLP, x: mx.array, indices: mx.array) -> mx.array:
    if not _takes((self.fc1, self.fc2), indices):
        return _OWN[SwitchMLP](self, x, indices)
    return grouped(x, indices, lambda tokens, e: _mlp(self, tokens, e))


_OURS: dict[type, Callable[..., mx.array]] = {SwitchGLU: _glu_call, SwitchMLP: _mlp_call}


def install() -> bool:
    """Swap the expert layers' `__call__` for the grouped one (idempotent), on the CPU
    backend only: whether it is in place."""
    if mx.default_device() != mx.cpu:
        return False
    for cls, call in _OURS.items():
        cls.__call__ = call  # type: ignore[method-assign]
    return True


@contextlib.contextmanager
def mlx_lm_own() -> Iterator[None]:
    """mlx-lm's own expert layers while inside (a reference run, a peer's baseline in a
    benchmark), the grouped ones back afterwards where they were installed."""
    was = {cls: cls.__call__ for cls in _OWN}
    for cls, call in _OWN.items():
        cls.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, call in was.items():
            cls.__call__ = call  # type: ignore[method-assign]
