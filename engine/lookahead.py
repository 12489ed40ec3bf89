"""The decode batch's look-ahead: its next forward and that forward's sampling, built as a
step ends and computed while the step loop commits the step and plans the next, as
mlx-lm's own generation loop does.

Every row's next input is known as a step ends (the token just sampled), and so is what its
sampling reads (its position, penalty history and grammar state). A row that ends meanwhile
(a stop, a cancel) is skipped, so its token is never shown: the one token in flight. The
next step's prefill chunks run after it, and its requests join the batch after it. Not
built where a prompt is mid-prefill and steps fuse: the next chunk's forward carries the
rows (`cost_model.decode_runs_apart`). A forward that cannot be built is the next step's
fault (this step's tokens stand).

A decode-only step builds the next forward on its own tokens before it reads them
(`pipeline`), and `decode_order` measures whether to start it then too.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import structlog

from stepline.actors.scheduler.cost_model import decode_runs_apart
from stepline.engine import step_sampling
from stepline.engine.decode_batch import DecodeBatch
from stepline.engine.decode_order import DecodeOrder
from stepline.engine.sampling import PendingSample, Sampler
from stepline.engine.sequences import Rows, Seq

if TYPE_CHECKING:
    from stepline.engine.step import Forwards, Step

log = structlog.get_logger(__name__)


@dataclass
class Ahead:
    """The decode batch's next forward and its samples, built and started before the step
    that uses them was planned."""

    rows: Rows  # the batch when it started; the step takes the rows still there
    logits: mx.array  # (B, V) last-position logits
    sample: PendingSample | None  # None if it could not be built: the step samples instead

    def rows_of(self, batch: Rows) -> list[int] | None:
        """Where `batch`'s rows are in this look-ahead's (None: the same rows): rows that
        left the batch since it started are skipped."""
        return None if self.rows is batch else [self.rows.index[rid] for rid in batch.ids]

    def valid_for(self, batch: Rows) -> bool:
        """Whether it computes every row of `batch` (the rows a plan decodes in the batch)."""
        return self.rows is batch or all(rid in self.rows.index for rid in batch.ids)

    def unread(self, batch: Rows) -> mx.array:
        """`batch`'s sampled tokens, as the lazy array they are until read."""
        assert self.sample is not None
        rows = self.rows_of(batch)
        return self.sample.tokens if rows is None else self.sample.tokens[mx.array(rows)]


