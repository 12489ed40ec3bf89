"""The executor's state of one request, and of the decode batch's look-ahead (MLX arrays;
`engine/runner.py` owns and changes them, on the executor's thread only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from stepline.engine.penalties import RowHistory
from stepline.engine.sampling import PendingSample, RowSampling

Cache = list[Any]  # one mlx-lm cache object per layer


@dataclass
class Seq:
    """Executor-side state of one request."""

    request_id: str
    prompt: mx.array  # (L,) int32
    sampling: RowSampling
    history: RowHistory | None
    cache: Cache | None  # own cache while prefilling; None once merged into the batch
    max_output: int  # it ends by length at this many tokens (`work.max_output_tokens`)
    output: list[int] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    constraint: Any = None  # llguidance matcher of a grammar-constrained request

    @property
    def num_generated(self) -> int:
        return len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1]


@dataclass
class Ahead:
    """The decode batch's next forward and its samples, built and started before the step
    that uses them was planned (see `ModelRunner._build_ahead` and `ModelRunner.look_ahead`)."""

    ids: list[str]  # the batch's rows when it started; the step takes those still there
    logits: mx.array  # (B, V) last-position logits
    sample: PendingSample | None  # None if it could not be built: the step samples instead
