"""The scheduling policy, without a model: the scheduler core runs it on hand-made results
(tests/core_driver.py); states built by the fold test it as a pure function."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
from core_driver import TOKEN, make_core, params, run_step
from helpers import DEMO_LARGE_COST
from hypothesis import given, settings
from hypothesis import strategies as st

from stepline.actors.scheduler.admission import (
    ContextLengthExceededError,
    EmptyPromptError,
    KVBudgetExceededError,
    check_admissible,
    max_output_tokens,
)
from stepline.actors.scheduler.batch_geometry import (
    MAX_GROUPS,
    decode_context,
    padded_decode_context,
    place_row,
)
from stepline.actors.scheduler.budget import MIN_PREFILL_SHARE, PREFILL_SHARE, SHORTEST_STEP
from stepline.actors.scheduler.core import SchedulerCore
from stepline.actors.scheduler.cost_model import StepCost, StepFeatures
from stepline.actors.scheduler.order import MAX_WAIT_STEPS, admission_key
from stepline.actors.scheduler.plan import SchedulerConfig, StepPlan
from stepline.actors.scheduler.policy import schedule
from stepline.actors.scheduler.prefix_index import PrefixPlan
from stepline.events.fold import RequestState, Status, fold
from stepline.events.models import Admitted, ChunkPrefilled, TokensSampled


def next_plan(core: SchedulerCore) -> StepPlan:
    """Run the core's next step on what a model would return, and return its plan."""
    return run_step(core)[0].plan


def test_three_long_prompts_share_the_budget_then_decode_first():
    core = make_core(config=SchedulerConfig(max_step_tokens=1024, long_prefill_cap=400))
    for rid in "abc":
        core.add(rid, range(800), params())
    steps = [next_plan(core) for _ in range(3)]
    assert [c.num_tokens for c in steps[0].chunks] == [400, 400, 224]
    assert [c.num_tokens for c in steps[1].chunks] == [400, 400, 224]
    assert steps[2].decodes == ("a", "b")
    assert [(c.request_id, c.num_tokens) for c in steps[2].chunks] == [("c", 352)]
    assert steps[2].num_tokens == 354


def test_every_prompt_is_covered_once_by_contiguous_chunks_within_budget():
    rng = random.Random(0)
    config = SchedulerConfig(max_step_tokens=97, max_num_seqs=5, long_prefill_cap=40)
    core = make_core(config=config)
    lengths = {f"r{i}": rng.randint(1, 300) for i in range(20)}
    covered: dict[str, list[tuple[int, int]]] = {rid: [] for rid in lengths}
    for rid, n in lengths.items():
        core.add(rid, range(n), params(rng.randint(1, 5)))
    for _ in range(1000):
        plan = next_plan(core)
        for c in plan.chunks:
            covered[c.request_id].append((c.start, c.end))
        if not core.states:
            break
    assert not core.states  # every request ended (by length)
    for rid, chunks in covered.items():
        assert chunks[0][0] == 0 and chunks[-1][1] == lengths[rid]
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))


def test_decodes_are_scheduled_before_any_prefill():
    core = make_core(
        config=SchedulerConfig(max_step_tokens=10, max_num_seqs=4, long_prefill_cap=10)
    )
    core.add("d1", range(3), params())
    core.add("d2", range(3), params())
    next_plan(core)  # both prefill fully and start decoding
    core.add("long", range(100), params())
    plan = next_plan(core)
    assert plan.decodes == ("d1", "d2")
    assert plan.chunks[0].num_tokens == 8  # what the decodes left


def test_waiting_requests_are_admitted_shortest_prompt_first():
    core = make_core(config=SchedulerConfig(max_step_tokens=10, max_num_seqs=4))
    core.add("long", range(9), params())
    core.add("short", range(3), params())
    core.add("mid", range(5), params())
    plan = next_plan(core)
    # The two shorter prompts get their first token this step; the long one starts.
    assert [(c.request_id, c.num_tokens, c.is_final) for c in plan.chunks] == [
        ("short", 3, True),
        ("mid", 5, True),
        ("long", 2, False),
    ]


