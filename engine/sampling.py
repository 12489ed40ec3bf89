"""Batched per-request sampling: one (B, V) logits array, one `RowSampling` per row, one eval.

Every row of a decode batch belongs to a different request with its own parameters. `Sampler`
turns the whole batch into tokens with vectorised MLX ops and a single `mx.eval` (a second one
only in the rare case described under `_NUM_CANDIDATES`):

1. penalties (only rows that ask for them), on the raw logits;
2. greedy rows (temperature below `GREEDY_TEMPERATURE`, e.g. 0): argmax of the penalised
   logits, no filters;
3. other rows: temperature, then top-k, top-p and min-p as one per-row threshold, then
   Gumbel-max: argmax(logits / T + g), g ~ Gumbel(0, 1), which draws exactly from
   softmax(logits / T) restricted to the tokens that pass the filters.

The noise of a row comes from its own key: `(seed, position)` for seeded rows, so a seeded
request gives the same tokens alone or in any batch; the sampler's own stream otherwise.

What the sampler reads from the rows' parameters (which rows need what, the drawn rows'
parameters as arrays) is a `SamplingRows`, worked out once for a set of rows: the runner keeps
one for its decode batch and makes it again only when rows join or leave.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import mlx.core as mx
import numpy as np

from stepline.actors.scheduler.work import TokenLogprob
from stepline.engine.penalties import PenaltyArrays, RowHistory, apply_penalties
from stepline.engine.sampling_limits import (
    GREEDY_TEMPERATURE,
    MAX_INT32,
    MAX_REPETITION_PENALTY,
    PENALTY_RANGE,
    is_int,
    is_number,
)

# top-k / top-p thresholds come from each row's best _NUM_CANDIDATES tokens (a partition and a
# small sort, instead of sorting the whole vocabulary, which is ~90 ms for 32 x 32000 on CPU).
# A row whose nucleus is wider than that, or whose top_k is larger, is redone with a full sort
# after the first eval; which rows that happens to depends only on the row itself.
_NUM_CANDIDATES = 1024

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class RowSampling:
    """How to sample one row. Invalid values raise `ValueError` naming the field and its range.

    NaN and infinities are refused everywhere. `top_k=-1` means off, like 0 (it is stored as 0);
    a temperature below `GREEDY_TEMPERATURE` is greedy.
    """

    temperature: float = 1.0  # < GREEDY_TEMPERATURE (e.g. 0) => greedy (argmax)
    top_p: float = 1.0  # (0, 1]; 1 disables
    top_k: int = 0  # 0 or -1 disables; at most MAX_INT32
    min_p: float = 0.0  # [0, 1); 0 disables
    seed: int | None = None  # None => the sampler's shared random stream
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token generated so far
    frequency_penalty: float = 0.0  # OpenAI: subtracted once per time a token was generated
    repetition_penalty: float = 1.0  # HF/mlx-lm, over prompt + generated tokens; > 1 penalises
    # the penalties look at the context's last n tokens (Ollama's repeat_last_n); None: all
    repeat_last_n: int | None = None
    logprobs: int | None = None  # None => none; k >= 0 => chosen token's logprob + top k

    def __post_init__(self) -> None:
        if not (is_number(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature}"
            )
        if not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT32:
            raise ValueError(
                f"top_k must be an integer in [-1, {MAX_INT32}] (0 or -1 disables it), "
                f"got {self.top_k!r}"
            )
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not (is_number(self.min_p) and 0 <= self.min_p < 1):
            raise ValueError(f"min_p must be in [0, 1) (0 disables it), got {self.min_p}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (is_number(value) and low <= value <= high):
                raise ValueError(
                    f"{name} must be a number in [{low:g}, {high:g}] (0 disables it), got {value}"
                )
        if not (
            is_number(self.repetition_penalty)
            and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise ValueError(
                f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] "
                f"(1 disables it), got {self.repetition_penalty}"
            )
        if self.repeat_last_n is not None and (
            not is_int(self.repeat_last_n) or not 0 <= self.repeat_last_n <= MAX_INT32
        ):
            raise ValueError(
                f"repeat_last_n must be None (the whole context) or an integer >= 0, "
                f"got {self.repeat_last_n!r}"
            )
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_INT32
        ):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_history(self) -> bool:
        """Whether sampling this row reads its `RowHistory` (it has a penalty, over a window
        of at least one token)."""
        return self.repeat_last_n != 0 and (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


@dataclass(frozen=True)
class SampleOutput:
    tokens: list[int]  # one per row
    # per row, None where not requested; logprobs of the raw (unpenalised, untempered) logits
    logprobs: list[TokenLogprob | None]
    any_logprobs: bool = False  # some row requested them


class SamplingRows(Sequence[RowSampling]):
    """The `RowSampling`s of a batch's rows, in order, with what `Sampler.start` reads from all
    of them worked out once: which rows need penalties, logprobs or a random draw, and (built
    on first use, then kept) the drawn rows' parameters as arrays. Immutable."""

    def __init__(self, rows: Iterable[RowSampling] = ()) -> None:
        self.rows = tuple(rows)
        self.penalised = [i for i, r in enumerate(self.rows) if r.needs_history]
        self.logprob_rows = [i for i, r in enumerate(self.rows) if r.logprobs is not None]
        self.sampled = [i for i, r in enumerate(self.rows) if not r.is_greedy]
        # Nothing but argmax: no penalty, no logprobs, no draw.
        self.plain = not (self.penalised or self.logprob_rows or self.sampled)
        self._penalties: PenaltyArrays | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):  # type: ignore[override]
        return self.rows[i]

    def __iter__(self) -> Iterator[RowSampling]:
        return iter(self.rows)

    def penalties(self, histories: Sequence[RowHistory | None], vocab: int) -> PenaltyArrays:
        """The penalised rows' penalties, as arrays up to date with `histories`: those of
        the last call, brought up to date, where it was given the same histories."""
        arrays = self._penalties
        if arrays is not None and arrays.fits(histories, vocab):
            arrays.sync()
        else:
            arrays = self._penalties = PenaltyArrays(self.rows, self.penalised, histories, vocab)
        return arrays

    @cached_property
    def drawn(self) -> _DrawnRows:
        """The rows drawn at random (`sampled`): their parameters as arrays."""
        return _DrawnRows.build(self)

    @cached_property
    def logprob_index(self) -> mx.array:
        return mx.array(self.logprob_rows)

    @cached_property
    def top_counts(self) -> list[int]:
        """How many alternatives each of `logprob_rows` asked for (uncapped)."""
        return [self.rows[i].logprobs or 0 for i in self.logprob_rows]


