"""One forward for a whole step: prompt chunks and decode rows through the model's weights
once, attention per segment against each request's own cache.

A step's N tokens (each chunk's tokens, then one per decode row) enter the model as N rows
of length 1, so the projections and MLPs run once over all of them: on a model whose
forward is bound by reading its weights, decode rows riding inside a chunk's forward
cost almost nothing. Two seams of mlx-lm make that possible without forking a model:
- each layer gets a `SegmentedCache`: its `offset` is every row's position (an array, as
  mlx-lm's `BatchKVCache` gives rope), and its `update_and_fetch` hands each chunk's rows,
  reshaped to (1, H, L, D), to that request's own cache and the decode rows to the decode
  batch's, each segment's mask made from its own cache just before it takes them, as the
  model's own forward of that segment would make it (causal; a sliding window's, over its
  ring, wrapped or not; the batch's, left padding included);
- the model module's `scaled_dot_product_attention` (imported by name from
  `mlx_lm.models.base`) is wrapped: given a `SegmentedCache` it runs attention per segment
  under that mask and puts the outputs back in row order. Any other cache goes to mlx-lm's
  own function unchanged.
A hybrid model's recurrent layers (Gated DeltaNet, Mamba2, short convolutions) get a
`SegmentedState` instead, and their mixer module's `__call__` is wrapped (`install_mixers`):
it runs once per segment, on that segment's rows, against the segment's own state (a
request's `ArraysCache`, or the decode batch's), as the segment's own forward would. The
projections, MLPs and experts around them still run once over the whole step.
A prompt chunk with checkpoints inside it (`Segment.snapshots`) rides it too: its cache at
each is captured inside the forward (`run`), as a forward that stopped there would leave it:
its recurrent layers' mixers run piece by piece between the snapshots, their state kept
between pieces; its KV layers take the whole chunk, and a copy is cut back afterwards (a
plain or quantized one trimmed; a sliding window's ring, to which a chunk appends in
temporal order, sliced). `snapshot_fused_proof` checks it on the loaded model.

Covered: a model whose layers call mlx-lm's own `scaled_dot_product_attention` (llama,
Qwen2/3, Qwen3-MoE, Phi-3, Ministral, Gemma 3 and 4, gpt-oss, ...; inside a wrapper such as
`mistral3`, its language model's), with KV layers (plain `KVCache`s, quantized ones
(`engine/kv_quant.py`: mlx-lm's attention takes its quantized path on each segment's own
cache) and sliding windows' `RotatingKVCache`s, whose window the model's masks must ask for)
and recurrent ones (Qwen3-Next, Qwen3.5, Nemotron-H, Granite 4.0-H, LFM2).
A prompt chunk holding media tokens (an image's or a clip's span) rides it too where
`media_fused_proof` passes: its rows enter as its input embeddings (every other row as the
embedding table's), at its 3-D M-RoPE positions (`mrope.RowPositions`), with deepstack
features added at its rows only (`Segment.embeddings`, `.positions`, `.deepstack`).
`fused_forward_works` installs the wrappers and proves, on the loaded model itself, that a
fused forward gives the logits of separate ones; anything else (attention of a model's own,
layers that share another layer's keys) runs separate forwards. docs/models.md's table says
which families that proof passes for
(tests/test_families.py keeps it true).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import structlog
from mlx_lm.models import base
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
)

from stepline.engine import mrope
from stepline.engine.forward import (
    Proof,
    body_of,
    evaluated,
    output_head,
    run_to_end,
    wrap_attention,
)
from stepline.engine.kv_quant import BatchQuantizedKVCache, KVQuant, QuantizedKVCache, make_cache
from stepline.engine.prefix_cache import share_cache

log = structlog.get_logger(__name__)

# The function mlx-lm's models import by name and call right after `cache.update_and_fetch`
# (rope at `cache.offset`, the mask from `cache.make_mask`): the seam this module hooks.
MLX_LM_ATTENTION = base.scaled_dot_product_attention


@dataclass(frozen=True)
class Segment:
    """One request's chunk (`tokens` (L,) into its own per-layer caches: `KVCache`s,
    `RotatingKVCache`s), or the decode batch (`tokens` (B,), one per row, into its per-layer
    batch caches)."""

    tokens: mx.array
    cache: list[Any]
    is_batch: bool = False
    # a prompt chunk under 3-D M-RoPE (`engine/mrope.py`): its tokens' positions, (L,) for
    # text (its three sections are one), (3, L) for a chunk with media tokens
    positions: mx.array | None = None
    # a chunk with media tokens: its input embeddings (L, D), the text's with the encoder's
    # features merged in (`VisionEncoder.embeddings`), in place of the embedding table's
    embeddings: mx.array | None = None
    # what the first k text layers add at its rows (k, 1, L, D) (Qwen3-VL's deepstack)
    deepstack: mx.array | None = None
    # a prompt chunk with checkpoints inside it: how many of its tokens each is past its
    # start (0 < k < size, ascending); its cache is snapshotted there (`run`'s `snapshots`)
    snapshots: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


class _Layout:
    """What every layer's `SegmentedCache` shares: the segments' sizes, every row's
    position, and each segment's masks (one a kind of cache: every layer of a kind holds
    the same tokens before the step, so its first layer's mask is every one's)."""

    def __init__(self, segments: Sequence[Segment]):
        self.sizes = [s.size for s in segments]
        self.is_batch = [s.is_batch for s in segments]
        positions = []
        for s in segments:
            # a KV layer's offset: a recurrent layer's state knows no position
            first = next((c for c in s.cache if not isinstance(c, ArraysCache)), s.cache[0])
            if s.is_batch:  # (a 3-D M-RoPE row's delta is in its offset: `mrope.shift_rows`)
                positions.append(first.offset.astype(mx.int32))
            elif s.positions is not None:
                positions.append(s.positions.astype(mx.int32))
            else:
                positions.append(first.offset + mx.arange(s.size, dtype=mx.int32))
        if any(p.ndim == 2 for p in positions):  # a media chunk's 3-D positions: every row's 3
            positions = [
                p if p.ndim == 2 else mx.broadcast_to(p, (3, p.shape[0])) for p in positions
            ]
            self.positions: Any = mrope.RowPositions(mx.concatenate(positions, axis=1))
        else:
            self.positions = mx.concatenate(positions)
        self.deepstack = _deepstack(segments)
        self.snapshots = [s.snapshots for s in segments]
        self._masks: dict[tuple[int, type, int | None], Any] = {}

    def mask(self, i: int, cache: Any) -> Any:
        """Segment `i`'s mask against `cache` (one of its layers', before it takes the
        segment's tokens), as the segment's own forward makes it: the batch's (left padding,
        a window's ring), a window's, or causal."""
        key = (i, type(cache), getattr(cache, "max_size", None))
        if key not in self._masks:
            size = self.sizes[i]
            if self.is_batch[i]:
                self._masks[key] = cache.make_mask(1)
            elif type(cache) is RotatingKVCache:
                self._masks[key] = cache.make_mask(size, window_size=cache.max_size)
            else:
                self._masks[key] = None if size == 1 else "causal"
        return self._masks[key]


def _deepstack(segments: Sequence[Segment]) -> mx.array | None:
    """(k, N, 1, D): what the first k text layers add at each row of the step (zero but at a
    media chunk's, `Segment.deepstack`); None where no segment has any."""
    given = [s.deepstack for s in segments if s.deepstack is not None]
    if not given:
        return None
    k, _, _, dim = given[0].shape
    pieces = [
        mx.zeros((k, s.size, 1, dim), dtype=given[0].dtype)
        if s.deepstack is None
        else s.deepstack.swapaxes(1, 2)
        for s in segments
    ]
    return mx.concatenate(pieces, axis=1)


class SegmentedCache:
    """One layer's view of a fused step (see the module docstring). Lives for one forward."""

    def __init__(self, layout: _Layout, caches: list[Any]):
        self.layout = layout
        self.caches = caches  # this layer's cache of each segment
        self.fetched: list[tuple[mx.array, mx.array]] = []
        self.masks: list[Any] = []  # each segment's attention mask (`_Layout.mask`)

    @property
    def offset(self) -> Any:  # (N,) positions, or a media step's `mrope.RowPositions`
        return self.layout.positions

    @property
    def deepstack(self) -> mx.array | None:  # what `mrope.Deepstack` layers add, per row
        return self.layout.deepstack

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):  # noqa: N803 - mlx-lm's name
        """None: each segment's mask is its own cache's (`update_and_fetch`). Raises
        ValueError where the model asks for a window its caches do not keep (their own masks
        would not be the model's)."""
        if window_size is not None and not all(
            type(c) in _WINDOWED and c.max_size == window_size for c in self.caches
        ):
            raise ValueError(f"a {window_size}-token window over caches that do not keep it")
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start = 0
        self.fetched, self.masks = [], []
        layout = self.layout
        for i, (size, is_batch, cache) in enumerate(
            zip(layout.sizes, layout.is_batch, self.caches, strict=True)
        ):
            k, v = keys[start : start + size], values[start : start + size]
            if not is_batch:  # (L, H, 1, D) rows -> one sequence (1, H, L, D)
                k, v = k.swapaxes(0, 2), v.swapaxes(0, 2)
            self.masks.append(layout.mask(i, cache))
            self.fetched.append(cache.update_and_fetch(k, v))
            start += size
        return keys, values  # unused: the attention reads `fetched`