def test_a_long_prompt_is_overtaken_by_shorter_ones_for_a_bounded_number_of_steps():
    core = make_core(config=SchedulerConfig(max_step_tokens=4, max_num_seqs=4))
    core.add("long", range(4), params())
    started = None
    for step in range(1, 3 * MAX_WAIT_STEPS):
        # Two short prompts arrive every step: they would fill it. One token each, so
        # nobody decodes.
        core.add(f"a{step}", range(2), params(1))
        core.add(f"b{step}", range(2), params(1))
        plan = next_plan(core)
        if any(c.request_id == "long" for c in plan.chunks):
            started = step
            break
    # Shorter prompts went first while it was young; once it had waited MAX_WAIT_STEPS
    # steps it went before every younger request.
    assert started == MAX_WAIT_STEPS + 1
    assert [c.request_id for c in plan.chunks] == ["long"]


def test_a_running_request_given_no_tokens_in_a_step_is_kept_and_resumed():
    core = make_core(config=SchedulerConfig(max_step_tokens=4, max_num_seqs=4))
    core.add("a", range(6), params())
    core.add("b", range(6), params())
    p1 = next_plan(core)
    assert [(c.request_id, c.num_tokens) for c in p1.chunks] == [("a", 4)]
    core.add("x", range(8), params())
    p2 = next_plan(core)  # a gets its last 2, b (shorter than x) starts with 2
    assert [(c.request_id, c.start, c.end) for c in p2.chunks] == [("a", 4, 6), ("b", 0, 2)]
    p3 = next_plan(core)  # a decodes (1), b resumes with 3 of its 4 left; x gets nothing
    assert p3.decodes == ("a",)
    assert [(c.request_id, c.start, c.end) for c in p3.chunks] == [("b", 2, 5)]
    assert core.states["b"].status is Status.PREFILLING
    p4 = next_plan(core)
    assert [(c.request_id, c.start) for c in p4.chunks][0] == ("b", 5)


def test_a_prefill_is_only_skipped_for_prompts_that_go_before_it_and_all_finish():
    rng = random.Random(1)
    for _ in range(300):
        budget = rng.randint(2, 12)
        config = SchedulerConfig(
            max_step_tokens=budget,
            max_num_seqs=rng.randint(1, budget),
            long_prefill_cap=rng.randint(1, budget),
        )
        core = make_core(config=config)
        arrivals = sorted((rng.randint(0, 8), f"r{i}", rng.randint(1, 20)) for i in range(8))
        for step in range(200):
            for t, rid, n in arrivals:
                if t == step:
                    core.add(rid, range(n), params(3))
            if not core.states:
                continue  # nobody has arrived yet
            before = dict(core.states)
            prefilling = [r for r, s in before.items() if s.status is Status.PREFILLING]
            plan = next_plan(core)

            key = {
                rid: admission_key(s, plan.step, s.num_computed_tokens) for rid, s in before.items()
            }
            for r in prefilling:
                if r not in plan.num_scheduled_tokens:  # the prompts that went went first
                    assert all(key[c.request_id] < key[r] for c in plan.chunks)
            if step > 8 and not core.states:
                break
        assert not core.states  # every request was served to its end


def test_chats_arriving_while_a_long_prompt_prefills_go_first_unless_it_stops_moving():
    core = make_core(config=SchedulerConfig(max_step_tokens=512))
    core.add("long", range(20_000), params(1))
    for _ in range(2 * MAX_WAIT_STEPS):  # however long it has prefilled, while it moves
        next_plan(core)
    core.add("chat", range(100), params(1))
    plan = next_plan(core)  # shortest prompt left first: the chat whole, the long one after
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("chat", 100), ("long", 412)]
    # Chats that fill whole steps hold it back, but only until it has not moved for
    # MAX_WAIT_STEPS steps; then it goes first.
    held = 0
    while True:
        for i in range(2):
            core.add(f"c{plan.step}-{i}", range(256), params(1))
        plan = next_plan(core)
        if plan.chunks[0].request_id == "long":
            break
        assert all(c.request_id != "long" for c in plan.chunks)
        held += 1
    assert held == MAX_WAIT_STEPS - 1


