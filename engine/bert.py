"""BERT-family embedding models (non-causal encoders: BERT, XLM-RoBERTa) in the
sentence-transformers layout, through `mlx-embeddings` (the `bert` extra).

Every token of an encoder's input attends to every other, so its prompt cannot be split
into chunks and has no KV cache to carry between steps: each request is one atomic chunk
(`EmbedParams.whole`; the scheduler defers it to a step that holds it whole, as it does an
image's whole span). `EncoderRunner` is such a model's runner: each step it runs the step's
whole prompts in batched forwards (rows padded on the right, masked), pools each row's hidden
states as the directory's `1_Pooling` says over its own tokens only, and normalises where
`Normalize` is listed, as sentence-transformers computes.

The input limit is sentence-transformers' own: `max_seq_length` of
`sentence_bert_config.json`, else the positions the model has (XLM-RoBERTa's less its padding
offset). `LoadedModel.max_context` is that plus one, since the scheduler's rule for every
prompt (it leaves room for one token) then admits exactly that many.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import structlog

from stepline.actors.scheduler.plan import ScheduledChunk
from stepline.actors.scheduler.work import (
    ADMISSION_FAILED,
    PREFILL_FAILED,
    Housekeeping,
    StepResult,
    StepWork,
)
from stepline.engine.embed import EmbeddingModelError, Pool, padding_groups, read_pooling
from stepline.engine.memory import read_memory_counters
from stepline.events.models import EmbedParams

# config.json's model_types served through mlx-embeddings (tested: tests/test_bert.py)
ENCODER_TYPES = ("bert", "xlm-roberta")
log = structlog.get_logger(__name__)
EXTRA_HINT = "install stepline[bert] (pip install 'stepline[bert]'), which brings mlx-embeddings"


class ExtraMissingError(ImportError):
    """A model that needs an optional extra that is not installed; the message names it."""


def is_encoder(config: Mapping[str, Any]) -> bool:
    """Whether a config.json is a BERT-family encoder's (served through mlx-embeddings)."""
    return str(config.get("model_type", "")) in ENCODER_TYPES


def input_limit(path: Path, config: Mapping[str, Any]) -> int:
    """The most tokens an input of the encoder at `path` may have (see the module's doc)."""
    positions = int(config.get("max_position_embeddings") or 512)
    if config["model_type"] == "xlm-roberta":  # its positions count from its pad id + 1
        positions -= int(config.get("pad_token_id", 1)) + 1
    st_config = path / "sentence_bert_config.json"
    if st_config.is_file():
        most = json.loads(st_config.read_text(encoding="utf-8")).get("max_seq_length")
        if isinstance(most, int) and most > 0:
            return min(most, positions)
    return positions


