"""Repetition, presence and frequency penalties: the token history they need, and applying
them to a batch's logits (only the rows that ask for them)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import mlx.core as mx


class Penalties(Protocol):
    """A row's penalty parameters (`sampling.RowSampling` has them): what this module reads,
    so that it needs nothing from the sampler."""

    @property
    def repetition_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...


class RowHistory:
    """The tokens one request has seen, as penalties need them.

    The executor makes one at admission for a request whose `RowSampling.needs_history`
    (`RowHistory(prompt_ids)`) and calls `append(token)` after each sampled token, so that when
    the token at position t is sampled the history holds the prompt and generated tokens 0..t-1.
    `append` is O(1). Requests without penalties need none.
    """

    __slots__ = ("_seen", "_generated", "_first_seen", "_max_id")

    def __init__(self, prompt_ids: Iterable[int] = ()) -> None:
        self._seen: set[int] = set(prompt_ids)  # distinct prompt + generated ids (repetition)
        self._generated: list[int] = []
        self._first_seen: list[int] = []  # generated ids new to `_seen` when generated, in order
        self._max_id = max(self._seen, default=-1)  # to reject ids outside the vocabulary

    def append(self, token_id: int) -> None:
        if token_id not in self._seen:
            self._seen.add(token_id)
            self._first_seen.append(token_id)
        self._generated.append(token_id)
        self._max_id = max(self._max_id, token_id)

    @property
    def seen_ids(self) -> set[int]:
        """Distinct token ids of the prompt and the generated tokens (do not mutate)."""
        return self._seen

    @property
    def generated(self) -> list[int]:
        """The generated tokens, in order (do not mutate)."""
        return self._generated

    @property
    def first_seen(self) -> list[int]:
        """The generated ids that neither the prompt nor an earlier generated token held, in
        the order they were generated (do not mutate)."""
        return self._first_seen

    @property
    def num_generated(self) -> int:
        return len(self._generated)

    @property
    def max_token_id(self) -> int:
        return self._max_id


class PenaltyArrays:
    """The penalties of a batch's penalised rows as the flat (row * vocab + token) indices and
    values that `apply_penalties` scatters, kept from one step to the next: `sync` adds what
    each row's history got since (a few concatenations for the whole batch, whatever the
    histories' lengths), where building them reads every history whole.

    Built for one batch (`rows`, `histories`, `vocab`); `fits` says whether it still is.
    """

    def __init__(
        self,
        rows: Sequence[Penalties],
        penalised: list[int],
        histories: Sequence[RowHistory | None],
        vocab: int,
    ) -> None:
        self.vocab = vocab
        self._rows = [(i, rows[i]) for i in penalised]  # (batch row, its parameters)
        self._histories: list[RowHistory] = [histories[i] for i in penalised]  # type: ignore[misc]
        # Per penalised row: how much of its history is in the arrays, and where each of its
        # generated ids sits in the presence/frequency arrays.
        self._num_generated = [0] * len(penalised)
        self._num_first_seen = [0] * len(penalised)
        self._add_slot: list[dict[int, int]] = [{} for _ in penalised]
        self._num_add = 0
        empty_int, empty_float = mx.zeros((0,), mx.int32), mx.zeros((0,), mx.float32)
        self.rep_index, self.rep_factor = empty_int, empty_float  # repetition: seen ids
        self.add_index = empty_int  # presence/frequency: generated ids ...
        self.presence, self.frequency, self.counts = empty_float, empty_float, empty_float
        rep_index, rep_factor = [], []
        for j, ((i, row), history) in enumerate(zip(self._rows, self._histories, strict=True)):
            if row.repetition_penalty != 1:
                rep_index.extend(i * vocab + t for t in history.seen_ids)
                rep_factor.extend([row.repetition_penalty] * len(history.seen_ids))
            self._num_first_seen[j] = len(history.first_seen)
        self._extend(rep_index, rep_factor, [], [], [], [])
        self.sync()

    def fits(self, histories: Sequence[RowHistory | None], vocab: int) -> bool:
        """Whether these arrays are for these histories (the same objects) and vocabulary."""
        return vocab == self.vocab and all(
            histories[i] is h for (i, _), h in zip(self._rows, self._histories, strict=True)
        )

    def sync(self) -> None:
        """Take in the tokens each history got since the last `sync`."""
        vocab = self.vocab
        rep_index: list[int] = []
        rep_factor: list[float] = []
        add_index: list[int] = []
        presence: list[float] = []
        frequency: list[float] = []
        once_more: list[int] = []  # slots of ids generated again
        for j, ((i, row), history) in enumerate(zip(self._rows, self._histories, strict=True)):
            if history.num_generated == self._num_generated[j]:
                continue
            if row.repetition_penalty != 1:
                new = history.first_seen[self._num_first_seen[j] :]
                rep_index.extend(i * vocab + t for t in new)
                rep_factor.extend([row.repetition_penalty] * len(new))
            self._num_first_seen[j] = len(history.first_seen)
            if row.presence_penalty != 0 or row.frequency_penalty != 0:
                slots = self._add_slot[j]
                for t in history.generated[self._num_generated[j] :]:
                    slot = slots.get(t)
                    if slot is None:
                        slots[t] = slot = self._num_add + len(add_index)
                        add_index.append(i * vocab + t)
                        presence.append(row.presence_penalty)
                        frequency.append(row.frequency_penalty)
                    once_more.append(slot)
            self._num_generated[j] = history.num_generated
        self._extend(rep_index, rep_factor, add_index, presence, frequency, once_more)

    def _extend(
        self,
        rep_index: list[int],
        rep_factor: list[float],
        add_index: list[int],
        presence: list[float],
        frequency: list[float],
        once_more: list[int],
    ) -> None:
        def grow(have: mx.array, more: list, dtype: mx.Dtype) -> mx.array:
            return mx.concatenate([have, mx.array(more, dtype=dtype)]) if more else have

        self.rep_index = grow(self.rep_index, rep_index, mx.int32)
        self.rep_factor = grow(self.rep_factor, rep_factor, mx.float32)
        self.add_index = grow(self.add_index, add_index, mx.int32)
        self.presence = grow(self.presence, presence, mx.float32)
        self.frequency = grow(self.frequency, frequency, mx.float32)
        self.counts = grow(self.counts, [0.0] * len(add_index), mx.float32)
        self._num_add += len(add_index)
        if once_more:
            self.counts = self.counts.at[mx.array(once_more)].add(1.0)  # repeated slots add up


def apply_penalties(raw: mx.array, arrays: PenaltyArrays) -> mx.array:
    """Repetition penalty (mlx-lm: logit > 0 divided, else multiplied) over prompt + generated
    tokens, then presence and frequency penalties (OpenAI) over generated tokens."""
    num_rows, vocab = raw.shape
    flat = raw.reshape(-1)
    if arrays.rep_index.size:
        index, factor = arrays.rep_index, arrays.rep_factor
        scale = mx.where(flat[index] > 0, 1 / factor, factor)
        flat = flat.at[index].multiply(scale)  # indices are distinct within and across rows
    if arrays.add_index.size:
        delta = -(arrays.presence + arrays.frequency * arrays.counts)
        flat = flat.at[arrays.add_index].add(delta)
    return flat.reshape(num_rows, vocab)