def test_max_num_seqs_holds_when_resuming_and_admitting():
    core = make_core(
        config=SchedulerConfig(max_step_tokens=100, max_num_seqs=2, long_prefill_cap=10)
    )
    for rid in "abcd":
        core.add(rid, range(30), params(8))
    for _ in range(6):
        plan = next_plan(core)
        assert len(plan.num_scheduled_tokens) <= 2
        running = [
            s for s in core.states.values() if s.status in (Status.PREFILLING, Status.DECODING)
        ]
        assert len(running) <= 2
    assert core.states["c"].status is Status.WAITING


def test_chunks_end_exactly_at_checkpoints():
    core = make_core(config=SchedulerConfig(max_step_tokens=50, long_prefill_cap=50))
    core.add("a", range(120), params(), checkpoints=(30, 60, 100))
    plans = [next_plan(core) for _ in range(3)]
    assert [(c.start, c.end, c.checkpoints) for p in plans for c in p.chunks] == [
        (0, 50, (30,)),
        (50, 100, (60, 100)),
        (100, 120, ()),
    ]


def test_kv_admission_waits_until_capacity_frees():
    core = make_core(config=SchedulerConfig(max_step_tokens=64, max_kv_tokens=40))
    core.add("a", range(20), params(10))
    core.add("b", range(20), params(10))
    plan = next_plan(core)
    assert list(plan.num_scheduled_tokens) == ["a"]
    assert core.states["b"].status is Status.WAITING


def test_kv_admission_counts_every_running_request_as_long_as_the_longest():
    # They decode in one left-padded batch: a short chat beside a long request takes the
    # long one's room. Counted one by one (610 of 1,000) it would fit; padded (2 x 600) not.
    config = SchedulerConfig(max_step_tokens=64, max_num_seqs=8, max_kv_tokens=1000)
    core = make_core(config=config)
    core.add("long", range(60), params(540))
    next_plan(core)
    assert core.states["long"].status is Status.DECODING
    core.add("short", range(5), params(5))
    for _ in range(3):
        plan = next_plan(core)
        assert "short" not in plan.num_scheduled_tokens
    # Requests of the same length fill the budget: 4 x 250 = 1,000.
    core = make_core(config=config)
    for i in range(5):
        core.add(f"r{i}", range(10), params(240))
    plan = next_plan(core)
    assert sorted(plan.num_scheduled_tokens) == ["r0", "r1", "r2", "r3"]


def test_a_young_request_whose_kv_does_not_fit_lets_others_in_until_it_has_aged():
    config = SchedulerConfig(max_step_tokens=64, max_num_seqs=8, max_kv_tokens=100)
    core = make_core(config=config)
    core.add("running", range(10), params(40))  # KV 50, decoding from its first step
    next_plan(core)
    core.add("old", range(30), params(10))  # KV 40: fits beside it
    core.add("young", range(5), params(60))  # KV 65: shorter, but does not fit yet
    plan = next_plan(core)
    # Shortest first would try "young" first; it does not fit, so "old" goes.
    assert [c.request_id for c in plan.chunks] == ["old"]

    # Once aged, a request that does not fit holds back the younger ones.
    core = make_core(config=config)
    core.add("running", range(10), params(40))
    next_plan(core)
    core.add("big", range(30), params(30))  # KV 60: does not fit beside "running"
    for _ in range(MAX_WAIT_STEPS):
        next_plan(core)
    core.add("small", range(5), params(5))  # KV 10: would fit
    plan = next_plan(core)
    assert plan.chunks == ()
    assert core.states["small"].status is Status.WAITING


def test_only_requests_the_prefix_plan_looked_at_are_admitted():
    core = make_core(config=SchedulerConfig(max_step_tokens=64, max_num_seqs=8))
    core.add("a", range(10), params())
    core.add("b", range(5), params())
    plan = schedule(core.states, core.config, 1, prefix=PrefixPlan(considered=frozenset({"a"})))
    assert [c.request_id for c in plan.chunks] == ["a"]  # "b" is shorter but its hit unknown


