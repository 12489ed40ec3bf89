"""Why one request took the time it took: where its first token's time went, what sized its
prompt chunks, why it sat steps out, what stalled its stream and whose streams it stalled.

One pass over the request's run (and model) with the summary's own fold (summary/fold.py), told to
follow the request: the stall threshold and the causes are the summary's, so the figures of
`--request` and of the summary add up.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from stepline.events.replay.stalls import StallCause
from stepline.events.replay.stats import Report
from stepline.events.replay.timeline import StepSpan

_CAUSES_SHOWN = 5


class StallSuffered(Report):
    """Waits over the threshold between two of the request's tokens, laid at one cause."""

    cause: str | None  # the request whose prompt work made the waits; None: no prompt work
    num_stalls: int
    seconds: float
    worst_step: int  # the slowest step of its longest wait
    worst_s: float


class RequestWhy(Report):
    request_id: str
    queued_s: float | None  # admission -> its first step
    num_steps_waiting: int  # steps that ran between its admission and its first step
    held: dict[str, int]  # why it sat out steps it could have joined: reason -> steps
    num_chunks: int  # its prompt chunks (steps it prefilled in)
    num_prefill_tokens: int  # prompt tokens those chunks computed
    prefill_s: float  # admission of its first chunk -> the end of its last chunk's step
    prefill_steps_s: float | None  # the mean time of the steps it prefilled in
    limits: dict[str, int]  # what sized its chunks: limit -> chunks (empty before schema 7)
    stall_threshold_s: float
    suffered: tuple[StallSuffered, ...]  # its stalls, by cause, most seconds first
    num_suffered: int
    suffered_s: float
    caused: StallCause | None  # the stalls of other requests' streams its prompt work caused
    # speculative decoding: drafted tokens verified, kept, and the steps it drafted in
    num_drafted: int = 0
    num_kept: int = 0
    num_drafting_steps: int = 0

    def drafts_line(self) -> str | None:
        """'drafts: 120 proposed in 30 steps, 96 kept (80%)'; None where it drafted none."""
        if not self.num_drafted:
            return None
        share = 100 * self.num_kept / self.num_drafted
        steps = f"{self.num_drafting_steps} step" + ("s" if self.num_drafting_steps != 1 else "")
        return (
            f"drafts: {self.num_drafted} proposed in {steps}, {self.num_kept} kept ({share:.0f}%)"
        )

    def summary_line(self) -> str:
        """'prefill: 57 chunks x 48.1 ms mean step, bound by time target 41, budget 15, ...'"""
        if not self.num_chunks:
            return "no prompt chunk computed"
        mean = (
            f" x {self.prefill_steps_s * 1000:.1f} ms mean step"
            if self.prefill_steps_s is not None
            else ""
        )
        bound = ", ".join(f"{_LIMIT_NAMES.get(k, k)} {n}" for k, n in self.limits.items())
        chunks = f"{self.num_chunks} chunk" + ("s" if self.num_chunks != 1 else "")
        return (
            f"prefill: {chunks}{mean} ({self.num_prefill_tokens} tokens in "
            f"{self.prefill_s * 1000:.0f} ms)" + (f", bound by {bound}" if bound else "")
        )


_LIMIT_NAMES = {
    "time": "the step-time target",
    "budget": "the token budget",
    "floor": "the floor (the least a prompt gets past the time target)",
    "prompt-end": "the prompt's end",
    "checkpoint": "a checkpoint",
    "long-prefill-cap": "the long-prefill cap",
    "kv": "KV memory",
    "image": "an image span",
}


@dataclass
class Focus:
    """What the summary's fold notes of the request it follows."""

    request_id: str
    admitted_ts: float | None = None
    first_step: int | None = None
    first_step_ts: float | None = None
    steps_waiting: int = 0  # steps planned between its admission and its first
    held: Counter[str] = field(default_factory=Counter)
    limits: Counter[str] = field(default_factory=Counter)
    num_chunks: int = 0
    num_prefill_tokens: int = 0
    chunk_steps: set[int] = field(default_factory=set)
    chunk_seconds: list[float] = field(default_factory=list)
    first_chunk_ts: float | None = None
    last_chunk_end: float | None = None
    waits: list[tuple[float, StepSpan | None]] = field(default_factory=list)
    num_drafted: int = 0
    num_kept: int = 0
    num_drafting_steps: int = 0

    def drafted(self, proposed: int, kept: int) -> None:
        self.num_drafted += proposed
        self.num_kept += kept
        self.num_drafting_steps += 1

    def planned(self, event, step_ts: float) -> None:  # a step (validated or light)
        ids = event.request_ids
        rid = self.request_id
        if rid in event.held_ids:
            self.held[event.held_reasons[event.held_ids.index(rid)]] += 1
        if rid not in ids:
            if self.admitted_ts is not None and self.first_step is None:
                self.steps_waiting += 1
            return
        i = ids.index(rid)
        if self.first_step is None:
            self.first_step, self.first_step_ts = event.step, step_ts
        if event.kinds[i] == "prefill":
            self.num_chunks += 1
            self.num_prefill_tokens += event.num_tokens[i]
            self.chunk_steps.add(event.step)
            if self.first_chunk_ts is None:
                self.first_chunk_ts = step_ts
            if event.limits and event.limits[i] is not None:
                self.limits[event.limits[i]] += 1

    def finished(self, step: int, seconds: float, end_ts: float) -> None:
        if step in self.chunk_steps:
            self.chunk_seconds.append(seconds)
            self.last_chunk_end = end_ts


def explain(focus: Focus, threshold: float, caused: StallCause | None) -> RequestWhy:
    """The request's why, from what the fold noted (`focus`) and the run's stall threshold."""
    by_cause: dict[str | None, list[tuple[float, StepSpan | None]]] = {}
    for gap, span in focus.waits:
        if threshold > 0 and gap >= threshold:
            by_cause.setdefault(span.cause if span else None, []).append((gap, span))
    suffered = []
    for cause, waits in by_cause.items():
        gap, span = max(waits, key=lambda w: w[0])
        suffered.append(
            StallSuffered(
                cause=cause,
                num_stalls=len(waits),
                seconds=sum(w[0] for w in waits),
                worst_step=span.step if span else 0,
                worst_s=gap,
            )
        )
    suffered.sort(key=lambda s: -s.seconds)
    queued = (
        focus.first_step_ts - focus.admitted_ts
        if focus.first_step_ts is not None and focus.admitted_ts is not None
        else None
    )
    chunks = focus.chunk_seconds
    return RequestWhy(
        request_id=focus.request_id,
        queued_s=queued,
        num_steps_waiting=focus.steps_waiting,
        held=dict(focus.held.most_common()),
        num_chunks=focus.num_chunks,
        num_prefill_tokens=focus.num_prefill_tokens,
        prefill_s=(
            focus.last_chunk_end - focus.first_chunk_ts
            if focus.last_chunk_end is not None and focus.first_chunk_ts is not None
            else 0.0
        ),
        prefill_steps_s=sum(chunks) / len(chunks) if chunks else None,
        limits=dict(focus.limits.most_common()),
        stall_threshold_s=threshold,
        suffered=tuple(suffered[:_CAUSES_SHOWN]),
        num_suffered=sum(s.num_stalls for s in suffered),
        suffered_s=sum(s.seconds for s in suffered),
        caused=caused,
        num_drafted=focus.num_drafted,
        num_kept=focus.num_kept,
        num_drafting_steps=focus.num_drafting_steps,
    )
