"""Memory budgets measured against MLX's own counters: the machine's memory, the model's KV
footprint per token, the budget in tokens the scheduler's admission control works with, and
MLX's buffer cache limit.

MLX calls here run on the executor thread (like all MLX work); `kv_tokens_for_budget` and
`default_kv_budget_bytes` are plain arithmetic.
"""

from __future__ import annotations

import math
import os
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from stepline.actors.scheduler.work import MemoryCounters
from stepline.engine.forward import evaluated, run_to_end
from stepline.engine.kv_quant import KVQuant, make_cache

# With no --max-kv-gb: the KV of running requests may use this fraction of the machine's
# memory, less the weights and the prefix cache, but never less than _MIN_KV_FRACTION of it.
DEFAULT_MEMORY_FRACTION = 0.7
_MIN_KV_FRACTION = 0.1
# With no --mlx-cache-gb: MLX keeps at most this fraction of the machine's memory, and at
# most DEFAULT_BUFFER_CACHE_MAX, in freed buffers for reuse. Its own default is the whole
# memory limit, which looks like a leak; and a soak run (benchmarks/soak.py) filled even
# 10% of 24 GB with buffers of sizes that never came back (KV growth blocks of prompts of
# every length), while a step's own buffers are far smaller.
DEFAULT_BUFFER_CACHE_FRACTION = 0.1
DEFAULT_BUFFER_CACHE_MAX = 512 * 2**20


@dataclass(frozen=True)
class KVFootprint:
    """What one request's cache costs, measured on the model's own `make_prompt_cache`."""

    bytes_per_token: int  # KV layers (full, sliding, quantized): grows with every token
    bytes_per_seq: int  # recurrent state (ArraysCache): a fixed cost per request
    # KV buffers grow in blocks (mlx-lm's `step`, 256 tokens): a request's buffer may hold
    # up to this many slots beyond its tokens, in the batch as alone
    growth_tokens: int = 0

    def tokens_per_seq(self) -> int:
        """The fixed per-request cost in units of one token's KV: its recurrent state
        (rounded up) and the room its KV buffer may have grown by."""
        return math.ceil(self.bytes_per_seq / max(self.bytes_per_token, 1)) + self.growth_tokens


def read_memory_counters() -> MemoryCounters:
    return MemoryCounters(
        active=mx.get_active_memory(), cache=mx.get_cache_memory(), peak=mx.get_peak_memory()
    )


def machine_memory_bytes() -> int:
    """The memory MLX may use: Metal's recommended working set on macOS, the GPU's memory
    on CUDA, else physical RAM."""
    device_info = getattr(mx, "device_info", None) or mx.metal.device_info  # MLX < 0.30
    info: dict[str, Any] = device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weights_bytes(model: Any) -> int:
    """The model's parameters, and its LoRA adapters' matrices (`lora.adapter_bytes`)."""
    from stepline.engine.lora import adapter_bytes

    return sum(a.nbytes for _, a in tree_flatten(model.parameters())) + adapter_bytes(model)


def measure_kv_footprint(model: Any, kv: KVQuant | None = None) -> KVFootprint:
    """Forward a few tokens into a fresh prompt cache (its attention layers quantized as `kv`
    says: `engine/kv_quant.py`) and read each layer's arrays.

    A layer with keys (KVCache, RotatingKVCache, QuantizedKVCache) costs its allocated
    bytes divided by its allocated token slots (the token axis is -2 of every array), per
    token: a sliding window is counted as if it never wrapped, an overestimate. Such a layer
    grows its buffer in blocks of `step` tokens, so it may hold up to `step - 1` slots more
    than its tokens (alone, and as a row of the batch: each row is as wide as the batch's
    buffer). Any other layer (ArraysCache's recurrent state) costs its bytes once per request.
    """
    return run_to_end(kv_footprint_steps(model, kv))