class EncoderModel(nn.Module):
    """An mlx-embeddings encoder, as stepline calls it: `hidden` of a batch of padded rows.
    `args` has what the doors read of a model (`hidden_size`, `vocab_size`)."""

    def __init__(self, encoder: nn.Module, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.encoder = encoder
        self.args = encoder.config
        # the id padded rows are filled with: XLM-RoBERTa's positions skip it
        self.pad_id = int(config.get("pad_token_id") or 0)

    def hidden(self, ids: mx.array, mask: mx.array) -> mx.array:
        """The last hidden states (B, L, D) of `ids` (B, L), `mask` 1 at each real token."""
        return self.encoder(ids, attention_mask=mask).last_hidden_state


def load_encoder(
    path: Path, name: str, config: Mapping[str, Any], fit: Any, lazy: bool, tokenizer: Any
) -> dict[str, Any]:
    """The parts of a `LoadedModel` of the encoder at `path` (`fit`: casts the weights, as
    `models.fit_dtype`). Raises ExtraMissingError without mlx-embeddings, EmbeddingModelError
    for a directory that is not a sentence-transformers one (no pooling to compute)."""
    spec = read_pooling(path)
    if spec is None:
        raise EmbeddingModelError(
            f"{name!r} is a {config.get('model_type')} encoder without sentence-transformers "
            "files (modules.json and 1_Pooling/config.json): stepline serves such models as "
            "embedding models only, pooled as those files say"
        )
    try:
        from mlx_embeddings.utils import load_model as load_weights
    except ImportError as exc:
        raise ExtraMissingError(
            f"{name!r} is a {config.get('model_type')} model, served through mlx-embeddings: "
            f"{EXTRA_HINT}"
        ) from exc
    if tokenizer is None:
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(path)
    encoder = load_weights(path, lazy=lazy)  # in eval mode: no dropout
    model = EncoderModel(encoder, config)
    return {
        "model": model,
        "tokenizer": tokenizer,
        "max_context": input_limit(path, config) + 1,
        "weights": fit(model),
        "embedding": spec.model_copy(update={"whole": True}),
    }


@dataclass
class _Row:
    """A request the runner has been given: its prompt and how it pools."""

    prompt: tuple[int, ...]
    spec: EmbedParams


class EncoderRunner:
    """The runner of an encoder model (see the module's doc): the verbs of `ModelRunner` the
    step loop and the engine call, for requests that are embeddings only. No prefix cache,
    no decode batch, no drafts, no adapters."""

    store = None  # no prefix cache: a prompt's every token sees the tokens after it
    exact_prefixes = False
    fuse = False
    kv = None

    def __init__(self, loaded: Any) -> None:
        from stepline.engine.grammar import GrammarCompiler

        self.loaded = loaded
        self.model: EncoderModel = loaded.model
        self._rows: dict[str, _Row] = {}
        # the engine reads one (its constrained requests'); an encoder serves none
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.vocab_size)

    def run(self, work: StepWork) -> StepResult:
        """The step's whole prompts, pooled. A fault of a batch's forward is found out per
        request (each alone) and is that request's."""
        t0 = time.perf_counter()
        self._free(work.free)
        failed: dict[str, str] = {}
        for new in work.admit:
            if new.params.embed is None or not new.params.embed.whole:
                failed[new.request_id] = f"{ADMISSION_FAILED}: an encoder only embeds"
                continue
            self._rows[new.request_id] = _Row(new.prompt_token_ids, new.params.embed)
        chunks = [c for c in work.plan.chunks if c.request_id in self._rows]
        for c in chunks:
            if not (c.start == 0 and c.is_final):  # the policy keeps them whole
                failed[c.request_id] = f"{PREFILL_FAILED}: an encoder's prompt goes whole"
        whole = [c for c in chunks if c.request_id not in failed]
        out: dict[str, tuple[float, ...]] = {}
        ordered = sorted(whole, key=lambda c: -c.num_tokens)
        for group in padding_groups(ordered, lambda c: c.num_tokens):
            try:
                out.update(self._vectors(group))
            except Exception:  # each alone, so that a fault is its own request's
                for chunk in group:
                    try:
                        out.update(self._vectors([chunk]))
                    except Exception as exc:
                        rid = chunk.request_id
                        log.error("request_failed", request_id=rid, error=repr(exc), exc_info=exc)
                        failed[rid] = PREFILL_FAILED
        self._free(tuple(failed))
        return StepResult(
            seconds=time.perf_counter() - t0,
            failed=failed,
            memory=read_memory_counters(),
            embeddings=out,
        )

    def _vectors(self, group: Sequence[ScheduledChunk]) -> dict[str, tuple[float, ...]]:
        """The vectors of `group`'s prompts (longest first), in one forward of padded rows."""
        longest = group[0].num_tokens
        pad = self.model.pad_id
        rows = [list(self._rows[c.request_id].prompt) for c in group]
        ids = mx.array([r + [pad] * (longest - len(r)) for r in rows], dtype=mx.int32)
        mask = mx.array([[1] * len(r) + [0] * (longest - len(r)) for r in rows], dtype=mx.int32)
        hidden = self.model.hidden(ids, mask)
        vectors = []
        for i, chunk in enumerate(group):
            pool = Pool(self._rows[chunk.request_id].spec)
            pool.add(hidden[i : i + 1, : chunk.num_tokens], 0)
            vectors.append(pool.vector())
        mx.eval(vectors)
        return {c.request_id: tuple(v.tolist()) for c, v in zip(group, vectors, strict=True)}

    def housekeep(self, work: Housekeeping) -> StepResult:
        t0 = time.perf_counter()
        self._free(work.free)
        return StepResult(seconds=time.perf_counter() - t0)

    def _free(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._rows.pop(rid, None)

    def disk_entries(self) -> list:
        return []

    def adopt_tokens(self, tokens: Mapping[str, int]) -> int:
        return 0

    def load_adapter(self, name: str, path: str) -> Any:
        from stepline.engine.lora import AdapterError

        raise AdapterError(f"{self.loaded.name!r} is an encoder (an embedding model): no adapters")

    @property
    def num_sequences(self) -> int:
        return len(self._rows)
