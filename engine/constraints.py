"""Grammar masks on a logits batch: only the constrained rows pay for them.

Each constrained row's matcher (llguidance) fills its row of a packed bitmask (32 tokens per
int32) on the CPU, in llguidance's own threads; the mask is unpacked with MLX and applied to
exactly those rows (disallowed tokens get -inf), so the sampler that follows draws only
tokens the grammar allows. Rows without a constraint are not read, copied or touched. The
masks are computed while the step's forward pass evaluates, so they mostly hide behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

_executor: Any = None  # llguidance's thread pool, made on first use


def _ll_executor() -> Any:
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    return _executor


def apply_grammar_masks(logits: mx.array, rows: Sequence[int], matchers: Sequence[Any]) -> mx.array:
    """`logits` (B, V) with the tokens that `matchers[i]` forbids set to -inf in row `rows[i]`.

    Returns `logits` itself when `rows` is empty. A matcher whose grammar has ended allows only
    its end-of-sequence tokens, so a finished grammar ends its request with a stop token; so
    does one in llguidance's error state (a limit hit computing the mask), which `advance`
    then reports.
    """
    if not rows:
        return logits
    num_rows, vocab = logits.shape
    # The forward pass runs (on MLX's stream) while llguidance computes the masks here.
    mx.async_eval(logits)
    bitmask = allocate_token_bitmask(len(rows), vocab)
    fill_next_token_bitmask_par(_ll_executor(), [(m, i) for i, m in enumerate(matchers)], bitmask)
    packed = mx.array(bitmask.view(np.uint32))
    shifts = mx.arange(32, dtype=mx.uint32)
    bits = ((packed[:, :, None] >> shifts) & 1).reshape(len(rows), -1)[:, :vocab]
    if len(rows) == num_rows and list(rows) == list(range(num_rows)):
        return mx.where(bits.astype(mx.bool_), logits, -mx.inf)
    index = mx.array(list(rows))
    logits[index] = mx.where(bits.astype(mx.bool_), logits[index], -mx.inf)
    return logits


def advance(matcher: Any, token_id: int) -> str | None:
    """Move `matcher` past the token its request just sampled. Returns None, or what failed
    once the matcher is in llguidance's error state (it never leaves it): its last mask could
    not be computed, or this token could not be taken in, within the grammar's limits. Such a
    mask allowed only the end-of-sequence tokens, so the token is no valid output."""
    # (A matcher in its error state still takes an end-of-sequence token: hence both checks.)
    if matcher.consume_token(token_id) and not matcher.is_error():
        return None
    error: str = matcher.get_error()
    return error.strip().splitlines()[0] if error.strip() else "the grammar refused the token"
