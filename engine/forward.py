"""Forward passes of an mlx-lm model for prefill chunks: the vocabulary projection only
where logits are wanted (the last position of a final chunk), when the architecture allows
splitting the model's body from its output head.

Where the two live differs by family, and `text_model`, `body_of` and `output_head` find
them as mlx-lm's `__call__`s lay them out: the text model is the model itself or the
language model a wrapper holds (`language_model`: Qwen3.5/3.6, `mistral3`, Gemma 3's and
4's multimodal classes); its body is at `.model`, `.backbone` (Nemotron-H, Mamba) or
`.transformer`; its head is `lm_head` or the tied embedding table, then Gemma's
`final_logit_softcapping` (tanh capping), Granite's `logits_scaling` (a division) or
Cohere's `logit_scale` (a product).
`split_head_works` proves, on the loaded model, that body and head give `model(...)`'s
logits; any architecture laid out otherwise runs the full model.

A proof on a model loading beside others runs a job at a time on the one executor thread
(`Proof`): `evaluated` computes a forward's arrays a few layers a job, so that the other
models' steps run between them (a whole forward of SmolLM2 took ~0.5 s of one job).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Generator
from typing import Any

import mlx.core as mx
import structlog
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

log = structlog.get_logger(__name__)


# Where mlx-lm's text models keep their body, and their tied embedding table in it.
BODY_NAMES = ("model", "backbone", "transformer")
EMBEDDING_NAMES = ("embed_tokens", "embeddings", "embedding", "wte", "word_embeddings")
MAX_WRAPPERS = 3  # `language_model`s looked through to find the text model
# A proof's forward is computed about this many bytes of layer weights a step (`evaluated`):
# a few tokens' forward reads each weight once (SmolLM2 in float32: 2 of its 30 layers, ~20-50
# ms on a 2-core CPU).
FORWARD_PIECE_BYTES = 32 * 2**20


def text_model(model: Any) -> Any:
    """The module whose body and head make `model`'s logits: `model`, or the language model
    it wraps (each `language_model` in turn, a few at most)."""
    for _ in range(MAX_WRAPPERS):
        inner = getattr(model, "language_model", None)
        if inner is None or not callable(inner):
            break
        model = inner
    return model


def body_of(model: Any) -> Any:
    """`model`'s body: tokens (B, L) and a cache in, the final hidden states (B, L, D) out,
    as its text model calls it; None where it has none by a known name."""
    text = text_model(model)
    for name in BODY_NAMES:
        body = getattr(text, name, None)
        if body is not None and callable(body):
            return body
    return None


def split_head_works(model: Any) -> bool:
    """Whether `body_of(model)` + `output_head` reproduce `model(...)` for this architecture.

    If they do, prefill chunks skip the vocabulary projection for every position but the
    last one needed; otherwise `forward` runs the full model.
    """
    return bool(run_to_end(split_head_proof(model)))


def split_head_proof(model: Any) -> Proof:
    """`split_head_works`, a few layers of a forward at a time (`evaluated`): it pauses
    (yields) after each, so that a caller may run other work between them (a model loading
    beside others)."""
    body = body_of(model)
    if body is None:
        return False
    try:
        tokens = mx.array([[1, 2, 3, 4]])
        cache = make_prompt_cache(model)
        full = model(tokens, cache=cache)[:, -1, :]
        yield from evaluated(model, full, cache)
        cache = make_prompt_cache(model)
        split = output_head(model, body(tokens, cache=cache)[:, -1:, :])
        yield from evaluated(model, split, cache)
        if split.shape[1:] != (1, full.shape[-1]):
            raise ValueError(f"the head gives {split.shape}, the model {full.shape}")
        return bool(mx.allclose(full, split[:, -1, :], atol=1e-4, rtol=1e-4).item())
    except Exception as exc:  # noqa: BLE001 - any mismatch means: use the full forward
        log.info("split_head_unavailable", reason=repr(exc))
        return False


# A check run a step at a time (a few layers of a forward: `evaluated`): it yields after
# each and returns its answer.
Proof = Generator[None, None, bool]


def evaluated(model: Any, out: Any, *caches: list[Any]) -> Generator[None, None, None]:
    """Compute `out`, the arrays that forwards of `model` into `caches` (each a cache per
    layer) built lazily, a few layers a step (it yields after each): the caches' next layers'
    states (a layer's keys need every layer before it), about `FORWARD_PIECE_BYTES` of the
    layers' weights a step for each cache (a forward each), then `out` (the last layers' rest
    and the head). The same arrays as `mx.eval(out)` computes, the same values: only the
    order of their evaluation differs."""
    num_layers = min((len(cache) for cache in caches), default=0)
    piece_bytes = FORWARD_PIECE_BYTES // max(len(caches), 1)
    for group in layer_groups(model, num_layers, piece_bytes):
        mx.eval([[cache[i].state for cache in caches] for i in group])
        yield
    mx.eval(out)
    yield


def layer_groups(model: Any, num_layers: int, piece_bytes: int) -> list[range]:
    """Layers 0 to `num_layers` - 1 in runs of about `piece_bytes` of their weights each (one
    layer at least): the body's own layers' bytes where it has that many, else an even share
    of all the model's weights."""
    layers = getattr(body_of(model), "layers", None)
    if isinstance(layers, list) and len(layers) == num_layers:
        sizes = [_bytes(layer) for layer in layers]
    else:
        sizes = [_bytes(model) // max(num_layers, 1)] * num_layers
    groups: list[range] = []
    start = size = 0
    for i, n in enumerate(sizes):
        if i > start and size + n > piece_bytes:
            groups.append(range(start, i))
            start, size = i, 0
        size += n
    if start < num_layers:
        groups.append(range(start, num_layers))
    return groups


def _bytes(module: Any) -> int:
    return sum(a.nbytes for _, a in tree_flatten(module.parameters()))


def run_to_end(steps: Generator[None, None, Any]) -> Any:
    """What a generator of steps (a `Proof`) returns, every step at once."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def output_head(model: Any, hidden: mx.array) -> mx.array:
    """The logits of the hidden states `hidden` (B, L, D) of `model`'s body: its text
    model's `lm_head` (or tied embedding table), soft-capped or scaled as the text model's
    own `__call__` does (see the module docstring)."""
    text = text_model(model)
    args = getattr(text, "args", None)
    tied = getattr(text, "tie_word_embeddings", None)  # Gemma's, set where weights load
    if tied is None:
        tied = getattr(args, "tie_word_embeddings", False)
    if tied or not hasattr(text, "lm_head"):
        out = _embedding(body_of(model)).as_linear(hidden)
    else:
        out = text.lm_head(hidden)
    cap = getattr(text, "final_logit_softcapping", None)
    if cap is None:
        cap = getattr(args, "final_logit_softcapping", None)
    if cap:
        out = mx.tanh(out / cap) * cap
    scaling = getattr(text, "logits_scaling", None)
    if scaling:
        out = out / scaling
    scale = getattr(args, "logit_scale", None)  # Cohere's
    if scale:
        out = out * scale
    return out


def _embedding(body: Any) -> Any:
    for name in EMBEDDING_NAMES:
        table = getattr(body, name, None)
        if table is not None and hasattr(table, "as_linear"):
            return table
    raise AttributeError(f"{type(body).__name__} has no tied embedding table by a known name")


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
        hidden = body_of(model)(tokens, cache=cache, **extra)
        return output_head(model, hidden[:, -1:, :])[:, -1, :] if logits else None
    out = model(tokens, cache=cache, **extra)
    return out[:, -1, :] if logits else None


def wrap_attention(module_name: str, marker: str, wrap: Callable[[Any], Any]) -> bool:
    """Replace mlx-lm module `module_name`'s `scaled_dot_product_attention` (the name its
    attention calls, imported from `mlx_lm.models.base`) with `wrap(current)`, once: the
    wrapper keeps `marker` as `stepline_marker` and `current` as `__wrapped__`, so wrappers
    of other markers may go around it. False if the module has no such name."""
    module = importlib.import_module(module_name)
    current = getattr(module, "scaled_dot_product_attention", None)
    if current is None:
        return False
    if marker not in wrappers(current):
        wrapped = wrap(current)
        wrapped.stepline_marker = marker
        wrapped.__wrapped__ = current
        module.scaled_dot_product_attention = wrapped
    return True


def wrappers(attention: Any) -> tuple[str, ...]:
    """The markers of the stepline wrappers around `attention` (`wrap_attention`), outermost
    first; a function wrapped by none has none."""
    found = []
    while attention is not None:
        marker = getattr(attention, "stepline_marker", None)
        found += [marker] if marker else []
        attention = getattr(attention, "__wrapped__", None)
    return tuple(found)
