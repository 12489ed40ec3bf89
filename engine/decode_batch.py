"""The decode batch: the requests that decode together, one token a row a step, their
caches (`engine/decode_groups.py`, over mlx-lm's `merge`/`extend`/`filter`/`extract`), each
row's next input, and which requests draft instead (actors/scheduler/drafter.py: a drafting
request decodes against its own cache, outside the batch).

Rows change only between steps: a finished prefill joins, an ended request is filtered
out, a row that starts drafting leaves (it takes its cache out), one that stops drafting
joins again; a row parked for fair share (actors/scheduler/seats.py) leaves after the step
it decodes in, its cache taken out, and joins again after the step that resumes it.
While the batch's next forward is built ahead (`engine/lookahead.py`), every
row's cache already holds its last token: rows may still end, but none joins or leaves
until that forward's step is over (`place` defers those moves to after it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from stepline.actors.scheduler.plan import StepPlan
from stepline.engine.decode_groups import DecodeCaches
from stepline.engine.sequences import NO_ROWS, Cache, Rows, Seq

if TYPE_CHECKING:
    from stepline.engine.lookahead import Ahead


@dataclass(frozen=True)
class Moves:
    """Requests that change place between two steps."""

    joining: tuple[str, ...] = ()  # drafting requests that stopped drafting: into the batch
    leaving: tuple[str, ...] = ()  # batch rows that start drafting: out of it
    parking: tuple[str, ...] = ()  # rows parked: out of it, not decoding
    resuming: tuple[str, ...] = ()  # parked requests: into it

    def __bool__(self) -> bool:
        return bool(self.joining or self.leaving or self.parking or self.resuming)


@dataclass(frozen=True)
class Placement:
    """Where a plan's decode rows run this step, and which rows move before and after it."""

    # request id -> its drafts, for every row that decodes on its own cache this step
    drafting: dict[str, tuple[int, ...]]
    before: Moves = field(default_factory=Moves)  # moved before the step's forward
    after: Moves = field(default_factory=Moves)  # moved after it (a forward built ahead)