# Caches of a sliding window (a ring of its last keys), a request's own and a batch's.
_WINDOWED = (RotatingKVCache, BatchRotatingKVCache)


class SegmentedState:
    """One recurrent layer's view of a fused step: each segment's own state (a request's
    `ArraysCache`, or the decode batch's, one row a request). Its mixer (Gated DeltaNet,
    Mamba2, a short convolution: `install_mixers`) runs once per segment against it, on that
    segment's rows, as the segment's own forward would run it. Lives for one forward."""

    def __init__(self, layout: _Layout, caches: list[Any]):
        self.layout = layout
        self.caches = caches
        # segment -> its state at each of its snapshots (`Segment.snapshots`), in order
        self.captured: dict[int, list[Any]] = {}

    def make_mask(self, N: int) -> None:  # noqa: N803 - mlx-lm's name
        """None: each segment's mask is its own state's (`_wrap_mixer`)."""
        return None


def _wrap_mixer(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def __call__(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if not isinstance(cache, SegmentedState):
            return original(self, x, mask, cache)
        layout, outs, start = cache.layout, [], 0
        segments = zip(layout.sizes, layout.is_batch, cache.caches, strict=True)
        for i, (size, is_batch, state) in enumerate(segments):
            if is_batch:
                outs.append(original(self, x[start : start + size], state.make_mask(1), state))
                start += size
                continue
            # a chunk runs piece by piece between its snapshots, each piece's state kept
            edges = (0, *layout.snapshots[i], size)
            for a, b in zip(edges, edges[1:], strict=False):
                rows = x[start + a : start + b].swapaxes(0, 1)  # (L, 1, D) -> (1, L, D)
                out = original(self, rows, state.make_mask(rows.shape[1]), state)
                outs.append(out.swapaxes(0, 1))
                if b < size:
                    cache.captured.setdefault(i, []).append(share_cache([state])[0])
            start += size
        return mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]

    __call__.__wrapped__ = original  # type: ignore[attr-defined]
    return __call__


def install_mixers(model: Any) -> bool:
    """Wrap the `__call__` of the recurrent mixers of `model`'s body (once a class): in each
    decoder layer whose cache is recurrent state, the one child module called with the cache
    (`linear_attn`, `mixer`, `conv`, ...). False where a recurrent layer has no such child,
    or several."""
    inner = body_of(model)
    layers = getattr(inner, "layers", None)
    if not layers:
        return False
    caches = make_cache(model, None)
    for layer, cache in zip(layers, caches, strict=False):
        if not isinstance(cache, ArraysCache):
            continue
        takers = [
            child
            for _, child in layer.children().items()
            if callable(child) and "cache" in _parameters(type(child).__call__)
        ]
        if len(takers) != 1:
            return False
        cls = type(takers[0])
        if not getattr(cls.__call__, "__wrapped__", None):
            cls.__call__ = _wrap_mixer(cls.__call__)
    return True


def _parameters(fn: Callable[..., Any]) -> tuple[str, ...]:
    code = getattr(fn, "__code__", None)
    return code.co_varnames[: code.co_argcount] if code is not None else ()


def _wrap(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, **kwargs):
        if not isinstance(cache, SegmentedCache):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
        layout, outs, start = cache.layout, [], 0
        for i, (k, v) in enumerate(cache.fetched):
            size, is_batch = layout.sizes[i], layout.is_batch[i]
            q = queries[start : start + size]
            if not is_batch:
                q = q.swapaxes(0, 2)
            out = original(
                q, k, v, cache=cache.caches[i], scale=scale, mask=cache.masks[i], **kwargs
            )
            outs.append(out if is_batch else out.swapaxes(0, 2))
            start += size
        return mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]

    return scaled_dot_product_attention