class Sampler:
    """Samples one token per row of a logits batch. Not thread-safe: the executor's thread owns it.

    `seed` seeds the shared stream that rows without their own seed draw from, so a whole run
    is reproducible given the same sampler seed and the same sequence of batches.
    """

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)  # the shared stream: one 64-bit key per unseeded row
        self._gumbel_by_vocab: dict[int, Callable[[mx.array], mx.array]] = {}

    def sample(
        self,
        logits: mx.array,
        rows: Sequence[RowSampling],
        positions: Sequence[int],
        histories: Sequence[RowHistory | None] | None = None,
    ) -> SampleOutput:
        """Sample one token per row of `logits` (B, V), row i with `rows[i]` (a list, or a
        `SamplingRows` kept from an earlier call on the same rows).

        `positions[i]` is the index of the token being sampled in row i's output (0 for its first
        token); with `rows[i].seed` it fixes the row's randomness (it is read for seeded drawn
        rows only). `histories[i]` must be given for every row whose `needs_history` (it is
        read for those rows only). Returns Python ints, computed with one `mx.eval`
        (plus one for the rare rows whose top-p/top-k reaches past `_NUM_CANDIDATES` tokens).

        Raises ValueError if the lengths disagree with the batch, a row with a penalty has no
        history, or a history holds a token id outside the vocabulary.
        """
        return self.start(logits, rows, positions, histories).finish()

    def start(
        self,
        logits: mx.array,
        rows: Sequence[RowSampling],
        positions: Sequence[int],
        histories: Sequence[RowHistory | None] | None = None,
    ) -> PendingSample:
        """`sample`, built but not evaluated: `mx.async_eval(*pending.arrays())` can run it
        alongside other work, and `pending.finish()` gives the `SampleOutput`. The shared
        stream's keys are drawn now, in call order."""
        if not isinstance(rows, SamplingRows):
            rows = SamplingRows(rows)
        num_rows, vocab = _check_batch(logits, rows, positions, histories)
        if rows.plain:
            return PendingSample(num_rows, mx.argmax(logits, axis=-1))

        raw = logits.astype(mx.float32)
        penalised = raw
        if rows.penalised:
            assert histories is not None  # _check_batch made sure
            penalised = apply_penalties(raw, rows.penalties(histories, vocab))

        draw: _Draw | None = None
        if rows.sampled:
            draw = self._draw(penalised, rows.drawn, positions)
        if draw is not None and len(rows.sampled) == num_rows:
            tokens = draw.tokens
        else:
            tokens = mx.argmax(penalised, axis=-1)
            if draw is not None:
                tokens[rows.drawn.index] = draw.tokens
        lp = _Logprobs.build(raw, tokens, rows) if rows.logprob_rows else None
        return PendingSample(num_rows, tokens, draw, lp)

    def _draw(self, penalised: mx.array, drawn: _DrawnRows, positions: Sequence[int]) -> _Draw:
        """Build (lazily) the tokens of the batch's rows that are drawn at random."""
        vocab = penalised.shape[-1]
        x = penalised if drawn.all_rows else penalised[drawn.index]
        # Shifting by the max first keeps x / T finite for tiny T and makes the top token 0.
        z = (x - x.max(axis=-1, keepdims=True)) / drawn.temperature
        noise = self._gumbel(vocab)(self._keys(drawn, positions))
        draw = _Draw(z=z, noise=noise, filters=drawn.filters, row_index=drawn.row_index)
        draw.sample()
        return draw

    def _keys(self, drawn: _DrawnRows, positions: Sequence[int]) -> mx.array:
        """Each drawn row's (hi, lo) uint32 key: from (seed, position) for a seeded row, else
        the next 64 bits of the shared stream, in row order."""
        keys = np.empty((len(drawn.row_index), 2), dtype=np.uint32)
        if drawn.unseeded:
            keys[drawn.unseeded] = self._shared_keys(len(drawn.unseeded))
        for slot, seed in drawn.seeded:
            keys[slot] = _seeded_key(seed, positions[drawn.row_index[slot]])
        return mx.array(keys)

    def _shared_keys(self, n: int) -> np.ndarray:
        """n keys from the shared stream, (n, 2) uint32 (hi, lo) each: the same keys, and the
        same stream after, as n calls of `getrandbits(64)` (which fills 32-bit words lowest
        first, as one `getrandbits(64 * n)` does)."""
        words = self._rng.getrandbits(64 * n).to_bytes(8 * n, "little")
        return np.frombuffer(words, dtype="<u4").reshape(n, 2)[:, ::-1]

    def _gumbel(self, vocab: int) -> Callable[[mx.array], mx.array]:
        # One vectorised random call for all rows, each row from its own key.
        fn = self._gumbel_by_vocab.get(vocab)
        if fn is None:
            fn = mx.vmap(lambda key: mx.random.gumbel((vocab,), key=key))
            self._gumbel_by_vocab[vocab] = fn
        return fn


