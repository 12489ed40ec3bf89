"""Repetition, presence and frequency penalties: the token history they need, and applying
them to a batch's logits (only the rows that ask for them).

A row's penalties look at its whole context, or at its last `repeat_last_n` tokens (Ollama's
and llama.cpp's window: prompt and answer tokens alike): the repetition penalty at the
distinct tokens there, presence and frequency at the generated tokens there (OpenAI's, which
never count the prompt's). A windowed row's arrays count what is in its window, so a token
that leaves it stops being penalised."""

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
    @property
    def repeat_last_n(self) -> int | None: ...  # None: the whole context


class RowHistory:
    """The tokens one request has seen, as penalties need them.

    The executor makes one at admission for a request whose `RowSampling.needs_history`
    (`RowHistory(prompt_ids)`) and calls `append(token)` after each sampled token, so that when
    the token at position t is sampled the history holds the prompt and generated tokens 0..t-1.
    `append` is O(1). Requests without penalties need none.
    """

    __slots__ = ("_prompt", "_seen", "_generated", "_first_seen", "_max_id")

    def __init__(self, prompt_ids: Iterable[int] = ()) -> None:
        self._prompt = tuple(prompt_ids)  # what a window's start reads (`token_at`)
        self._seen: set[int] = set(self._prompt)  # distinct prompt + generated ids (repetition)
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
    def num_prompt(self) -> int:
        return len(self._prompt)

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens."""
        return len(self._prompt) + len(self._generated)

    def token_at(self, position: int) -> int:
        """The token at `position` of the context (the prompt's, then the generated ones)."""
        n = len(self._prompt)
        return self._prompt[position] if position < n else self._generated[position - n]

    @property
    def max_token_id(self) -> int:
        return self._max_id


class _Window:
    """What a windowed row's arrays hold of its last `size` tokens: the context positions
    [lo, hi) and, for the tokens there, how often each occurs (all of them: repetition; the
    generated ones: presence and frequency)."""

    __slots__ = ("size", "lo", "hi", "seen", "generated", "rep_slot")

    def __init__(self, size: int) -> None:
        self.size = size
        self.lo = self.hi = 0
        self.seen: dict[int, int] = {}  # token -> occurrences in the window
        self.generated: dict[int, int] = {}  # token -> generated occurrences in the window
        self.rep_slot: dict[int, int] = {}  # token -> its slot in the repetition arrays

    def move(self, history: RowHistory) -> tuple[dict[int, int], dict[int, int]]:
        """Slide to the end of `history`: the tokens that entered, then those that left.
        Returns the counts (seen, generated) before the move of every token whose count
        changed."""
        end = history.num_tokens
        lo = max(0, end - self.size)
        num_prompt = history.num_prompt
        seen, generated = self.seen, self.generated
        seen_before: dict[int, int] = {}
        generated_before: dict[int, int] = {}
        for pos in range(max(self.hi, lo), end):  # entered (older ones left at once)
            t = history.token_at(pos)
            seen_before.setdefault(t, seen.get(t, 0))
            seen[t] = seen.get(t, 0) + 1
            if pos >= num_prompt:
                generated_before.setdefault(t, generated.get(t, 0))
                generated[t] = generated.get(t, 0) + 1
        for pos in range(self.lo, min(self.hi, lo)):  # left
            t = history.token_at(pos)
            seen_before.setdefault(t, seen[t])
            seen[t] -= 1
            if pos >= num_prompt:
                generated_before.setdefault(t, generated[t])
                generated[t] -= 1
        self.lo, self.hi = lo, end
        return seen_before, generated_before


class PenaltyArrays:
    """The penalties of a batch's penalised rows as the flat (row * vocab + token) indices and
    values that `apply_penalties` scatters, kept from one step to the next: `sync` adds what
    each row's history got since (a few concatenations for the whole batch, whatever the
    histories' lengths), where building them reads every history whole.

    A row with a window (`repeat_last_n`) keeps a slot per token that was ever in it; a
    token out of its window counts 0 there (`rep_on`, `counts`), which `apply_penalties`
    reads as no penalty. Built for one batch (`rows`, `histories`, `vocab`); `fits` says
    whether it still is.
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
        self._num_rep = 0
        # penalised row (its index in `_rows`) -> its window, where it has one
        self._windows: dict[int, _Window] = {
            j: _Window(row.repeat_last_n)
            for j, (_, row) in enumerate(self._rows)
            if row.repeat_last_n is not None
        }
        self.windowed = bool(self._windows)  # some row has a window: `apply_penalties` masks
        empty_int, empty_float = mx.zeros((0,), mx.int32), mx.zeros((0,), mx.float32)
        self.rep_index, self.rep_factor = empty_int, empty_float  # repetition: seen ids
        self.rep_on = empty_float  # ... 1 where the id is in its row's window (windowed only)
        self.add_index = empty_int  # presence/frequency: generated ids ...
        self.presence, self.frequency, self.counts = empty_float, empty_float, empty_float
        rep_index, rep_factor = [], []
        for j, ((i, row), history) in enumerate(zip(self._rows, self._histories, strict=True)):
            if j in self._windows:
                continue  # its window's tokens come in with the first `sync`
            if row.repetition_penalty != 1:
                rep_index.extend(i * vocab + t for t in history.seen_ids)
                rep_factor.extend([row.repetition_penalty] * len(history.seen_ids))
            self._num_first_seen[j] = len(history.first_seen)
        self._extend(rep_index, rep_factor, [], [], [], [], [], [], [])
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
        count_slots: list[int] = []  # presence/frequency slots whose count changes ...
        count_deltas: list[float] = []  # ... by this much
        on_slots: list[int] = []  # repetition slots of a windowed row whose id came back ...
        on_deltas: list[float] = []  # ... (+1) or left (-1)
        windows = self._windows

        def count(slots: dict[int, int], i: int, row: Penalties, t: int, delta: float) -> None:
            """Token `t`'s presence/frequency count in row `i` changes by `delta` (its slot
            made the first time)."""
            slot = slots.get(t)
            if slot is None:
                slots[t] = slot = self._num_add + len(add_index)
                add_index.append(i * vocab + t)
                presence.append(row.presence_penalty)
                frequency.append(row.frequency_penalty)
            count_slots.append(slot)
            count_deltas.append(delta)

        for j, ((i, row), history) in enumerate(zip(self._rows, self._histories, strict=True)):
            window = windows.get(j)
            if window is not None:
                if history.num_tokens == window.hi:
                    continue
                seen_before, generated_before = window.move(history)
                if row.repetition_penalty != 1:
                    for t, before in seen_before.items():
                        now = window.seen[t]
                        if (before > 0) == (now > 0):
                            continue
                        slot = window.rep_slot.get(t)
                        if slot is None:  # first time in the window: a slot of its own
                            window.rep_slot[t] = self._num_rep + len(rep_index)
                            rep_index.append(i * vocab + t)
                            rep_factor.append(row.repetition_penalty)
                        else:
                            on_slots.append(slot)
                            on_deltas.append(1.0 if now > 0 else -1.0)
                if row.presence_penalty != 0 or row.frequency_penalty != 0:
                    slots = self._add_slot[j]
                    for t, before in generated_before.items():
                        delta = window.generated[t] - before
                        if delta != 0:
                            count(slots, i, row, t, float(delta))
                continue
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
                    count(slots, i, row, t, 1.0)
            self._num_generated[j] = history.num_generated
        self._extend(
            rep_index,
            rep_factor,
            add_index,
            presence,
            frequency,
            count_slots,
            count_deltas,
            on_slots,
            on_deltas,
        )

    def _extend(
        self,
        rep_index: list[int],
        rep_factor: list[float],
        add_index: list[int],
        presence: list[float],
        frequency: list[float],
        count_slots: list[int],
        count_deltas: list[float],
        on_slots: list[int],
        on_deltas: list[float],
    ) -> None:
        def grow(have: mx.array, more: list, dtype: mx.Dtype) -> mx.array:
            return mx.concatenate([have, mx.array(more, dtype=dtype)]) if more else have

        self.rep_index = grow(self.rep_index, rep_index, mx.int32)
        self.rep_factor = grow(self.rep_factor, rep_factor, mx.float32)
        self._num_rep += len(rep_index)
        if self.windowed:
            self.rep_on = grow(self.rep_on, [1.0] * len(rep_index), mx.float32)
            if on_slots:
                self.rep_on = self.rep_on.at[mx.array(on_slots)].add(mx.array(on_deltas))
        self.add_index = grow(self.add_index, add_index, mx.int32)
        self.presence = grow(self.presence, presence, mx.float32)
        self.frequency = grow(self.frequency, frequency, mx.float32)
        self.counts = grow(self.counts, [0.0] * len(add_index), mx.float32)
        self._num_add += len(add_index)
        if count_slots:
            # repeated slots add up
            if self.windowed:
                deltas = mx.array(count_deltas, dtype=mx.float32)
                self.counts = self.counts.at[mx.array(count_slots)].add(deltas)
            else:  # every delta is one more occurrence
                self.counts = self.counts.at[mx.array(count_slots)].add(1.0)


def apply_penalties(raw: mx.array, arrays: PenaltyArrays) -> mx.array:
    """Repetition penalty (mlx-lm: logit > 0 divided, else multiplied) over prompt + generated
    tokens, then presence and frequency penalties (OpenAI) over generated tokens (of each
    row's window, where it has one)."""
    num_rows, vocab = raw.shape
    flat = raw.reshape(-1)
    if arrays.rep_index.size:
        index, factor = arrays.rep_index, arrays.rep_factor
        if arrays.windowed:  # an id out of its window: a factor of 1, exactly no change
            factor = mx.where(arrays.rep_on > 0, factor, 1.0)
        scale = mx.where(flat[index] > 0, 1 / factor, factor)
        flat = flat.at[index].multiply(scale)  # indices are distinct within and across rows
    if arrays.add_index.size:
        presence = arrays.presence
        if arrays.windowed:  # presence only for ids in the window (their count > 0)
            presence = mx.where(arrays.counts > 0, presence, 0.0)
        delta = -(presence + arrays.frequency * arrays.counts)
        flat = flat.at[arrays.add_index].add(delta)
    return flat.reshape(num_rows, vocab)