def test_inadmissible_requests_say_why():
    config = SchedulerConfig(max_kv_tokens=100)
    with pytest.raises(EmptyPromptError, match="empty"):
        check_admissible(0, 10, 2048, config)
    with pytest.raises(ContextLengthExceededError, match="3000 tokens.*2048") as err:
        check_admissible(3000, 10, 2048, config)
    assert (err.value.num_prompt_tokens, err.value.max_context) == (3000, 2048)
    with pytest.raises(ValueError, match="max_tokens"):
        check_admissible(50, 80, 2048, config)


def test_a_requests_token_limit_is_what_it_asked_within_the_context_and_the_kv_budget():
    # 100 prompt tokens in a 1,000-token context: room for 900
    assert max_output_tokens(50, 100, 1000) == 50
    assert max_output_tokens(5000, 100, 1000) == 900
    assert max_output_tokens(None, 100, 1000) == 900  # asked for nothing: all the room
    # A KV budget of 500 tokens with 40 of them fixed per request leaves 360, when asked for
    kv = SchedulerConfig(max_kv_tokens=500, kv_tokens_per_seq=40)
    assert max_output_tokens(None, 100, 1000, kv) == 360
    assert max_output_tokens(5000, 100, 1000, kv) == 360
    assert max_output_tokens(5000, 100, 1000) == 900  # the context alone
    # A prompt that alone overflows the budget: 1, so that the admission check says why
    assert max_output_tokens(None, 480, 1000, kv) == 1
    with pytest.raises(KVBudgetExceededError):
        check_admissible(480, max_output_tokens(None, 480, 1000, kv), 1000, kv)


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="max_step_tokens"):
        SchedulerConfig(max_step_tokens=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="every running request decodes"):
        SchedulerConfig(max_step_tokens=16, max_num_seqs=32)


def test_a_fixed_per_request_kv_cost_counts_against_the_budget():
    # 20 + 10 tokens each fit twice in 70, but not with 10 tokens' worth of recurrent state each
    config = SchedulerConfig(max_step_tokens=64, max_kv_tokens=70, kv_tokens_per_seq=10)
    core = make_core(config=config)
    core.add("a", range(20), params(10))
    core.add("b", range(20), params(10))
    plan = next_plan(core)
    assert list(plan.num_scheduled_tokens) == ["a"]
    assert core.states["b"].status is Status.WAITING


def test_a_request_past_the_kv_budget_is_refused_in_tokens_and_gb():
    config = SchedulerConfig(max_kv_tokens=2**20, kv_bytes_per_token=2048)  # 2 GB
    with pytest.raises(KVBudgetExceededError) as err:
        check_admissible(2**20, 1, 2**22, config)
    assert (err.value.num_kv_tokens, err.value.max_kv_tokens) == (2**20 + 1, 2**20)
    assert "1048577 tokens, 2 GB" in str(err.value) and "1048576 tokens, 2 GB" in str(err.value)
    with pytest.raises(ValueError, match="max_waiting"):
        SchedulerConfig(max_waiting=0)


# -- a step-time target with a cost model ------------------------------------------------------

COST = DEMO_LARGE_COST  # roughly stepline-demo-large on a CPU (helpers.py)
TIMED = SchedulerConfig(max_step_tokens=512, max_num_seqs=32, max_step_ms=100)


def _decoders(core: SchedulerCore, n: int, prompt: int = 8) -> None:
    for i in range(n):
        core.add(f"d{i}", range(prompt), params(10_000))
    while any(s.status is not Status.DECODING for s in core.states.values()):
        next_plan(core)


def test_chunks_shrink_as_the_prompts_context_grows():
    core = make_core(config=TIMED, cost=COST)
    _decoders(core, 4)
    core.add("long", range(8000), params(1))
    sizes = []
    while "long" in core.states:  # until its first token, which ends it
        plan = next_plan(core)
        sizes += [c.num_tokens for c in plan.chunks if c.request_id == "long"]
    assert sum(sizes) == 8000
    assert all(b <= a for a, b in itertools.pairwise(sizes[:-1]))  # the last one is what's left
    assert sizes[0] < 512  # the target binds, not the token budget
    assert sizes[-2] < 0.7 * sizes[0]  # late chunks attend to far more context