# -- the pieces ---------------------------------------------------------------------------------


@dataclass
class PendingSample:
    """A batch's tokens (and logprobs), as lazy arrays until `finish`."""

    num_rows: int
    tokens: mx.array  # (B,); after `finish`, evaluated and equal to its tokens
    draw: _Draw | None = None  # the non-greedy rows, if any
    lp: _Logprobs | None = None  # the rows that asked for logprobs, if any

    @property
    def tokens_final(self) -> bool:
        """Whether `tokens`, once evaluated, are the batch's tokens and `finish` only reads
        them: no logprobs to compute, no row that a filter may have to sample again."""
        return self.lp is None and (self.draw is None or self.draw.covered is None)

    def arrays(self) -> list[mx.array]:
        out = [self.tokens]
        if self.draw is not None and self.draw.covered is not None:
            out.append(self.draw.covered)
        if self.lp is not None:
            out.extend(self.lp.arrays())
        return out

    def finish(self) -> SampleOutput:
        """Evaluate (one `mx.eval`, two for rows whose filters reached past the candidates)
        and return Python values."""
        draw, lp = self.draw, self.lp
        mx.eval(*self.arrays())
        token_list: list[int] = self.tokens.tolist()
        if draw is not None and draw.covered is not None and not draw.covered.all().item():
            redone = draw.redo_uncovered()  # rows whose filter reached past the candidates
            if lp is not None:
                lp.retake_chosen(redone)
            redone_tokens = mx.stack([tok for _, tok in redone]).astype(self.tokens.dtype)
            self.tokens[mx.array([row for row, _ in redone])] = redone_tokens
            mx.eval(self.tokens, *(lp.arrays() if lp is not None else []))
            token_list = self.tokens.tolist()
        n = self.num_rows
        per_row = lp.to_python(token_list, n) if lp is not None else [None] * n
        return SampleOutput(tokens=token_list, logprobs=per_row, any_logprobs=lp is not None)