def install(module_name: str) -> bool:
    """Wrap `module_name`'s attention function (once); False if the module does not call
    mlx-lm's own (wrapped by stepline or not) by its name."""
    if not module_name.startswith("mlx_lm.models."):
        return False
    module = importlib.import_module(module_name)
    current = getattr(module, "scaled_dot_product_attention", None)
    while current is not None and current is not MLX_LM_ATTENTION:
        current = getattr(current, "__wrapped__", None)  # inside stepline's wrappers
    return current is not None and wrap_attention(module_name, "stepline_fused", _wrap)


def install_attention(inner: Any) -> bool:
    """`install` in the body's own module and in each module its layers' classes come from
    (Qwen3.5's attention is Qwen3-Next's); False where none calls mlx-lm's attention."""
    modules = {type(inner).__module__} | {type(m).__module__ for _, m in inner.named_modules()}
    return any([install(name) for name in sorted(modules)])


def body(model: Any, segments: Sequence[Segment]) -> mx.array:
    """Run every segment's tokens through `model`'s body (`forward.body_of`) in one forward,
    into their caches: the hidden states (N, 1, D), one row per token, in segment order."""
    return _body(model, segments)[0]


def _body(model: Any, segments: Sequence[Segment]) -> tuple[mx.array, list[Any]]:
    """`body`, and each layer's view of the step (a `SegmentedCache` or `SegmentedState`)."""
    layout = _Layout(segments)
    layers = zip(*(s.cache for s in segments), strict=True)
    caches = [
        (SegmentedState if isinstance(layer[0], ArraysCache) else SegmentedCache)(
            layout, list(layer)
        )
        for layer in layers
    ]
    tokens = mx.concatenate([s.tokens for s in segments]).astype(mx.int32)[:, None]
    inner = body_of(model)
    if all(s.embeddings is None for s in segments):
        return inner(tokens, cache=caches), caches
    # a media chunk's rows enter as its embeddings, every other row as the table's
    table = inner.embed_tokens
    embeddings = [
        table(s.tokens.astype(mx.int32)) if s.embeddings is None else s.embeddings for s in segments
    ]
    hidden = inner(tokens, cache=caches, input_embeddings=mx.concatenate(embeddings)[:, None])
    return hidden, caches