def test_chunks_shrink_as_decode_rows_are_added_while_the_target_binds():
    # 16-17.5 ms of overheads: over 1 - PREFILL_SHARE of a 100 ms step (the target binds),
    # under 1 - MIN_PREFILL_SHARE (the step need not stretch past it)
    heavy = replace(COST, step=0.013, per_decode_row=0.0008)
    sizes = []
    for num_decoders in (1, 2, 3):
        core = make_core(config=TIMED, cost=heavy)
        _decoders(core, num_decoders)
        core.add("long", range(4000), params(1))
        plan = next_plan(core)
        assert plan.predicted_seconds == pytest.approx(0.1, abs=0.001)
        sizes.append(plan.chunks[0].num_tokens)
    assert sizes[0] > sizes[1] > sizes[2] >= 1


def test_where_the_overheads_are_small_steps_are_shorter_than_the_target():
    # The small demos on a CPU: 4 decode rows and a chunk's fixed cost take ~5 ms. A 100 ms
    # step would stall the decoders for 95 ms of prompt work; the step is only as long as
    # gives the prompt PREFILL_SHARE of it, and the prompt moves every step.
    small = StepCost(step=0.002, per_chunk=0.001, per_prefill_token=0.0002, per_decode_row=0.0005)
    core = make_core(config=TIMED, cost=small)
    _decoders(core, 4)
    core.add("long", range(2000), params(1))
    overheads = 0.002 + 0.001 + 4 * 0.0005
    plans = [next_plan(core) for _ in range(3)]
    for plan in plans:
        (chunk,) = plan.chunks
        assert plan.predicted_seconds <= overheads / (1 - PREFILL_SHARE) + 1e-9  # ~33 ms
        assert chunk.num_tokens * 0.0002 >= PREFILL_SHARE * plan.predicted_seconds - 0.0002
    # ...but never shorter than SHORTEST_STEP of the target: overheads near zero (a fit
    # gone wrong) must not cut a prompt into chunks of a token or two
    core = make_core(config=TIMED, cost=StepCost(per_prefill_token=0.0002))
    _decoders(core, 4)
    core.add("long", range(2000), params(1))
    (chunk,) = next_plan(core).chunks
    assert chunk.num_tokens == int(SHORTEST_STEP * 0.1 / 0.0002)


@pytest.mark.parametrize("fused_steps", [False, True])
def test_decode_rows_are_priced_as_the_padded_batch_they_decode_in(fused_steps):
    # One long conversation among short ones: the batch cache pads every row to the longest
    # of its group and attention runs over the padding, so the step costs what the padded
    # batch costs. Where steps fuse, the long one decodes in a group of its own.
    config = replace(TIMED, fused_steps=fused_steps)
    core = make_core(config=config, cost=COST)
    _decoders(core, 3)
    core.add("long-chat", range(6000), params(10_000))
    while core.states["long-chat"].status is not Status.DECODING:
        next_plan(core)
    core.add("new", range(2000), params(1))
    plan = next_plan(core)
    contexts = [decode_context(core.states[rid]) - 1 for rid in plan.decodes]  # before the step
    (chunk,) = plan.chunks
    short, long = sorted(contexts)[:3], max(contexts)
    keys = 3 * max(short) + long if fused_steps else 4 * long
    padded = StepFeatures(decode_rows=4, decode_context=keys)
    real = COST.predict(padded.with_chunk(chunk.start, chunk.num_tokens))
    assert plan.predicted_seconds == pytest.approx(real)  # what the chunk was sized by


def test_decode_groups_keep_rows_of_very_different_lengths_apart_up_to_a_few_groups():
    # a long row beside short ones goes alone; one that pads little joins the nearest group
    assert padded_decode_context([400] * 4 + [2000], split=True) == 4 * 400 + 2000
    assert padded_decode_context([400] * 4 + [2000], split=False) == 5 * 2000
    assert padded_decode_context([400, 420, 2000, 30, 2010], split=True) == 3 * 420 + 2 * 2010
    assert place_row([(4, 400), (1, 2000)], 30, split=True) == 0
    assert place_row([(4, 400), (1, 2000)], 1900, split=True) == 1
    # never more than MAX_GROUPS: past it a row joins the group it pads least
    far_apart = [1000 * (2**i) for i in range(MAX_GROUPS + 1)]
    groups = [(1, n) for n in far_apart[:MAX_GROUPS]]
    assert place_row(groups[:-1], far_apart[-2], split=True) is None
    assert place_row(groups, far_apart[-1], split=True) == MAX_GROUPS - 1


