"""One step's sampling on the executor, with fault isolation: a row whose sampling fails
ends that request only (`fail`); a decode batch whose forward fails raises.

`start_rows` builds a batch's samples (grammar masks, then `Sampler.start`) without
evaluating them; the runner's look-ahead starts those for the next step's decode rows.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import structlog

from stepline.engine.constraints import apply_grammar_masks
from stepline.engine.sampling import PendingSample, SampleOutput, Sampler, TokenLogprobs
from stepline.engine.sequences import Ahead, Seq
from stepline.engine.work import PREFILL_FAILED, SAMPLING_FAILED, is_collective_error

log = structlog.get_logger(__name__)

Sampled = list[tuple[Seq, int, TokenLogprobs | None]]
# (request_id, what failed, the exception): end that request's executor state
Fail = Callable[[str, str, BaseException], None]


def start_rows(sampler: Sampler, logits: mx.array, seqs: list[Seq]) -> PendingSample:
    constrained = [i for i, s in enumerate(seqs) if s.constraint is not None]
    if constrained:  # grammar masks on those rows only
        matchers = [seqs[i].constraint for i in constrained]
        logits = apply_grammar_masks(logits, constrained, matchers)
    return sampler.start(
        logits,
        [s.sampling for s in seqs],
        positions=[s.num_generated for s in seqs],
        histories=[s.history for s in seqs],
    )


def sample_rows(sampler: Sampler, logits: mx.array, seqs: list[Seq]) -> SampleOutput:
    return start_rows(sampler, logits, seqs).finish()


def sample_step(
    sampler: Sampler,
    finals: list[tuple[Seq, mx.array]],
    batch: list[Seq],
    decoded: mx.array | None,
    fail: Fail,
) -> Sampled:
    """One token for every final chunk and every decode row, sampled as one batch.

    If the batch fails, find out whose fault it is: each final chunk's logits and the
    decode batch are evaluated on their own, then each row is sampled alone. A row that
    still fails ends its request (`fail`); a decode batch that fails raises.
    """
    rows = [logits for _, logits in finals]
    if decoded is not None:
        rows.append(decoded)
    seqs = [seq for seq, _ in finals] + batch
    if not rows:
        return []
    try:
        logits = mx.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]
        out = sample_rows(sampler, logits, seqs)
        return list(zip(seqs, out.tokens, out.logprobs, strict=True))
    except Exception as exc:
        if is_collective_error(exc):
            raise
        log.warning("batched_sampling_failed", error=repr(exc), num_rows=len(seqs))

    alone: list[tuple[Seq, mx.array]] = []
    for seq, logits in finals:
        try:
            mx.eval(logits)
        except Exception as exc:  # the final chunk's forward failed, lazily
            fail(seq.request_id, PREFILL_FAILED, exc)
            continue
        alone.append((seq, logits))
    if decoded is not None:
        mx.eval(decoded)  # the batched decode forward: not one request's fault
        alone.extend((seq, decoded[i : i + 1]) for i, seq in enumerate(batch))
    sampled = []
    for seq, logits in alone:
        try:
            out = sample_rows(sampler, logits, [seq])
        except Exception as exc:
            fail(seq.request_id, SAMPLING_FAILED, exc)
            continue
        sampled.append((seq, out.tokens[0], out.logprobs[0]))
    return sampled


def sample_ahead(sampler: Sampler, ahead: Ahead, batch: list[Seq], fail: Fail) -> Sampled:
    """The batch's tokens from the forward and samples started a step ahead (rows that
    ended since are skipped); if those samples fail, they are redone as `sample_step`
    does."""
    if not batch:
        return []
    row = {rid: i for i, rid in enumerate(ahead.ids)}
    if ahead.sample is not None:
        try:
            out = ahead.sample.finish()
        except Exception as exc:
            if is_collective_error(exc):
                raise
            log.warning("batched_sampling_failed", error=repr(exc), num_rows=len(batch))
        else:
            return [
                (s, out.tokens[row[s.request_id]], out.logprobs[row[s.request_id]]) for s in batch
            ]
    rows = mx.array([row[s.request_id] for s in batch])
    return sample_step(sampler, [], batch, ahead.logits[rows], fail)