@dataclass(frozen=True)
class Fused:
    """What one fused forward gave (`run`)."""

    logits: list[mx.array | None]  # each segment's logits of the rows asked for, or None
    # each segment's caches at its snapshots: {k: its per-layer cache after its first k tokens}
    snapshots: list[dict[int, list[Any]]]


def forward(
    model: Any, segments: Sequence[Segment], rows: Sequence[Sequence[int]]
) -> list[mx.array | None]:
    """`run`'s logits."""
    return run(model, segments, rows).logits


def run(model: Any, segments: Sequence[Segment], rows: Sequence[Sequence[int]]) -> Fused:
    """`body`, then for each segment the logits (len(rows[i]), V) of its rows `rows[i]`
    (None where it wants none): the output head runs on those rows only (the body and the
    head split as `forward.split_head_works` checks); and each segment's cache at each of
    its `snapshots`, as a forward that stopped there would leave it (lazy, caches of their
    own): a recurrent layer's state as it was between the pieces its mixer ran
    (`_wrap_mixer`), a KV layer's cut back from where the step left it (`_cut_back`)."""
    hidden, layers = _body(model, segments)
    wanted, start = [], 0
    for s, r in zip(segments, rows, strict=True):
        wanted.extend(start + i for i in r)
        start += s.size
    logits = output_head(model, hidden[mx.array(wanted)])[:, -1, :] if wanted else None
    out: list[mx.array | None] = []
    start = 0
    for r in rows:
        out.append(logits[start : start + len(r)] if r and logits is not None else None)
        start += len(r)
    return Fused(out, _snapshots(segments, layers))


