"""Embeddings from a causal LM that mlx-lm loads: what a sentence-transformers directory says
of its pooling (`read_pooling`), and an embedding request's prefill (`EmbedChunks`): each
chunk runs the model's body (`model.model`, its hidden states after the final norm, no
output head) into the request's cache and folds the chunk's hidden states into its pool, so
that a prompt chunked any way gives the same vector; its final chunk gives the vector.

A sentence-transformers directory lists its modules in `modules.json`: the transformer, a
`Pooling` module whose `config.json` names the pooling (`pooling_mode_lasttoken`,
`pooling_mode_mean_tokens`, `pooling_mode_cls_token`) and, optionally, `Normalize`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx

from stepline.actors.scheduler.plan import ScheduledChunk
from stepline.actors.scheduler.work import (
    CHECKPOINT_FAILED,
    PREFILL_FAILED,
    is_collective_error,
)
from stepline.engine.forward import output_head
from stepline.engine.sequences import Seq
from stepline.engine.step_sampling import Fail
from stepline.events.models import EmbedParams

POOLING_MODES = {  # a Pooling config's key -> ours
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens")
NORMALIZE_EPS = 1e-12  # torch.nn.functional.normalize's, which sentence-transformers uses


class EmbeddingModelError(ValueError):
    """A sentence-transformers directory stepline cannot serve as it is meant (a pooling it
    does not compute)."""


def read_pooling(path: Path) -> EmbedParams | None:
    """The pooling a sentence-transformers directory's `modules.json` describes; None for a
    directory without one (a chat model). Raises EmbeddingModelError for a pooling other than
    last-token, mean or CLS, or more than one of them."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    pooling: str | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            config = json.loads((path / module["path"] / "config.json").read_text("utf-8"))
            modes = [ours for key, ours in POOLING_MODES.items() if config.get(key)]
            odd = [key for key in _UNSUPPORTED if config.get(key)]
            if odd or len(modes) != 1:
                raise EmbeddingModelError(
                    f"{path}: its pooling ({', '.join(odd + modes) or 'none'}) is not one "
                    "stepline computes: exactly one of last-token, mean or CLS"
                )
            pooling = modes[0]
        elif kind == "Normalize":
            normalize = True
    if pooling is None:
        return None
    return EmbedParams(pooling=pooling, normalize=normalize)  # type: ignore[arg-type]


@dataclass
class Pool:
    """What an embedding request's chunks so far leave of its hidden states: their sum and
    count (mean), the first token's (CLS), the last token's (last-token)."""

    spec: EmbedParams
    total: mx.array | None = None  # (D,) float32
    count: int = 0

    def add(self, hidden: mx.array, start: int) -> None:
        """Fold one chunk's hidden states (1, L, D), its first at prompt position `start`."""
        h = hidden[0].astype(mx.float32)
        if self.spec.pooling == "mean":
            part = h.sum(axis=0)
            self.total = part if self.total is None else self.total + part
            self.count += h.shape[0]
        elif self.spec.pooling == "cls":
            if start == 0:
                self.total, self.count = h[0], 1
        else:
            self.total, self.count = h[-1], 1

    def vector(self) -> mx.array:
        """The pooled vector, normalised where the model says so."""
        assert self.total is not None and self.count > 0, "no prompt token pooled"
        v = self.total / self.count
        if self.spec.normalize:
            v = v / mx.maximum(mx.linalg.norm(v), NORMALIZE_EPS)
        return v


RERANKER_ANSWERS = ("no", "yes")  # a Qwen3-Reranker's answer tokens, in its score's order


def read_reranker(name: str, path: Path, tokenizer: Any) -> EmbedParams | None:
    """A Qwen3-Reranker-style reranker (its name or directory's says "reranker": its files
    are a plain causal LM's) scores a query and a document by its logits of "no" and "yes"
    at the last token; None for any other model. Each answer is its token (the last of its
    encoding where the vocabulary has no such single token, as the demo's)."""
    if "reranker" not in f"{name} {path.name} {path.parent.parent.name}".lower():
        return None
    ids = []
    for word in RERANKER_ANSWERS:
        token = tokenizer.convert_tokens_to_ids(word)
        if not isinstance(token, int) or token == getattr(tokenizer, "unk_token_id", None):
            token = tokenizer.encode(word, add_special_tokens=False)[-1]
        ids.append(token)
    return EmbedParams(pooling="last", normalize=False, head_tokens=tuple(ids))


def pool_hidden(hidden: mx.array, spec: EmbedParams) -> mx.array:
    """`hidden` (1, L, D), a whole prompt's, pooled as `spec` says (the reference)."""
    pool = Pool(spec)
    pool.add(hidden, 0)
    return pool.vector()


