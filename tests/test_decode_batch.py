"""The decode batch's placement of a plan's rows and the look-ahead's validity, without a
model: which rows draft, and that rows join or leave the batch only between steps (after the
step, where the batch's forward was built a step ahead: the bug of 2794047)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from stepline.actors.scheduler.plan import StepPlan
from stepline.engine.decode_batch import DecodeBatch, Moves
from stepline.engine.lookahead import Ahead
from stepline.engine.sampling import RowSampling
from stepline.engine.sequences import Rows, Seq
from stepline.events.models import RequestParams


def _seq(rid: str, *, solo: bool = False) -> Seq:
    params = RequestParams(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None)
    seq = Seq(rid, mx.array([1, 2]), RowSampling(temperature=0.0), None, None, params)
    seq.output, seq.solo = [3], solo
    return seq


def _batch(in_batch: list[Seq], *, ahead: bool = False) -> DecodeBatch:
    batch = DecodeBatch(split=False)
    batch.rows = Rows(in_batch)
    if ahead:
        batch.ahead = Ahead(batch.rows, mx.zeros((len(in_batch), 4)), None)
    return batch


def _plan(decodes: tuple[str, ...], drafts: dict[str, tuple[int, ...]]) -> StepPlan:
    return StepPlan(step=1, decodes=decodes, drafts=drafts)


def test_rows_that_start_or_stop_drafting_move_before_the_step_without_a_look_ahead():
    a, b, c = _seq("a"), _seq("b"), _seq("c", solo=True)
    batch = _batch([a, b])
    seqs = {s.request_id: s for s in (a, b, c)}
    # b is given drafts (it starts drafting); c is not among the drafting rows (it stops)
    placement = batch.place(_plan(("a", "b", "c"), {"b": (5, 6)}), seqs)
    assert placement.drafting == {"b": (5, 6)}
    assert placement.before == Moves(joining=("c",), leaving=("b",)) and not placement.after


def test_rows_move_only_after_the_step_whose_forward_was_built_ahead():
    """Each decodes this step where it was: b in the batch (its drafts wait), c on its own
    cache (with no drafts)."""
    a, b, c = _seq("a"), _seq("b"), _seq("c", solo=True)
    batch = _batch([a, b], ahead=True)
    seqs = {s.request_id: s for s in (a, b, c)}
    plan = _plan(("a", "b", "c"), {"b": (5, 6)})
    placement = batch.place(plan, seqs)
    assert placement.drafting == {"c": ()}
    assert placement.after == Moves(joining=("c",), leaving=("b",)) and not placement.before
    batch.check(plan, placement.drafting)  # the batch is what the plan decodes in it
    with pytest.raises(AssertionError, match="only after its decode"):
        batch.join([c])


def test_a_row_that_keeps_drafting_with_nothing_found_stays_out_of_the_batch():
    a, c = _seq("a"), _seq("c", solo=True)
    placement = _batch([a]).place(_plan(("a", "c"), {"c": ()}), {"a": a, "c": c})
    assert placement.drafting == {"c": ()} and not placement.before


class _Counted(dict):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.reads = 0

    def __getitem__(self, key):
        self.reads += 1
        return super().__getitem__(key)


def test_no_row_is_looked_up_when_every_request_is_in_the_batch():
    """(14d94f9) An engine that does not draft makes no pass over the decode rows."""
    a, b = _seq("a"), _seq("b")
    seqs = _Counted(a=a, b=b)
    placement = _batch([a, b]).place(_plan(("a", "b"), {}), seqs)
    assert placement.drafting == {} and not placement.before and not placement.after
    assert seqs.reads == 0


def test_a_plan_that_disagrees_with_the_batch_is_refused():
    batch = _batch([_seq("a")])
    with pytest.raises(RuntimeError, match="batch holds"):
        batch.check(_plan(("a", "b"), {}), {})


def test_a_look_ahead_is_valid_for_the_rows_still_in_its_batch_only():
    a, b, c = _seq("a"), _seq("b"), _seq("c")
    ahead = Ahead(Rows([a, b]), mx.zeros((2, 4)), None)
    assert ahead.valid_for(ahead.rows) and ahead.valid_for(Rows([b]))
    assert ahead.rows_of(Rows([b])) == [1]
    assert not ahead.valid_for(Rows([a, c]))