def _snapshots(segments: Sequence[Segment], layers: list[Any]) -> list[dict[int, list[Any]]]:
    """Each segment's caches at its snapshots, after `_body` ran them (`layers`: its views)."""
    out = []
    for i, s in enumerate(segments):
        taken: dict[int, list[Any]] = {}
        for j, k in enumerate(s.snapshots):
            taken[k] = [
                layer.captured[i][j]
                if isinstance(layer, SegmentedState)
                else _cut_back(layer.caches[i], s.size - k)
                for layer in layers
            ]
        out.append(taken)
    return out


def _cut_back(layer: Any, n: int) -> Any:
    """A copy of KV layer `layer` as it was `n` tokens before the step's chunk ended: a plain
    or quantized one trimmed; a window's ring with its last `n` keys sliced off (a chunk of
    more than one token is appended to the ring in temporal order, after what it kept:
    mlx-lm's `RotatingKVCache._update_concat`, so the ring of a forward that stopped there
    is a prefix of it)."""
    (copy,) = share_cache([layer])
    if type(layer) is RotatingKVCache:
        kept = layer.keys.shape[2] - n
        copy.keys, copy.values = layer.keys[..., :kept, :], layer.values[..., :kept, :]
        copy.offset, copy._idx = layer.offset - n, kept
    else:
        copy.trim(n)
    return copy


def can_fuse(cache: list[Any], is_batch: bool) -> bool:
    """Whether a segment's cache is one a fused forward handles: KV layers, plain, quantized
    or of a sliding window, and recurrent state (each segment's own, `SegmentedState`)."""
    kinds = _BATCH_KINDS if is_batch else _OWN_KINDS
    return bool(cache) and all(type(layer) in kinds for layer in cache)


# The KV layers a fused forward takes: a request's own, and the decode batch's.
_OWN_KINDS = (KVCache, RotatingKVCache, QuantizedKVCache, ArraysCache)
_BATCH_KINDS = (BatchKVCache, BatchRotatingKVCache, BatchQuantizedKVCache, ArraysCache)


def fused_forward_works(model: Any, kv: KVQuant | None = None) -> bool:
    """Install the attention wrapper for `model`'s architecture and check, on the model
    itself, that one fused forward (a decode batch of two rows of different lengths, so
    left padding, beside a two-token chunk) gives the hidden states of separate forwards,
    over the caches `kv` makes (`kv_quant.make_cache`). Four forwards of a few tokens, one
    prompt's cache shared by every request. False (and separate forwards) for anything
    else."""
    return bool(run_to_end(fused_forward_proof(model, kv)))


def fused_forward_proof(model: Any, kv: KVQuant | None = None) -> Proof:
    """`fused_forward_works`, a few layers at a time (`forward.Proof`)."""
    inner = body_of(model)
    if inner is None or not install_attention(inner):
        return False
    try:
        prompt = make_cache(model, kv)
        if not can_fuse(prompt, is_batch=False):
            return False
        recurrent = any(isinstance(layer, ArraysCache) for layer in prompt)
        if recurrent and not install_mixers(model):
            return False
        tokens = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
        yield from evaluated(model, inner(tokens, cache=prompt), prompt)

        def at(num_tokens: int) -> list[Any]:  # the prompt's first tokens, a cache of its own
            return _prefix_cache(model, kv, inner, tokens, prompt, num_tokens, recurrent)

        def batch() -> list[Any]:  # rows of 8 and 3 tokens
            return _two_rows(at)

        last, chunk = mx.array([9, 10]), mx.array([11, 12, 13])
        rows = batch()
        want_rows = inner(last[:, None], cache=rows)[:, -1, :]
        yield from evaluated(model, want_rows, rows)
        own = at(5)
        want_chunk = inner(chunk[None], cache=own)[0]
        yield from evaluated(model, want_chunk, own)
        segments = [Segment(chunk, at(5)), Segment(last, batch(), is_batch=True)]
        got = body(model, segments)
        yield from evaluated(model, got, *(s.cache for s in segments))
        return _close(got[:3, -1, :], want_chunk) and _close(got[3:, -1, :], want_rows)
    except Exception as exc:  # noqa: BLE001 - whatever fails here: separate forwards
        log.info("fused_forward_unavailable", reason=repr(exc))
        return False


