"""Forward passes of an mlx-lm model for prefill chunks: the vocabulary projection only
where logits are wanted (the last position of a final chunk), when the architecture allows
splitting the model's body from its output head."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import structlog
from mlx_lm.models.cache import make_prompt_cache

log = structlog.get_logger(__name__)


def split_head_works(model: Any) -> bool:
    """Whether `model.model` + the output head reproduce `model(...)` for this architecture.

    If they do, prefill chunks skip the vocabulary projection for every position but the
    last one needed; otherwise `forward` runs the full model.
    """
    body = getattr(model, "model", None)
    if body is None or not callable(body):
        return False
    try:
        tokens = mx.array([[1, 2, 3, 4]])
        full = model(tokens, cache=make_prompt_cache(model))[:, -1, :]
        split = output_head(model, body(tokens, cache=make_prompt_cache(model))[:, -1:, :])
        return bool(mx.allclose(full, split[:, -1, :], atol=1e-4, rtol=1e-4).item())
    except Exception as exc:  # noqa: BLE001 - any mismatch means: use the full forward
        log.info("split_head_unavailable", reason=repr(exc))
        return False


def output_head(model: Any, hidden: mx.array) -> mx.array:
    args = getattr(model, "args", None)
    if getattr(args, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)


def forward(
    model: Any,
    tokens: mx.array,
    cache: list[Any],
    *,
    logits: bool,
    split: bool,
    embeddings: mx.array | None = None,
) -> mx.array | None:
    """Run `tokens` (1, L) through `model` into `cache`; last-position logits if asked
    (`split`: what `split_head_works` said for this model). `embeddings` (1, L, D): the
    tokens' input embeddings, where they are not the embedding table's (an image span)."""
    extra = {} if embeddings is None else {"input_embeddings": embeddings}
    if split:
        hidden = model.model(tokens, cache=cache, **extra)
        return output_head(model, hidden[:, -1:, :])[:, -1, :] if logits else None
    out = model(tokens, cache=cache, **extra)
    return out[:, -1, :] if logits else None


def wrap_attention(module_name: str, marker: str, wrap: Callable[[Any], Any]) -> bool:
    """Replace mlx-lm module `module_name`'s `scaled_dot_product_attention` (the name its
    attention calls, imported from `mlx_lm.models.base`) with `wrap(current)`, once: the
    wrapper is marked with the attribute `marker`. False if the module has no such name."""
    module = importlib.import_module(module_name)
    current = getattr(module, "scaled_dot_product_attention", None)
    if current is None:
        return False
    if not getattr(current, marker, False):
        wrapped = wrap(current)
        setattr(wrapped, marker, True)
        module.scaled_dot_product_attention = wrapped
    return True
