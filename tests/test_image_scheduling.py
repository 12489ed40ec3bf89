"""Image spans in the scheduling policy, without a model (tests/core_driver.py): a span is
one atomic unit, never cut by a chunk's end; it waits for a step with room for it; one no
step could hold runs alone rather than never; its encoder is priced by the cost model; and
the prefix cache knows a span by its image's content."""

from __future__ import annotations

from core_driver import make_core, params, sampled
from helpers import DEMO_LARGE_COST

from stepline.actors.core import SchedulerCore
from stepline.engine.cost_model import StepCost
from stepline.engine.images import ImageData, PromptImage, prompt_key
from stepline.engine.policy import SchedulerConfig, StepPlan
from stepline.events.fold import Status


def image(start: int, end: int, seed: str = "a") -> PromptImage:
    data = ImageData(
        data=seed.encode(),
        digest=(seed * 64)[:64],
        width=8,
        height=8,
        media_type="image/png",
        pixels=None,
    )
    return PromptImage(start, end, data, inputs={})


def step(core: SchedulerCore) -> StepPlan:
    """One step of the core on what a model would return (past the budget allowed: a span
    no step holds runs alone)."""
    work = core.schedule()
    assert work is not None
    core.update_from_output(work, sampled(work))
    return work.plan


def chunks_of(core: SchedulerCore, rid: str) -> list[tuple[int, int, int]]:
    """(step, start, end) of each of `rid`'s chunks, until it ends."""
    out = []
    while rid in core.states:
        plan = step(core)
        out += [(plan.step, c.start, c.end) for c in plan.chunks if c.request_id == rid]
    return out


def test_a_chunk_stops_before_an_image_span_and_a_span_no_step_holds_runs_alone():
    core = make_core(max_step_tokens=32)
    core.add("r", range(100), params(1), images=[image(20, 60)])
    chunks = chunks_of(core, "r")
    assert [(s, e) for _, s, e in chunks] == [(0, 20), (20, 60), (60, 92), (92, 100)]
    assert chunks[1][0] == chunks[0][0] + 1  # the next step, and alone in it


def test_an_image_that_does_not_fit_what_is_left_of_a_step_waits_for_the_next():
    core = make_core(max_step_tokens=32)
    core.add("text", range(24), params(5))
    core.add("img", range(30), params(5), images=[image(0, 20)])
    first = step(core)
    assert [(c.request_id, c.start, c.end) for c in first.chunks] == [("text", 0, 24)]
    second = step(core)
    assert second.decodes == ("text",)
    assert [(c.request_id, c.start, c.end) for c in second.chunks] == [("img", 0, 30)]


def test_the_encoder_is_priced_so_an_image_beside_decode_rows_keeps_the_step_target():
    config = SchedulerConfig(max_step_tokens=512, max_num_seqs=8, max_step_ms=100)
    for per_image_token, expect in [
        (0.0, [(0, 200)]),  # unpriced, the whole prompt fits the target in one step
        (0.005, [(0, 10), (10, 30), (30, 200)]),  # the span's 0.1 s: alone, then the rest
    ]:
        cost = StepCost(
            step=0.004, per_chunk=0.002, per_prefill_token=0.0002, per_decode_row=0.002,
            per_image_token=per_image_token,
        )  # fmt: skip
        core = make_core(config=config, cost=cost)
        for i in range(4):
            core.add(f"d{i}", range(8), params(10_000))
        while any(s.status is not Status.DECODING for s in core.states.values()):
            step(core)
        core.add("img", range(200), params(1), images=[image(10, 30)])
        plans = []
        while "img" in core.states:
            plans.append(step(core))
        assert [(c.start, c.end) for p in plans for c in p.chunks] == expect
        for p in plans:
            assert p.decodes  # the streams decode in every step
            if p.chunks[0].start != 10:  # the span alone may go past; the rest stays within
                assert p.predicted_seconds is not None and p.predicted_seconds <= 0.1


def test_with_the_large_demos_cost_an_image_span_and_text_share_a_step_within_the_target():
    config = SchedulerConfig(max_step_tokens=512, max_num_seqs=8, max_step_ms=100)
    cost = StepCost(**{**DEMO_LARGE_COST.__dict__, "per_image_token": 0.0001})
    core = make_core(config=config, cost=cost)
    core.add("img", range(120), params(1), images=[image(40, 80)])
    plan = step(core)  # nobody decodes: as much as the token rules allow, span whole
    assert [(c.start, c.end) for c in plan.chunks] == [(0, 120)]
    assert plan.features.image_tokens == 40


def test_the_prefix_cache_knows_a_span_by_its_image_and_the_text_around_it_by_its_tokens():
    ids = list(range(50))
    one = prompt_key(ids, [image(10, 30, "a")])
    same = prompt_key(ids, [image(10, 30, "a")])
    other = prompt_key(ids, [image(10, 30, "b")])
    assert one == same and one[:10] == other[:10] == tuple(ids[:10])
    assert one[30:] == other[30:] == tuple(ids[30:])
    assert one[10] != other[10]  # different images part at their span's first token
    assert all(t < 0 for t in one[10:30])  # never a token id
    assert prompt_key(ids, []) == tuple(ids)


def test_checkpoints_inside_an_image_span_are_dropped_and_spans_must_lie_in_the_prompt():
    core = make_core(max_step_tokens=64)
    core.add("r", range(40), params(1), checkpoints=[5, 15, 25], images=[image(10, 20)])
    assert core.states["r"].checkpoints == (5, 25)
    for bad in ([image(30, 50)], [image(10, 20), image(15, 25)]):
        try:
            make_core().add("x", range(40), params(1), images=bad)
        except ValueError as exc:
            assert "token span" in str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")
