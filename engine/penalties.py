"""Repetition, presence and frequency penalties: the token history they need, and applying
them to a batch's logits (only the rows that ask for them)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from stepline.engine.sampling import RowSampling


class RowHistory:
    """The tokens one request has seen, as penalties need them.

    The executor makes one at admission for a request whose `RowSampling.needs_history`
    (`RowHistory(prompt_ids)`) and calls `append(token)` after each sampled token, so that when
    the token at position t is sampled the history holds the prompt and generated tokens 0..t-1.
    `append` is O(1); the sampler reads the sets below, so its cost per step is the number of
    distinct tokens, paid only by rows with a penalty. Requests without penalties need none.
    """

    __slots__ = ("_seen", "_counts", "_num_generated", "_max_id")

    def __init__(self, prompt_ids: Iterable[int] = ()) -> None:
        self._seen: set[int] = set(prompt_ids)  # distinct prompt + generated ids (repetition)
        self._counts: dict[int, int] = {}  # generated id -> times generated (presence, frequency)
        self._num_generated = 0
        self._max_id = max(self._seen, default=-1)  # to reject ids outside the vocabulary

    def append(self, token_id: int) -> None:
        self._seen.add(token_id)
        self._counts[token_id] = self._counts.get(token_id, 0) + 1
        self._num_generated += 1
        self._max_id = max(self._max_id, token_id)

    @property
    def seen_ids(self) -> set[int]:
        """Distinct token ids of the prompt and the generated tokens (do not mutate)."""
        return self._seen

    @property
    def generated_counts(self) -> dict[int, int]:
        """Generated token id -> how many times it was generated (do not mutate)."""
        return self._counts

    @property
    def num_generated(self) -> int:
        return self._num_generated

    @property
    def max_token_id(self) -> int:
        return self._max_id


def apply_penalties(
    raw: mx.array,
    rows: Sequence[RowSampling],
    penalised_rows: list[int],
    histories: Sequence[RowHistory | None],
) -> mx.array:
    """Repetition penalty (mlx-lm: logit > 0 divided, else multiplied) over prompt + generated
    tokens, then presence and frequency penalties (OpenAI) over generated tokens."""
    num_rows, vocab = raw.shape
    rep_index: list[mx.array] = []
    rep_factor: list[mx.array] = []
    add_index: list[mx.array] = []
    add_delta: list[mx.array] = []
    for i in penalised_rows:
        row, history = rows[i], histories[i]
        assert history is not None  # _check_batch made sure
        offset = i * vocab  # indices into the flattened (B * V) logits
        if row.repetition_penalty != 1 and history.seen_ids:
            ids = mx.array(list(history.seen_ids), dtype=mx.int32)
            rep_index.append(ids + offset)
            rep_factor.append(mx.full(ids.shape, row.repetition_penalty, dtype=mx.float32))
        counts = history.generated_counts
        if (row.presence_penalty != 0 or row.frequency_penalty != 0) and counts:
            add_index.append(mx.array(list(counts.keys()), dtype=mx.int32) + offset)
            times = mx.array(list(counts.values()), dtype=mx.float32)
            add_delta.append(-(row.presence_penalty + row.frequency_penalty * times))

    flat = raw.reshape(-1)
    if rep_index:
        index = mx.concatenate(rep_index)
        factor = mx.concatenate(rep_factor)
        scale = mx.where(flat[index] > 0, 1 / factor, factor)
        flat = flat.at[index].multiply(scale)  # indices are distinct within and across rows
    if add_index:
        flat = flat.at[mx.concatenate(add_index)].add(mx.concatenate(add_delta))
    return flat.reshape(num_rows, vocab)