def snapshot_fused_works(model: Any, kv: KVQuant | None = None) -> bool:
    """Whether a prompt chunk with a checkpoint inside it rides a fused forward on `model`
    (one whose plain fused forward is proven, `fused_forward_proof`): `snapshot_fused_proof`,
    every forward at once."""
    return bool(run_to_end(snapshot_fused_proof(model, kv)))


def snapshot_fused_proof(model: Any, kv: KVQuant | None = None) -> Proof:
    """A four-token chunk with a snapshot after its second token (`Segment.snapshots`),
    beside a decode batch of two rows, in one fused forward: the chunk's hidden states are
    those of its two pieces' own forwards (as `step.Forwards.prefill` runs a chunk split at
    its checkpoints), the batch's its own forward's, and the snapshot and the cache the
    chunk ends with each give the next token's hidden states of the caches those forwards
    leave. A few layers at a time (`forward.Proof`); False where any differs."""
    inner = body_of(model)
    if inner is None or not install_attention(inner):
        return False
    try:
        prompt = make_cache(model, kv)
        recurrent = any(isinstance(layer, ArraysCache) for layer in prompt)
        if recurrent and not install_mixers(model):
            return False
        tokens = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
        yield from evaluated(model, inner(tokens, cache=prompt), prompt)

        def at(num_tokens: int) -> list[Any]:  # the prompt's first tokens, a cache of its own
            return _prefix_cache(model, kv, inner, tokens, prompt, num_tokens, recurrent)

        last, chunk, nxt = mx.array([9, 10]), mx.array([11, 12, 13, 14]), mx.array([[15]])
        rows = _two_rows(at)
        want_rows = inner(last[:, None], cache=rows)[:, -1, :]
        yield from evaluated(model, want_rows, rows)
        own = at(5)
        first = inner(chunk[None, :2], cache=own)[0]
        yield from evaluated(model, (first, [c.state for c in own]), own)
        stopped = share_cache(own)  # the cache a forward that stopped at the checkpoint left
        rest = inner(chunk[None, 2:], cache=own)[0]
        want_chunk = mx.concatenate([first, rest])
        want_stopped = inner(nxt, cache=stopped)[0]
        want_end = inner(nxt, cache=own)[0]
        yield from evaluated(model, (want_chunk, want_stopped, want_end), own, stopped)
        segments = [Segment(chunk, at(5), snapshots=(2,)), Segment(last, _two_rows(at), True)]
        hidden, layers = _body(model, segments)
        snapshot = _snapshots(segments, layers)[0][2]
        yield from evaluated(model, hidden, *(s.cache for s in segments))
        got_stopped, got_end = inner(nxt, cache=snapshot)[0], inner(nxt, cache=segments[0].cache)[0]
        yield from evaluated(model, (got_stopped, got_end), snapshot, segments[0].cache)
        return (
            _close(hidden[:4, -1, :], want_chunk)
            and _close(hidden[4:, -1, :], want_rows)
            and _close(got_stopped, want_stopped)
            and _close(got_end, want_end)
        )
    except Exception as exc:  # noqa: BLE001 - whatever fails here: such chunks run apart
        log.info("fused_snapshot_unavailable", reason=repr(exc))
        return False


def _prefix_cache(
    model: Any,
    kv: Any,
    inner: Any,
    tokens: mx.array,
    prompt: list[Any],
    num_tokens: int,
    recurrent: bool,
) -> list[Any]:
    """A proof's cache of `prompt`'s first `num_tokens` tokens, its own: cut back from the
    prompt's, or where a recurrent state cannot be cut back, the prompt's start forwarded
    anew."""
    if recurrent:
        cache = make_cache(model, kv)
        inner(tokens[:, :num_tokens], cache=cache)
        return cache
    return _trimmed(prompt, num_tokens)