def kv_footprint_steps(model: Any, kv: KVQuant | None = None) -> Generator[None, None, KVFootprint]:
    """`measure_kv_footprint`, its forward a few layers a step (`forward.evaluated`)."""
    cache = make_cache(model, kv)
    model(mx.array([[1, 2, 3, 4]]), cache=cache)
    yield from evaluated(model, [layer.state for layer in cache], cache)
    per_token = 0.0
    per_seq = 0
    growth = 0
    for layer in cache:
        if getattr(layer, "keys", None) is not None:
            arrays = [a for _, a in tree_flatten([layer.keys, layer.values])]
            per_token += sum(a.nbytes / a.shape[-2] for a in arrays)
            growth = max(growth, getattr(layer, "step", 1) - 1)
        else:
            per_seq += sum(
                a.nbytes for _, a in tree_flatten(layer.state) if isinstance(a, mx.array)
            )
    return KVFootprint(
        bytes_per_token=math.ceil(per_token), bytes_per_seq=per_seq, growth_tokens=growth
    )


def kv_tokens_for_budget(budget_bytes: float, footprint: KVFootprint) -> int:
    """How many tokens of KV fit in `budget_bytes` (at least 1)."""
    return max(1, int(budget_bytes // max(footprint.bytes_per_token, 1)))


def default_kv_budget_bytes(machine: int, weights: int, prefix_cache: int) -> int:
    """The KV budget when none is given: a fraction of the machine's memory, less the
    weights and the prefix cache's budget, and at least a tenth of the memory."""
    return int(
        max(machine * DEFAULT_MEMORY_FRACTION - weights - prefix_cache, machine * _MIN_KV_FRACTION)
    )


def set_buffer_cache_limit(limit_bytes: int) -> int:
    """Limit the freed buffers MLX keeps for reuse; returns the previous limit."""
    return int(mx.set_cache_limit(limit_bytes))


@dataclass(frozen=True)
class MemoryPlan:
    """The engine's memory budgets, resolved at load."""

    footprint: KVFootprint
    kv_budget_bytes: int  # what max_kv_tokens was derived from (or stands for)
    max_kv_tokens: int
    buffer_cache_bytes: int  # MLX's buffer cache limit, now set


def plan_memory(
    model: Any,
    *,
    max_kv_tokens: int | None,
    max_kv_gb: float | None,
    mlx_cache_gb: float | None,
    prefix_cache_bytes: int,
    kv: KVQuant | None = None,
    kv_cache: bool = True,
) -> MemoryPlan:
    """Measure the model's KV footprint, turn the KV budget into tokens, and limit MLX's
    buffer cache. `max_kv_tokens` wins if given; else `max_kv_gb`; else a default fraction
    of the machine's memory. `kv`: how the KV is quantized (its bytes are counted as held).
    `kv_cache` false: a model that keeps none (an encoder, engine/bert.py). Runs on the
    executor thread."""
    return run_to_end(
        plan_memory_steps(
            model,
            max_kv_tokens=max_kv_tokens,
            max_kv_gb=max_kv_gb,
            mlx_cache_gb=mlx_cache_gb,
            prefix_cache_bytes=prefix_cache_bytes,
            kv=kv,
            kv_cache=kv_cache,
        )
    )


def plan_memory_steps(
    model: Any,
    *,
    max_kv_tokens: int | None,
    max_kv_gb: float | None,
    mlx_cache_gb: float | None,
    prefix_cache_bytes: int,
    kv: KVQuant | None = None,
    kv_cache: bool = True,
) -> Generator[None, None, MemoryPlan]:
    """`plan_memory`, its forward a few layers a step (a model loading beside others runs
    each step as a job of its own)."""
    footprint = (yield from kv_footprint_steps(model, kv)) if kv_cache else KVFootprint(0, 0)
    machine = machine_memory_bytes()
    if max_kv_tokens is not None:
        budget = max_kv_tokens * footprint.bytes_per_token
    elif max_kv_gb is not None:
        budget = int(max_kv_gb * 2**30)
    else:
        budget = default_kv_budget_bytes(machine, weights_bytes(model), prefix_cache_bytes)
    cache_limit = (
        int(mlx_cache_gb * 2**30)
        if mlx_cache_gb is not None
        else min(int(machine * DEFAULT_BUFFER_CACHE_FRACTION), DEFAULT_BUFFER_CACHE_MAX)
    )
    set_buffer_cache_limit(cache_limit)
    return MemoryPlan(
        footprint=footprint,
        kv_budget_bytes=budget,
        max_kv_tokens=max_kv_tokens or kv_tokens_for_budget(budget, footprint),
        buffer_cache_bytes=cache_limit,
    )
