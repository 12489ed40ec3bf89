"""One step's sampling on the executor, with fault isolation: a row whose sampling fails
ends that request only (`fail`); a decode batch whose forward fails raises.

`start_rows` builds a batch's samples (grammar masks, then `Sampler.start`) without
evaluating them; the runner's look-ahead starts those for the next step's decode rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import structlog

from stepline.actors.scheduler.work import (
    PREFILL_FAILED,
    SAMPLING_FAILED,
    TokenLogprob,
    is_collective_error,
)
from stepline.engine.constraints import apply_grammar_masks
from stepline.engine.sampling import PendingSample, SampleOutput, Sampler
from stepline.engine.sequences import NO_ROWS, Rows, Seq

if TYPE_CHECKING:
    from stepline.engine.lookahead import Ahead

log = structlog.get_logger(__name__)

# (request_id, what failed, the exception): end that request's executor state
Fail = Callable[[str, str, BaseException], None]


@dataclass
class Sampled:
    """The tokens a step sampled, one per request in `seqs`."""

    seqs: list[Seq]
    tokens: list[int]
    logprobs: list[TokenLogprob | None]  # None where not asked for
    any_logprobs: bool  # some row asked for them
    # `tokens` as an array where one batch sampled them all (None where rows were sampled
    # one by one): the next decode forward's inputs, with no trip through Python.
    array: mx.array | None = None

    @classmethod
    def of(cls, seqs: list[Seq], out: SampleOutput, array: mx.array | None) -> Sampled:
        return cls(seqs, out.tokens, out.logprobs, out.any_logprobs, array)

    @classmethod
    def none(cls) -> Sampled:
        return cls([], [], [], False)

    def __add__(self, other: Sampled) -> Sampled:
        """Both steps' rows, these first (no array: they were not sampled as one batch)."""
        return Sampled(
            self.seqs + other.seqs,
            self.tokens + other.tokens,
            self.logprobs + other.logprobs,
            self.any_logprobs or other.any_logprobs,
        )


def start_rows(sampler: Sampler, logits: mx.array, rows: Rows) -> PendingSample:
    if rows.constrained:  # grammar masks on those rows only
        matchers = [rows.seqs[i].constraint for i in rows.constrained]
        logits = apply_grammar_masks(logits, rows.constrained, matchers)
    return sampler.start(logits, rows.sampling, rows.positions, rows.histories)


def sample_step(
    sampler: Sampler,
    finals: list[tuple[Seq, mx.array]],
    batch: Rows,
    decoded: mx.array | None,
    fail: Fail,
) -> Sampled:
    """One token for every final chunk and, with `decoded` (its logits), every row of
    `batch`, sampled as one batch (finals first).

    If the batch fails, find out whose fault it is: each final chunk's logits and the
    decode batch are evaluated on their own, then each row is sampled alone. A row that
    still fails ends its request (`fail`); a decode batch that fails raises.
    """
    logits = [x for _, x in finals]
    rows = Rows(seq for seq, _ in finals) if finals else NO_ROWS
    if decoded is not None:
        logits.append(decoded)
        rows = rows + batch if finals else batch
    if not logits:
        return Sampled.none()
    try:
        together = mx.concatenate(logits) if len(logits) > 1 else logits[0]
        pending = start_rows(sampler, together, rows)
        return Sampled.of(rows.seqs, pending.finish(), pending.tokens)
    except Exception as exc:
        if is_collective_error(exc):
            raise
        log.warning("batched_sampling_failed", error=repr(exc), num_rows=len(rows))

    alone: list[tuple[Seq, mx.array]] = []
    for seq, x in finals:
        try:
            mx.eval(x)
        except Exception as exc:  # the final chunk's forward failed, lazily
            fail(seq.request_id, PREFILL_FAILED, exc)
            continue
        alone.append((seq, x))
    if decoded is not None:
        mx.eval(decoded)  # the batched decode forward: not one request's fault
        alone.extend((seq, decoded[i : i + 1]) for i, seq in enumerate(batch.seqs))
    sampled = Sampled.none()
    for seq, x in alone:
        try:
            out = start_rows(sampler, x, Rows([seq])).finish()
        except Exception as exc:
            fail(seq.request_id, SAMPLING_FAILED, exc)
            continue
        sampled.seqs.append(seq)
        sampled.tokens.append(out.tokens[0])
        sampled.logprobs.append(out.logprobs[0])
        sampled.any_logprobs |= out.any_logprobs
    return sampled


def sample_ahead(
    sampler: Sampler, ahead: Ahead, batch: Rows, fail: Fail, *, redo: bool = True
) -> Sampled:
    """The batch's tokens from the forward and samples started a step ahead (rows that
    ended since are skipped); if those samples fail, they are redone as `sample_step`
    does, unless not to `redo` them (a forward built on them: the failure raises)."""
    if not batch:
        return Sampled.none()
    rows = ahead.rows_of(batch)
    if ahead.sample is not None and not redo:
        out = ahead.sample.finish()
        return Sampled(
            batch.seqs,
            out.tokens if rows is None else [out.tokens[i] for i in rows],
            [None] * len(batch),
            False,
            ahead.unread(batch),
        )
    if ahead.sample is not None:
        try:
            out = ahead.sample.finish()
        except Exception as exc:
            if is_collective_error(exc):
                raise
            log.warning("batched_sampling_failed", error=repr(exc), num_rows=len(batch))
        else:
            if rows is None:
                return Sampled.of(batch.seqs, out, ahead.sample.tokens)
            return Sampled(
                batch.seqs,
                [out.tokens[i] for i in rows],
                [out.logprobs[i] for i in rows],
                out.any_logprobs,
                ahead.sample.tokens[mx.array(rows)],
            )
    logits = ahead.logits if rows is None else ahead.logits[mx.array(rows)]
    return sample_step(sampler, [], batch, logits, fail)