class DecodeBatch:
    """The decode batch (see the module docstring). `split`: whether its caches may be kept
    in groups of similar lengths (the model runs fused forwards)."""

    def __init__(self, split: bool) -> None:
        self.rows = NO_ROWS  # its requests, in row order
        self.caches = DecodeCaches(split=split)
        # Its next forward, built before its step was planned (`engine/lookahead.py`).
        self.ahead: Ahead | None = None
        # Each row's last token, the next forward's input, where the array is at hand (the
        # tokens just sampled); None: gathered from the rows' outputs when next needed.
        self._inputs: mx.array | None = None

    def __len__(self) -> int:
        return len(self.rows)

    # -- which rows draft -----------------------------------------------------

    def place(self, plan: StepPlan, seqs: Mapping[str, Seq]) -> Placement:
        """The rows that draft this step: those given drafts, and those already drafting
        that the plan keeps drafting (none found this step), as the core's rule
        (`Drafter.planned`). A drafting row that stops joins the batch and a batch row that
        starts drafting leaves it, before the step's forward; where the batch's forward for
        this step was built ahead, after it (each decodes this step where it was)."""
        drafting = {
            rid: d for rid, d in plan.drafts.items() if rid in seqs and (d or seqs[rid].solo)
        }
        joining = (
            [rid for rid in plan.decodes if rid not in drafting and rid in seqs and seqs[rid].solo]
            if seqs.keys() != self.rows.index.keys()  # (only then is a request solo)
            else []
        )
        leaving = [rid for rid in drafting if not seqs[rid].solo]
        moves = Moves(tuple(joining), tuple(leaving))
        seats = Moves(parking=plan.parks, resuming=plan.resumes)  # always after the step
        if self.ahead is None:
            return Placement(drafting, before=moves, after=seats)
        stay = {rid: d for rid, d in drafting.items() if rid not in moves.leaving}
        after = Moves(moves.joining, moves.leaving, seats.parking, seats.resuming)
        return Placement(stay | {rid: () for rid in joining}, after=after)

    def check(self, plan: StepPlan, drafting: Collection[str]) -> None:
        """Raise RuntimeError unless the batch holds exactly the rows the plan decodes in it."""
        if self.rows.index.keys() != {rid for rid in plan.decodes if rid not in drafting}:
            raise RuntimeError(
                f"plan decodes {sorted(plan.decodes)} (drafting: {sorted(drafting)}) but the "
                f"batch holds {sorted(self.rows.ids)}"
            )

    def move(self, moves: Moves, seqs: Mapping[str, Seq]) -> None:
        """Between steps: requests that stopped drafting join, rows that start leave; rows
        parked leave, parked requests resuming join."""
        self._stop_drafting([seqs[rid] for rid in moves.joining if rid in seqs])
        self._start_drafting([rid for rid in moves.leaving if rid in seqs])
        self._park([rid for rid in moves.parking if rid in seqs], seqs)
        self._resume([seqs[rid] for rid in moves.resuming if rid in seqs])

    def _park(self, request_ids: Sequence[str], seqs: Mapping[str, Seq]) -> None:
        """Each row takes its cache out of the batch and waits (a drafting row has it)."""
        self._start_drafting([rid for rid in request_ids if not seqs[rid].solo])
        for rid in request_ids:
            seqs[rid].parked = True

    def _resume(self, seqs: Sequence[Seq]) -> None:
        """Parked requests join the batch with their caches."""
        resuming = [s for s in seqs if s.parked]
        for seq in resuming:
            seq.parked = False
        self._stop_drafting(resuming)

    def _stop_drafting(self, seqs: Sequence[Seq]) -> None:
        joining = [s for s in seqs if s.solo and s.output and s.cache is not None]
        for seq in joining:
            seq.solo = False
        self.join(joining)

    def _start_drafting(self, request_ids: Sequence[str]) -> None:
        """Each row takes its own copy of its cache out of the batch and decodes on it."""
        index = self.rows.index
        rows = sorted(index[rid] for rid in request_ids if rid in index)
        if not rows:
            return
        assert self.ahead is None, "rows leave the batch only after its decode"
        for row in rows:
            seq = self.rows.seqs[row]
            seq.cache, seq.solo = self.caches.extract(row), True
        gone = set(rows)
        self.filter([i for i in range(len(self.rows)) if i not in gone])

    # -- rows joining and leaving ---------------------------------------------

    def join(self, seqs: Sequence[Seq]) -> None:
        """Merge finished prefills into the batch (each `Seq.cache` is taken)."""
        if not seqs:
            return
        assert self.ahead is None, "rows join the batch only after its decode"
        old = self.rows.seqs
        order = self.caches.join(old, seqs)
        at_end = all(a is b for a, b in zip(order, old, strict=False))  # joined after them
        if self._inputs is not None and at_end:
            joined = mx.array([s.last_token for s in order[len(old) :]], dtype=mx.int32)
            self._inputs = mx.concatenate([self._inputs, joined])
        else:
            self._inputs = None
        self.rows = Rows(order)

    def remove(self, request_ids: Collection[str]) -> None:
        """Rows of ended requests go (those of `request_ids` in the batch)."""
        if not self.rows.index.keys().isdisjoint(request_ids):
            self.filter([i for i, rid in enumerate(self.rows.ids) if rid not in request_ids])

    def filter(self, keep: list[int]) -> None:
        """Keep only the rows `keep` (ascending)."""
        self.rows = self.rows.take(keep)
        self.caches.filter(keep)
        if not keep:
            self._inputs = self.ahead = None
        elif self._inputs is not None:
            self._inputs = self._inputs[mx.array(keep)]

    def extract(self, request_id: str) -> Cache:
        """That row's cache, a request's own (mlx-lm's `extract`)."""
        return self.caches.extract(self.rows.index[request_id])

    # -- a step's inputs ------------------------------------------------------

    def next_inputs(self) -> mx.array:
        """Each row's last token: the batch's next forward's inputs (B,)."""
        if self._inputs is None:
            self._inputs = mx.array([s.last_token for s in self.rows.seqs], dtype=mx.int32)
        return self._inputs

    def took(self, rows: Rows, array: mx.array | None) -> None:
        """The rows `rows` took their tokens, `array` (None where sampled one by one): the
        next forward's inputs, if the batch is still those rows."""
        kept = array is not None and self.rows is rows
        self._inputs = array.astype(mx.int32) if array is not None and kept else None

    def forget_inputs(self) -> None:
        """A row's last token changed: the inputs are gathered again when next needed."""
        self._inputs = None