def _trimmed(prompt: list[Any], num_tokens: int) -> list[Any]:
    """A proof's prompt cache cut to its first `num_tokens`, a cache of its own."""
    cache = share_cache(prompt)
    for layer in cache:
        layer.trim(layer.offset - num_tokens)
    return cache


def _two_rows(at: Callable[[int], list[Any]]) -> list[Any]:
    """A proof's decode batch: rows of the prompt's first 8 and first 3 tokens."""
    return [type(r[0]).merge(list(r)) for r in zip(at(8), at(3), strict=True)]


def media_fused_proof(model: Any, kv: KVQuant | None = None) -> Proof:
    """Whether a prompt chunk with media tokens rides a fused forward on `model` (one whose
    plain fused forward is proven, `fused_forward_proof`): a three-token chunk entering as
    input embeddings that are not the table's, at 3-D positions whose sections differ where
    the model's rope is M-RoPE (`mrope.MRope`), with deepstack features where its first
    layers add them (`mrope.Deepstack`), beside a decode batch of two rows, gives the
    hidden states of its own forward (`forward.forward`'s, over `mrope.positioned` caches)
    and of the batch's. A few layers at a time (`forward.Proof`); False where it does not."""
    inner = body_of(model)
    try:
        layers = list(inner.layers)
        is_mrope = any(
            isinstance(getattr(getattr(x, "self_attn", None), "rope", None), mrope.MRope)
            or isinstance(x, mrope.Deepstack)
            for x in layers
        )
        stacked = sum(isinstance(x, mrope.Deepstack) for x in layers)
        prompt = make_cache(model, kv)
        if any(isinstance(layer, ArraysCache) for layer in prompt):
            return False  # (a recurrent model's media chunks run on their own)
        tokens = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
        yield from evaluated(model, inner(tokens, cache=prompt), prompt)

        def at(num_tokens: int) -> list[Any]:
            return _trimmed(prompt, num_tokens)

        def batch() -> list[Any]:  # rows of 8 and 3 tokens
            return _two_rows(at)

        last, chunk = mx.array([9, 10]), mx.array([11, 12, 13])
        table = inner.embed_tokens(mx.array([[21, 22, 23]]))
        embeddings = table[:, ::-1] * 0.5  # (1, 3, D), none of them a token's own
        positions = mx.array([[5, 6, 6], [5, 6, 7], [5, 7, 6]]) if is_mrope else None
        deepstack = mx.stack([table * (0.1 * (i + 1)) for i in range(stacked)]) if stacked else None
        rows = batch()
        want_rows = inner(last[:, None], cache=rows)[:, -1, :]
        yield from evaluated(model, want_rows, rows)
        own = at(5) if positions is None else mrope.positioned(at(5), positions, deepstack)
        want_chunk = inner(chunk[None], cache=own, input_embeddings=embeddings)[0]
        yield from evaluated(model, want_chunk, own)
        media = Segment(
            chunk, at(5), positions=positions, embeddings=embeddings[0], deepstack=deepstack
        )
        segments = [media, Segment(last, batch(), is_batch=True)]
        got = body(model, segments)
        yield from evaluated(model, got, *(s.cache for s in segments))
        return _close(got[:3, -1, :], want_chunk) and _close(got[3:, -1, :], want_rows)
    except Exception as exc:  # noqa: BLE001 - whatever fails here: media chunks run apart
        log.info("fused_media_unavailable", reason=repr(exc))
        return False


def _close(got: mx.array, want: mx.array) -> bool:
    """Equal up to rounding (matrices of other shapes round differently): within a few
    units in the last place of the dtype at the states' scale, and no looser than 1e-4.
    A wrong position or mask moves them by far more."""
    diff = float(mx.abs(got - want).max().item())
    eps = max(1e-4, 8 * float(mx.finfo(want.dtype).eps))
    ok = diff <= eps * (1.0 + float(mx.abs(want).max().item()))
    if not ok:
        log.info("fused_forward_mismatch", max_diff=diff)
    return ok