class LookAhead:
    """Builds, starts and hands over the decode batch's look-ahead (`DecodeBatch.ahead`)."""

    def __init__(
        self,
        batch: DecodeBatch,
        forwards: Forwards,
        sampler: Sampler,
        *,
        enabled: bool,
        fused_steps: bool,
    ) -> None:
        self.batch, self.forwards, self.sampler = batch, forwards, sampler
        self.enabled = enabled
        self.fused_steps = fused_steps
        self.order = DecodeOrder()  # which order decode-only steps run in
        self.error: Exception | None = None  # a look-ahead's failed forward
        self.seconds = 0.0  # the look-ahead's own time: part of the next step's

    def raise_failed(self) -> None:
        """Raise the error of a look-ahead forward that failed (the batched decode's)."""
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def take(self, plan_rows: Rows) -> Ahead | None:
        """The look-ahead of the step about to run, now this step's (the batch holds none);
        RuntimeError if it misses a row the plan decodes in the batch (`plan_rows`)."""
        ahead, self.batch.ahead = self.batch.ahead, None
        if ahead is not None and not ahead.valid_for(plan_rows):
            raise RuntimeError(f"the look-ahead holds {ahead.rows.ids}, not {plan_rows.ids}")
        return ahead

    def drop(self) -> None:
        """The batch emptied: nothing is ahead, and a failed look-ahead blames nobody."""
        self.batch.ahead, self.error, self.seconds = None, None, 0.0

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def pipelines(self, step: Step) -> bool:
        """Whether this step's tokens are read from its look-ahead after the next forward is
        built on them (`pipeline`): decode rows only, tokens read by evaluating them, and no
        row moving after the step (the forward it builds would hold those joining and not
        those leaving)."""
        pending = step.ahead.sample if step.ahead is not None else None
        return (
            bool(step.rows)
            and not step.plan.chunks
            and pending is not None
            and pending.tokens_final
            and not step.placement.after
        )

    def decode_only(self, ahead: Ahead, rows: Rows) -> mx.array | None:
        """`pipeline`, in the order `order` picks for this many rows."""
        start_now = self.order.start(len(rows), time.perf_counter())
        return self.pipeline(ahead, rows, start_now=start_now)

    def pipeline(self, ahead: Ahead, rows: Rows, *, start_now: bool) -> mx.array | None:
        """The next step's forward built on this step's tokens while they are still being
        computed (building a graph is the host's Python: it overlaps the last of their
        computation instead of following it); the step reads them after this.

        With `start_now` (where `order` finds it faster) the forward is also started: MLX
        queues it right behind the tokens, with no gap on the device while the host reads
        them (on Metal the step loop's round trip is hidden behind it, too). Otherwise
        `start` starts it as the step's result goes back: on Linux's CPU backend starting
        work returns only once it is nearly done, and starting it here would hold the
        result back that long. A row that ends at this step's token still has the next one
        computed, never shown. Only where reading the tokens is just evaluating them: a
        failure to read them is then MLX's on the whole batch, and raises (the next forward
        depends on them). Returns the forward (None if it could not be built: the next
        step's fault)."""
        unread = ahead.unread(rows)
        try:
            started = self.forwards.decode(unread)
            if start_now:
                mx.async_eval(started)
        except Exception as exc:  # noqa: BLE001 - the batched decode's fault: see run
            self.error = exc
            return None
        return started

    def build(self, seqs: Mapping[str, Seq], started: mx.array | None = None) -> None:
        """Build (lazily) the next step's decode forward and its sampling (see the module
        docstring); `start` starts computing them. `started`: the forward, already built
        (and maybe started) by `pipeline`; only its sampling is built here."""
        batch = self.batch.rows
        if not self.enabled or not batch or self.error is not None:
            return
        # Requests outside the batch are prefilling, drafting (their rows run in the next
        # step's fused forward, as a chunk does), parked, or ended at their first token.
        prefilling = len(seqs) > len(batch) and any(
            s.cache is not None and not s.parked and (s.solo or not s.output) for s in seqs.values()
        )
        if started is None and not decode_runs_apart(
            fused_steps=self.fused_steps, prefilling=prefilling
        ):
            return  # a prompt is mid-prefill: the next step runs these rows in its chunk's forward
        # (A forward already built has written the rows' caches: it is kept, whatever comes.)
        logits = started
        if logits is None:
            try:
                logits = self.forwards.decode(self.batch.next_inputs())
            except Exception as exc:  # noqa: BLE001 - the batched decode's fault: see run
                self.error = exc
                return
        try:
            sample: PendingSample | None = step_sampling.start_rows(self.sampler, logits, batch)
        except Exception as exc:  # noqa: BLE001 - the step samples again, and isolates it
            log.info("look_ahead_sampling_deferred", error=repr(exc))
            sample = None
        self.batch.ahead = Ahead(batch, logits, sample)

    def start(self) -> None:
        """Compute the look-ahead the last step built (after a decode-only step that started
        it, its forward is already running: this starts its sampling). Run right after a
        step, as its result goes back: MLX computes without the GIL while the step loop
        commits that step and plans the next. Never raises: a failure is the next step's."""
        ahead = self.batch.ahead
        if ahead is None:
            return
        t0 = time.perf_counter()
        try:
            mx.async_eval(ahead.logits, *(ahead.sample.arrays() if ahead.sample else ()))
        except Exception as exc:  # noqa: BLE001 - the next step reads it again
            log.info("look_ahead_failed", error=repr(exc))
        self.seconds = time.perf_counter() - t0