class EmbedChunks:
    """The prefill chunks of embedding requests: the body's forward, pooled; no logits."""

    def __init__(self, checkpoint: Callable[[Seq, int], None]) -> None:
        self.checkpoint = checkpoint

    def run(
        self,
        model: Any,
        chunks: Sequence[ScheduledChunk],
        seqs: Mapping[str, Seq],
        failed: Mapping[str, str],
        fail: Fail,
    ) -> dict[str, tuple[float, ...]]:
        """Each embedding request's chunk of `chunks` through `model`, in order (the others
        are the step's forwards'); the vector of each final one. A fault is its request's."""
        out: dict[str, tuple[float, ...]] = {}
        mine = [
            (c, seqs[c.request_id])
            for c in chunks
            if c.request_id in seqs
            and seqs[c.request_id].params.embed is not None
            and c.request_id not in failed
        ]
        # Whole prompts (no cache before them, none needed after): batched forwards.
        whole = [(c, s) for c, s in mine if c.start == 0 and c.is_final and not c.checkpoints]
        done = self._together(model, whole) if len(whole) > 1 else {}
        out.update(done)
        for chunk, seq in mine:
            rid = chunk.request_id
            if rid in done:
                continue
            try:
                vector = self._chunk(model, seq, chunk)
            except _CheckpointError as exc:
                fail(rid, CHECKPOINT_FAILED, exc.__cause__ or exc)
                continue
            except Exception as exc:
                fail(rid, PREFILL_FAILED, exc)
                continue
            if vector is not None:
                out[rid] = vector
        return out

    def _together(
        self, model: Any, whole: list[tuple[ScheduledChunk, Seq]]
    ) -> dict[str, tuple[float, ...]]:
        """Whole prompts' vectors, in batched forwards of the body without a cache: rows of
        similar lengths padded on the right (a causal model's real tokens never see the
        padding after them), at most `PADDING` more tokens than the rows hold. {} where a
        batch fails: each is then run on its own, where a fault is that request's."""
        out: dict[str, tuple[float, ...]] = {}
        ordered = sorted(whole, key=lambda cs: -cs[0].num_tokens)
        for group in padding_groups(ordered, lambda cs: cs[0].num_tokens):
            longest = group[0][0].num_tokens
            rows = [
                mx.pad(s.prompt[: c.end], (0, longest - c.num_tokens))
                if c.num_tokens < longest
                else s.prompt[: c.end]
                for c, s in group
            ]
            try:
                hidden = model.model(mx.stack(rows))
                vectors = []
                for i, (chunk, seq) in enumerate(group):
                    pool = Pool(seq.params.embed)  # type: ignore[arg-type]
                    pool.add(hidden[i : i + 1, : chunk.num_tokens], 0)
                    vectors.append(self._result(model, seq, pool))
                mx.eval(vectors)
            except Exception as exc:  # each on its own then says whose fault it is
                if is_collective_error(exc):  # a lost rank: nobody's request's
                    raise
                return {}
            for (chunk, _), vector in zip(group, vectors, strict=True):
                out[chunk.request_id] = tuple(vector.tolist())
        return out

    def _result(self, model: Any, seq: Seq, pool: Pool) -> mx.array:
        """A request's result from its pool: its vector, or a reranker's answer logits."""
        assert seq.params.embed is not None
        head = seq.params.embed.head_tokens
        if head:  # a reranker: the answer tokens' logits at the last token
            logits = output_head(model, pool.vector()[None, None, :])[0, 0]
            return logits[mx.array(head)].astype(mx.float32)
        return pool.vector()

    def _chunk(self, model: Any, seq: Seq, chunk: ScheduledChunk) -> tuple[float, ...] | None:
        assert seq.params.embed is not None and seq.cache is not None
        if seq.pool is None:
            seq.pool = Pool(seq.params.embed)
        pool = seq.pool
        pos = chunk.start
        for end in (*chunk.checkpoints, chunk.end):
            if end == pos:
                continue
            hidden = model.model(seq.prompt[None, pos:end], cache=seq.cache)
            pool.add(hidden, pos)
            mx.eval(pool.total, [c.state for c in seq.cache])  # bound the graph per chunk
            if end in chunk.checkpoints:
                try:
                    self.checkpoint(seq, end)
                except Exception as exc:
                    raise _CheckpointError from exc
            pos = end
        if not chunk.is_final:
            return None
        return tuple(self._result(model, seq, pool).tolist())


PADDING = 0.25  # a batch of whole prompts pads at most this share of its tokens (+ 16)

T = TypeVar("T")


def padding_groups(whole: list[T], num_tokens: Callable[[T], int]) -> list[list[T]]:
    """`whole` (longest first) in batches that each pad little: an item joins the batch of the
    longer ones while the batch's padded size stays within `PADDING` of its tokens (+ 16)."""
    groups: list[list[T]] = []
    real = 0
    for item in whole:
        n = num_tokens(item)
        if groups:
            longest = num_tokens(groups[-1][0])
            if longest * (len(groups[-1]) + 1) <= (real + n) * (1 + PADDING) + 16:
                groups[-1].append(item)
                real += n
                continue
        groups.append([item])
        real = n
    return groups


def is_embedding_chunk(chunk: ScheduledChunk, seqs: Mapping[str, Seq]) -> bool:
    seq = seqs.get(chunk.request_id)
    return seq is not None and seq.params.embed is not None


class _CheckpointError(Exception):
    """A checkpoint of an embedding request's chunk failed (its cause says how)."""
