"""Image spans in the scheduling policy, without a model (tests/core_driver.py): a span is
one atomic unit, never cut by a chunk's end; it waits for a step with room for it; one no
step could hold runs alone rather than never; its encoder is priced by the cost model; and
the prefix cache knows a span by its image's content."""

from __future__ import annotations

from dataclasses import replace

from core_driver import make_core, params, sampled

from stepline.actors.scheduler.core import SchedulerCore
from stepline.actors.scheduler.cost_model import StepCost
from stepline.actors.scheduler.plan import SchedulerConfig, StepPlan
from stepline.actors.scheduler.spans import PromptImage, prompt_key
from stepline.engine.audio import AudioData
from stepline.engine.images import ImageData
from stepline.events.fold import Status


def image(
    start: int, end: int, seed: str = "a", *, units: int = 1, whole: bool = True
) -> PromptImage:
    data = ImageData(
        data=seed.encode(),
        digest=(seed * 64)[:64],
        width=8,
        height=8,
        media_type="image/png",
        pixels=None,
    )
    return PromptImage(start, end, data, inputs={}, units=units, whole=whole)


def step(core: SchedulerCore) -> StepPlan:
    """One step of the core on what a model would return (past the budget allowed: a whole
    span no step holds runs alone)."""
    work = core.schedule()
    assert work is not None
    core.update_from_output(work, sampled(work))
    return work.plan


def work_of(core: SchedulerCore, rid: str) -> list[tuple[str, int, int]]:
    """Each step's work for `rid` until it ends: ("encode", first unit, end unit) or
    ("chunk", start, end)."""
    out = []
    while rid in core.states:
        plan = step(core)
        out += [("encode", e.start, e.end) for e in plan.encodes if e.request_id == rid]
        out += [("chunk", c.start, c.end) for c in plan.chunks if c.request_id == rid]
    return out


def test_a_whole_span_is_encoded_then_runs_in_one_chunk_alone_when_no_step_holds_it():
    core = make_core(max_step_tokens=32)
    core.add("r", range(100), params(1), images=[image(20, 60)])
    assert work_of(core, "r") == [
        ("chunk", 0, 20),  # the text before it
        ("encode", 0, 1),  # its encoder, before any of its tokens
        ("chunk", 20, 60),  # 40 tokens: more than a step holds, alone
        ("chunk", 60, 92),
        ("chunk", 92, 100),
    ]


def test_an_encoded_span_that_is_not_whole_is_chunked_as_text():
    core = make_core(max_step_tokens=32)
    core.add("r", range(100), params(1), images=[image(20, 60, units=3, whole=False)])
    assert work_of(core, "r") == [
        ("chunk", 0, 20),
        ("encode", 0, 3),  # tokens only: the encoder's work all at once
        ("chunk", 20, 52),
        ("chunk", 52, 84),
        ("chunk", 84, 100),
    ]


def test_a_whole_image_that_does_not_fit_what_is_left_of_a_step_waits_for_the_next():
    core = make_core(max_step_tokens=32)
    core.add("text", range(24), params(5))
    core.add("img", range(30), params(5), images=[image(2, 20)])
    first = step(core)
    assert [(c.request_id, c.start, c.end) for c in first.chunks] == [
        ("text", 0, 24),
        ("img", 0, 2),
    ]
    assert [(e.request_id, e.start, e.end) for e in step(core).encodes] == [("img", 0, 1)]
    third = step(core)
    assert third.decodes == ("text",)
    assert [(c.request_id, c.start, c.end) for c in third.chunks] == [("img", 2, 30)]


def test_a_chunk_cut_at_an_image_and_a_prompt_held_for_its_span_say_image():
    core = make_core(max_step_tokens=32)
    core.add("r", range(100), params(1), images=[image(20, 60)])
    chunks = []
    while "r" in core.states:
        chunks += [(c.start, c.end, c.limit) for c in step(core).chunks]
    assert chunks == [
        (0, 20, "image"),  # cut before the image: its encoder has not run
        (20, 60, "image"),  # the whole span, alone, past the budget
        (60, 92, "budget"),
        (92, 100, "prompt-end"),
    ]
    core = make_core(max_step_tokens=32)
    core.add("a", range(20), params(5))
    core.add("img", range(30), params(5), images=[image(0, 18)])
    step(core)  # a prefills; img's encoder runs
    core.add("b", range(25), params(5))
    plan = step(core)  # b takes 25 of the 31 tokens the decode row leaves: the span needs 18
    assert [c.request_id for c in plan.chunks] == ["b"] and plan.held == (("img", "image"),)


COST = StepCost(step=0.004, per_chunk=0.002, per_prefill_token=0.0002, per_decode_row=0.002)
TIMED = SchedulerConfig(max_step_tokens=512, max_num_seqs=8, max_step_ms=100)


def decoding(core: SchedulerCore, n: int) -> None:
    for i in range(n):
        core.add(f"d{i}", range(8), params(10_000))
    while any(s.status is not Status.DECODING for s in core.states.values()):
        step(core)


def test_the_encoders_units_spread_over_steps_that_keep_the_target_beside_decode_rows():
    cost = replace(COST, per_encode_unit=0.03)  # a unit costs 30 ms: 3 fit beside 4 rows
    core = make_core(config=TIMED, cost=cost)
    decoding(core, 4)
    core.add("img", range(200), params(1), images=[image(10, 110, units=10, whole=False)])
    plans = []
    while "img" in core.states:
        plans.append(step(core))
    encodes = [(e.start, e.end) for p in plans for e in p.encodes]
    assert encodes[0][0] == 0 and encodes[-1][1] == 10
    assert all(b - a <= 3 for a, b in encodes) and len(encodes) >= 4
    chunks = [(c.start, c.end) for p in plans for c in p.chunks]
    assert chunks[0] == (0, 10) and chunks[-1][1] == 200
    for p in plans:
        assert p.decodes  # the streams decode in every step, and each step keeps the target
        assert p.predicted_seconds is not None and p.predicted_seconds <= 0.1
        assert p.features.encode_units == sum(e.num_units for e in p.encodes)