@dataclass
class _Filters:
    """Per-row filter parameters of the sampled rows, as (n, 1) arrays, and what the
    thresholds derive from them alone (made on first use, then kept with the batch's rows)."""

    top_k: mx.array  # int32, 0 = off
    top_p: mx.array  # float32, 1 = off
    min_p: mx.array  # float32, 0 = off
    any_rank_filter: bool  # some row has top_k or top_p: thresholds need the sorted best tokens
    any_min_p: bool
    any_nucleus_over_vocab: bool  # some row has top_p without top_k: needs the full logsumexp
    _ranks: dict[tuple[int, int], _Ranks] = field(default_factory=dict)
    _log_min_p: mx.array | None = None

    @property
    def log_min_p(self) -> mx.array:
        """The min-p threshold on z (p / p_max >= min_p); log(0) = -inf."""
        if self._log_min_p is None:
            self._log_min_p = mx.log(self.min_p)
        return self._log_min_p

    def ranks(self, vocab: int, num: int) -> _Ranks:
        ranks = self._ranks.get((vocab, num))
        if ranks is None:
            ranks = self._ranks[vocab, num] = _Ranks.build(self, vocab, num)
        return ranks

    @classmethod
    def build(cls, rows: Sequence[RowSampling]) -> _Filters:
        def col(values: list, dtype: mx.Dtype) -> mx.array:
            return mx.array(values, dtype=dtype)[:, None]

        return cls(
            top_k=col([r.top_k for r in rows], mx.int32),
            top_p=col([r.top_p for r in rows], mx.float32),
            min_p=col([r.min_p for r in rows], mx.float32),
            any_rank_filter=any(r.top_k > 0 or r.top_p < 1 for r in rows),
            any_min_p=any(r.min_p > 0 for r in rows),
            any_nucleus_over_vocab=any(r.top_k == 0 and r.top_p < 1 for r in rows),
        )

    def take(self, index: mx.array) -> _Filters:
        return _Filters(
            top_k=self.top_k[index],
            top_p=self.top_p[index],
            min_p=self.min_p[index],
            any_rank_filter=self.any_rank_filter,
            any_min_p=self.any_min_p,
            any_nucleus_over_vocab=False,  # only used with the full sort, which needs no logsumexp
        )


@dataclass(frozen=True)
class _Ranks:
    """What `_rank_threshold` derives from the filters alone, over `num` best of `vocab`."""

    k: mx.array  # (n, 1) each row's top-k, vocab where off
    in_top_k: mx.array  # (n, num) whether each rank is within the row's top-k
    k_within: mx.array  # (n, 1) k <= num: the candidates hold the whole top-k
    p_off: mx.array  # (n, 1) no top-p
    any_on: mx.array  # (n, 1) top-k or top-p
    covered_anyway: mx.array  # (n, 1) k <= num or no top-p
    k_fits: mx.array  # (n, 1) k <= num or no top-k

    @classmethod
    def build(cls, filters: _Filters, vocab: int, num: int) -> _Ranks:
        rank = mx.arange(num)[None, :]
        k = mx.where(filters.top_k > 0, mx.minimum(filters.top_k, vocab), vocab)
        k_on = k < vocab
        p_on = filters.top_p < 1
        return cls(
            k=k,
            in_top_k=rank < k,
            k_within=k <= num,
            p_off=~p_on,
            any_on=k_on | p_on,
            covered_anyway=(k <= num) | ~p_on,
            k_fits=(k <= num) | ~k_on,
        )