def test_a_lone_prompt_prefills_with_the_whole_budget():
    slow = StepCost(per_prefill_token=0.01)  # 512 tokens: 5 s, 50 times the target
    core = make_core(config=TIMED, cost=slow)
    core.add("long", range(2000), params(1))
    plans = [next_plan(core) for _ in range(3)]
    assert [c.num_tokens for p in plans for c in p.chunks] == [512, 512, 512]
    assert plans[0].predicted_seconds == pytest.approx(5.12)


def test_the_oldest_prefill_moves_even_when_decodes_fill_the_target():
    crowded = StepCost(per_decode_row=0.0033, per_prefill_token=0.001)  # 31 rows: 102 ms
    core = make_core(config=TIMED, cost=crowded)
    _decoders(core, 31)
    core.add("long", range(1000), params(1))
    core.add("next", range(1000), params(1))
    plan = next_plan(core)
    # The step stretches so that the 31 decode rows' 102 ms are 1 - MIN_PREFILL_SHARE of
    # it (0.57 s), and the prefill gets the rest (466 tokens at 1 ms, within the 481 that the
    # token budget leaves); the request behind it waits.
    rows = 31 * 0.0033
    stretched = rows / (1 - MIN_PREFILL_SHARE)
    n = int((stretched - rows) / 0.001 + 1e-9)
    assert 0 < n < 481
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("long", n)]
    assert plan.predicted_seconds == pytest.approx(rows + n * 0.001)


def test_the_token_budget_and_the_cap_stay_hard_limits_with_a_cost_model():
    free = StepCost()  # everything costs nothing: time never binds
    core = make_core(
        config=SchedulerConfig(max_step_tokens=64, long_prefill_cap=40, max_step_ms=1), cost=free
    )
    _decoders(core, 2)
    core.add("a", range(100), params(1))
    core.add("b", range(100), params(1))
    plan = next_plan(core)
    assert [c.num_tokens for c in plan.chunks] == [40, 22]
    assert plan.num_tokens == 64


def test_no_cost_model_or_no_target_means_tokens_only():
    for config, cost in [(TIMED, None), (SchedulerConfig(max_step_ms=None), COST)]:
        core = make_core(config=config, cost=cost)
        _decoders(core, 4)
        core.add("long", range(4000), params(1))
        (chunk,) = next_plan(core).chunks
        assert chunk.num_tokens == 508


@st.composite
def _loads(draw):
    cost = StepCost(
        step=draw(st.floats(0, 0.05)),
        per_chunk=draw(st.floats(0, 0.02)),
        per_prefill_token=draw(st.floats(0, 0.002)),
        per_attention=draw(st.floats(0, 1e-6)),
        per_decode_row=draw(st.floats(0, 0.01)),
        per_decode_context=draw(st.floats(0, 1e-5)),
    )
    budget = draw(st.integers(32, 1024))
    config = SchedulerConfig(
        max_step_tokens=budget,
        max_num_seqs=draw(st.integers(1, 32)),
        long_prefill_cap=draw(st.none() | st.integers(1, budget)),
        max_step_ms=draw(st.floats(5, 500)),
    )
    decoders = draw(st.lists(st.integers(1, 4000), max_size=config.max_num_seqs - 1))
    prompts = draw(st.lists(st.tuples(st.integers(1, 8000), st.integers(0, 7999)), max_size=4))
    return cost, config, decoders, prompts


def _folded(requests: list[tuple[str, int, int, int]]) -> dict[str, RequestState]:
    """States as the fold makes them of (request id, prompt tokens, tokens prefilled,
    max_tokens), in arrival order; a prompt prefilled whole has its first token."""
    events: list = []

    def add(cls, **fields) -> None:
        events.append(cls(seq=len(events) + 1, ts=0.0, step=1, **fields))

    for rid, n, done, max_tokens in requests:
        add(
            Admitted,
            request_id=rid,
            num_prompt_tokens=n,
            prompt_token_ids=None,
            prompt_sha256="x",
            checkpoints=(),
            params=params(max_tokens),
        )
        if done:
            add(ChunkPrefilled, request_id=rid, start=0, end=done)
        if done == n:
            add(TokensSampled, request_ids=(rid,), token_ids=(TOKEN,))
    return fold(events)