def test_a_unit_larger_than_the_target_still_moves_one_a_step():
    cost = replace(COST, per_encode_unit=0.5)
    core = make_core(config=TIMED, cost=cost)
    decoding(core, 2)
    core.add("img", range(40), params(1), images=[image(0, 20, units=3, whole=False)])
    encodes = [(e.start, e.end) for p in (step(core) for _ in range(3)) for e in p.encodes]
    assert encodes == [(0, 1), (1, 2), (2, 3)]


# An omni thinker's request as audio_bench.py sends stepline-demo-omni: a 10 s clip (10
# front-end windows and 2 layers: 12 units, a 132-token span) and a 96x96 image (3 units, 38
# tokens), both atomic, in a 202-token prompt; priced about as the demo's warm-up prices it
OMNI_COST = StepCost(
    step=0.003, per_chunk=0.001, per_prefill_token=0.00003, per_decode_row=0.0003,
    per_separate_decode=0.001, per_encode_unit=0.003, per_audio_unit=0.002,
)  # fmt: skip


def clip(start: int, end: int, units: int) -> PromptImage:
    data = AudioData(b"clip", "c" * 64, "wav", 10.0, 16_000, 160_000, 16_000)
    return PromptImage(start, end, data, inputs={}, units=units, whole=True, medium="audio")


def omni_request(core: SchedulerCore, rid: str, num_tokens: int = 202) -> None:
    media = [clip(10, 142, 12), image(150, 188, units=3)]
    core.add(rid, range(num_tokens), params(1), images=media)


def plans_of(core: SchedulerCore, rid: str) -> list[StepPlan]:
    """The plans of the steps that give `rid` work, until it ends."""
    plans = []
    while rid in core.states:
        plan = step(core)
        if rid in plan.num_scheduled_tokens or any(e.request_id == rid for e in plan.encodes):
            plans.append(plan)
    return plans


def test_beside_decode_rows_a_clip_and_an_image_make_no_step_longer_than_their_prompt_as_text():
    core = make_core(config=TIMED, cost=OMNI_COST)
    decoding(core, 4)
    core.add("text", range(202), params(1))
    (as_text,) = plans_of(core, "text")  # 202 tokens: one chunk, far below the step's time
    omni_request(core, "omni")
    plans = plans_of(core, "omni")
    assert as_text.predicted_seconds is not None
    for p in plans:
        assert len(p.decodes) == 4  # the streams decode in every step
        assert p.predicted_seconds is not None and p.predicted_seconds <= as_text.predicted_seconds
    audio = [e.num_units for p in plans for e in p.encodes if e.image == 0]
    assert sum(audio) == 12 and len(audio) > 1  # the clip's units spread over steps
    # the spans each in one chunk, after their encoders
    chunks = [(c.start, c.end) for p in plans for c in p.chunks]
    assert chunks == [(0, 10), (10, 150), (150, 202)]


def test_alone_an_omni_request_runs_each_encoder_whole_in_one_step():
    core = make_core(config=TIMED, cost=OMNI_COST)
    omni_request(core, "omni")
    assert work_of(core, "omni") == [
        ("chunk", 0, 10),
        ("encode", 0, 12),  # nobody decodes: the clip's encoder in one step
        ("chunk", 10, 150),
        ("encode", 0, 3),
        ("chunk", 150, 202),
    ]


def test_an_image_late_in_a_long_prompt_is_encoded_in_steps_as_long_as_its_text_chunks():
    core = make_core(config=TIMED, cost=OMNI_COST)
    decoding(core, 4)
    core.add("long", range(3000), params(1), images=[image(2900, 2960, units=12)])
    plans = plans_of(core, "long")
    text = [p for p in plans if p.chunks and p.chunks[0].end <= 2900]
    encoding = [p for p in plans if p.encodes]
    longest = max(p.predicted_seconds or 0.0 for p in text)
    assert len(text) > 1 and all(p.predicted_seconds <= longest for p in encoding)
    # 5 units of 3 ms: what a chunk of its prompt gets (the 508 tokens the decode rows leave
    # of the budget), not a chunk of the 100 tokens left after the image (one unit a step)
    assert [e.num_units for p in encoding for e in p.encodes] == [5, 5, 2]


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


def test_an_encoder_not_priced_yet_runs_one_unit_a_step():
    core = make_core(config=TIMED, cost=COST)  # per_encode_unit 0: no measure of it yet
    decoding(core, 2)
    core.add("img", range(40), params(1), images=[image(0, 20, units=3, whole=False)])
    encodes = [(e.start, e.end) for p in (step(core) for _ in range(3)) for e in p.encodes]
    assert encodes == [(0, 1), (1, 2), (2, 3)]


def test_replay_says_where_a_request_waits_for_its_images_encoder():
    from stepline.events.replay.describe import describe_images

    core = make_core(config=TIMED, cost=COST)
    decoding(core, 2)
    core.add("img", range(40), params(1), images=[image(4, 20, units=3, whole=False)])
    assert describe_images(core.states["img"]) == ""  # waiting
    step(core)  # the text before the image
    assert describe_images(core.states["img"]) == ", image 1 of 1 encoded 0 of 3 units"
    step(core)
    assert describe_images(core.states["img"]) == ", image 1 of 1 encoded 1 of 3 units"