@dataclass(frozen=True)
class _DrawnRows:
    """What drawing a batch's non-greedy rows reads from their parameters, as arrays."""

    row_index: list[int]  # batch row of each drawn row
    index: mx.array  # row_index as an array
    all_rows: bool  # every row of the batch is drawn
    temperature: mx.array  # (n, 1) float32
    filters: _Filters
    unseeded: list[int]  # drawn rows (slots in row_index) that take keys from the shared stream
    seeded: list[tuple[int, int]]  # (slot, seed) of the others

    @classmethod
    def build(cls, rows: SamplingRows) -> _DrawnRows:
        drawn = [rows[i] for i in rows.sampled]
        return cls(
            row_index=rows.sampled,
            index=mx.array(rows.sampled),
            all_rows=len(rows.sampled) == len(rows),
            temperature=mx.array([r.temperature for r in drawn], dtype=mx.float32)[:, None],
            filters=_Filters.build(drawn),
            unseeded=[j for j, r in enumerate(drawn) if r.seed is None],
            seeded=[(j, r.seed) for j, r in enumerate(drawn) if r.seed is not None],
        )


@dataclass
class _Draw:
    """The sampled rows of one batch: tempered logits z, their noise, and the tokens drawn."""

    z: mx.array  # (n, V) penalised logits / T, shifted so each row's max is 0
    noise: mx.array  # (n, V) Gumbel noise, from each row's own key
    filters: _Filters
    row_index: list[int]  # batch row of each sampled row
    tokens: mx.array | None = None  # (n,) uint32
    covered: mx.array | None = None  # (n,) bool: thresholds were exact; None if no rank filter

    def sample(self) -> None:
        vocab = self.z.shape[-1]
        threshold = self.filters.log_min_p
        if self.filters.any_rank_filter:
            num = min(vocab, _NUM_CANDIDATES)
            if num == vocab:
                best = -mx.sort(-self.z, axis=-1)
            else:
                # The num smallest of -z, sorted ascending, are the num largest of z, descending.
                best = -mx.sort(mx.partition(-self.z, kth=num - 1, axis=-1)[:, :num], axis=-1)
            lse = (
                mx.logsumexp(self.z, axis=-1, keepdims=True)
                if num < vocab and self.filters.any_nucleus_over_vocab
                else None
            )
            rank_threshold, self.covered = _rank_threshold(best, lse, self.filters, vocab)
            threshold = mx.maximum(threshold, rank_threshold)
        self.tokens = _gumbel_argmax(self.z, self.noise, threshold)

    def redo_uncovered(self) -> list[tuple[int, mx.array]]:
        """Resample, with a full sort, the rows whose filters reached past the candidates.

        Returns (batch row, lazy token) pairs. Call only after `covered` was evaluated.
        """
        assert self.covered is not None
        local = [j for j, ok in enumerate(self.covered.tolist()) if not ok]
        index = mx.array(local)
        z = self.z[index]
        filters = self.filters.take(index)
        best = -mx.sort(-z, axis=-1)
        rank_threshold, _ = _rank_threshold(best, None, filters, z.shape[-1])
        threshold = mx.maximum(filters.log_min_p, rank_threshold)
        tokens = _gumbel_argmax(z, self.noise[index], threshold)
        return [(self.row_index[j], tokens[k]) for k, j in enumerate(local)]


def _gumbel_argmax(z: mx.array, noise: mx.array, threshold: mx.array) -> mx.array:
    """argmax(z + noise) over the tokens with z >= threshold: a draw from softmax(z) restricted."""
    return mx.argmax(mx.where(z >= threshold, z + noise, -mx.inf), axis=-1)


def _rank_threshold(
    best: mx.array, lse: mx.array | None, filters: _Filters, vocab: int
) -> tuple[mx.array, mx.array]:
    """The (n, 1) top-k/top-p threshold on z, and (n,) whether it is exact.

    `best` holds each row's num best z values in descending order (num = V for a full sort);
    `lse` is logsumexp(z) over the whole row, needed when num < V for rows with top_p but no
    top_k. Top-p is taken over the top-k survivors, renormalised. Tokens tied with the threshold
    are kept. Rows with neither filter get -inf.
    """
    ranks = filters.ranks(vocab, best.shape[-1])
    masked = mx.where(ranks.in_top_k, best, -mx.inf)
    log_norm = mx.logsumexp(masked, axis=-1, keepdims=True)
    if lse is not None:
        log_norm = mx.where(ranks.k_within, log_norm, lse)
    probs = mx.exp(masked - log_norm)
    mass_before = mx.cumsum(probs, axis=-1, inclusive=False)
    # Nucleus: the smallest prefix whose mass reaches top_p; the top token always stays.
    keep = ranks.in_top_k & ((mass_before < filters.top_p) | ranks.p_off)
    num_keep = keep.sum(axis=-1, keepdims=True).astype(mx.int32)
    threshold = mx.take_along_axis(best, mx.maximum(num_keep - 1, 0), axis=-1)
    threshold = mx.where(ranks.any_on, threshold, -mx.inf)

    mass_all = mass_before[:, -1:] + probs[:, -1:]
    covered = ranks.covered_anyway | (mass_all >= filters.top_p)
    covered = covered & ranks.k_fits
    return threshold, covered[:, 0]