@settings(max_examples=300, deadline=None)
@given(_loads())
def test_a_step_with_decode_rows_is_never_predicted_over_the_target(load):
    cost, config, decoders, prompts = load
    requests = [(f"d{i}", context, context, 10_000) for i, context in enumerate(decoders)]
    running = len(decoders)
    for i, (length, done) in enumerate(prompts):
        started = 0 < done < length and running < config.max_num_seqs
        running += started
        requests.append((f"p{i}", length, done if started else 0, 1))
    states = _folded(requests)
    prefilling = any(s.status is Status.PREFILLING for s in states.values())
    decode_only = schedule(
        {r: s for r, s in states.items() if s.status is Status.DECODING}, config, 1, cost
    )
    plan = schedule(states, config, 1, cost)
    assert plan.num_tokens <= config.max_step_tokens
    assert len(plan.num_scheduled_tokens) <= config.max_num_seqs
    assert plan.predicted_seconds == pytest.approx(cost.predict(plan.features))
    if not plan.decodes:
        return
    overheads = decode_only.predicted_seconds + cost.per_chunk
    limit = max(config.max_step_ms / 1e3, overheads / (1 - MIN_PREFILL_SHARE))
    if plan.predicted_seconds > limit * (1 + 1e-9):
        # only the one-token floor of the oldest prefill may go over
        assert [c.num_tokens for c in plan.chunks] == [1]
    if prefilling:
        assert plan.chunks  # the oldest prefill always moves


def test_under_load_a_chunk_still_gets_most_of_the_step():
    # Every forward costs 10 ms of fixed overhead and 4 decode rows 20 ms: a 100 ms target
    # would leave the prompt 70 ms of each step, a 30 ms tax on every chunk.
    loaded = StepCost(per_chunk=0.01, per_prefill_token=0.0011, per_decode_row=0.005)
    core = make_core(config=TIMED, cost=loaded)
    _decoders(core, 4)
    core.add("long", range(4000), params(1))
    plan = next_plan(core)
    (chunk,) = plan.chunks
    # The step stretches so that its 30 ms of overheads are 1 - MIN_PREFILL_SHARE of it:
    # at 0.82, 167 ms, 137 ms of work beside them (124 tokens at 1.1 ms).
    step = 0.030 / (1 - MIN_PREFILL_SHARE)
    assert chunk.num_tokens == int((step - 0.030) / 0.0011)
    assert chunk.num_tokens * 0.0011 >= MIN_PREFILL_SHARE * step - 0.0011  # most of the step
    assert step - 0.0011 < plan.predicted_seconds <= step


def test_a_chunk_that_carries_the_decode_rows_gets_the_time_of_their_forward():
    """Where the executor fuses steps, a prompt's first chunk beside decoders pays for their
    forward built a step ahead, and its next chunks, which carry the decode rows in their
    own forward, do not; where it does not fuse, every chunk beside decoders pays for it."""
    # 15.5 ms of overheads in one forward, 17.5 ms with a forward apart: the target binds
    cost = StepCost(
        step=0.0135, per_prefill_token=0.001, per_decode_row=0.001, per_separate_decode=0.002
    )
    sizes = {}
    for fused_steps in (True, False):
        config = SchedulerConfig(max_step_tokens=512, max_step_ms=100, fused_steps=fused_steps)
        core = make_core(config=config, cost=cost)
        _decoders(core, 2)
        core.add("long", range(4000), params(1))
        plans = [next_plan(core) for _ in range(2)]
        sizes[fused_steps] = [p.chunks[0].num_tokens for p in plans]
        assert [p.features.separate_decode for p in plans] == ([1, 0] if fused_steps else [1, 1])
        for p in plans:
            assert p.predicted_seconds == pytest.approx(0.1, abs=0.0011)
    # 100 ms - 13.5 ms - 2 rows - 2 ms apart; then no forward apart
    assert sizes[True] == [82, 84]
    assert sizes[False] == [82, 82]