@dataclass
class _Logprobs:
    """Logprobs of the raw logits for the rows that asked, as lazy arrays until `to_python`."""

    row_index: list[int]
    top_counts: list[int]  # per row, how many alternatives it asked for (capped at V)
    log_softmax: mx.array  # (r, V)
    chosen: mx.array  # (r,)
    top_ids: mx.array | None  # (r, k_max), descending by logprob
    top_values: mx.array | None

    @classmethod
    def build(cls, raw: mx.array, tokens: mx.array, rows: SamplingRows) -> _Logprobs:
        vocab = raw.shape[-1]
        row_index, index = rows.logprob_rows, rows.logprob_index
        every_row = len(row_index) == raw.shape[0]
        x = raw if every_row else raw[index]
        log_softmax = x - mx.logsumexp(x, axis=-1, keepdims=True)
        chosen_tokens = tokens if every_row else tokens[index]
        chosen = mx.take_along_axis(log_softmax, chosen_tokens[:, None], axis=-1)[:, 0]
        top_counts = [min(k, vocab) for k in rows.top_counts]
        k_max = max(top_counts)
        top_ids = top_values = None
        if k_max > 0:
            ids = mx.argpartition(-log_softmax, kth=k_max - 1, axis=-1)[:, :k_max]
            values = mx.take_along_axis(log_softmax, ids, axis=-1)
            order = mx.argsort(-values, axis=-1)
            top_ids = mx.take_along_axis(ids, order, axis=-1)
            top_values = mx.take_along_axis(values, order, axis=-1)
        return cls(row_index, top_counts, log_softmax, chosen, top_ids, top_values)

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_values) if a is not None]

    def retake_chosen(self, redone: list[tuple[int, mx.array]]) -> None:
        """Point `chosen` at the tokens of rows that were resampled."""
        position = {row: j for j, row in enumerate(self.row_index)}
        for row, token in redone:
            if row in position:
                j = position[row]
                self.chosen[j] = self.log_softmax[j, token]

    def to_python(self, tokens: list[int], num_rows: int) -> list[TokenLogprob | None]:
        chosen = self.chosen.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        values = self.top_values.tolist() if self.top_values is not None else None
        out: list[TokenLogprob | None] = [None] * num_rows
        for j, row in enumerate(self.row_index):
            k = self.top_counts[j]
            top = tuple(zip(ids[j][:k], values[j][:k], strict=True)) if k else ()
            out[row] = TokenLogprob(token_id=tokens[row], logprob=chosen[j], top=top)
        return out


# -- helpers ------------------------------------------------------------------------------------


def _check_batch(
    logits: mx.array,
    rows: SamplingRows,
    positions: Sequence[int],
    histories: Sequence[RowHistory | None] | None,
) -> tuple[int, int]:
    if logits.ndim != 2:
        raise ValueError(f"logits must be (batch, vocab), got shape {logits.shape}")
    num_rows, vocab = logits.shape
    if len(rows) != num_rows or len(positions) != num_rows:
        raise ValueError(
            f"logits has {num_rows} rows but got {len(rows)} RowSampling and "
            f"{len(positions)} positions; pass one of each per row"
        )
    if histories is not None and len(histories) != num_rows:
        raise ValueError(f"logits has {num_rows} rows but got {len(histories)} histories")
    for i in rows.penalised:
        history = histories[i] if histories is not None else None
        if history is None:
            raise ValueError(f"row {i} has a penalty but no RowHistory; pass histories[{i}]")
        if history.max_token_id >= vocab:
            raise ValueError(
                f"row {i}'s history holds token id {history.max_token_id}, outside the "
                f"vocabulary of {vocab} logits"
            )
    return num_rows, vocab


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _seeded_key(seed: int, position: int) -> tuple[int, int]:
    """The random key of a seeded row: a function of (seed, position) only.

    Distinct positions of one seed give distinct keys (splitmix64 is a bijection); the pair
    is an `mx.random.key`-shaped (hi, lo) uint32 pair.
    """
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return mixed >> 32, mixed & 0xFFFFFFFF
