"""Why a plan is what it is: what sized each prompt chunk (`ScheduledChunk.limit`) and which
requests sat a step out, and why (`StepPlan.held`). The policy without a model
(tests/core_driver.py), its steps priced by fixed cost models."""

from __future__ import annotations

from core_driver import make_core, params, run_step
from helpers import DEMO_LARGE_COST

from stepline.actors.scheduler.core import SchedulerCore
from stepline.actors.scheduler.cost_model import StepCost
from stepline.actors.scheduler.plan import SchedulerConfig, StepPlan
from stepline.actors.scheduler.policy import schedule
from stepline.actors.scheduler.prefix_index import PrefixPlan
from stepline.events.fold import Status
from stepline.events.models import MAX_HELD, StepPlanned

TIMED = SchedulerConfig(max_step_tokens=512, max_num_seqs=32, max_step_ms=100)


def next_plan(core: SchedulerCore) -> StepPlan:
    return run_step(core)[0].plan


def decoders(core: SchedulerCore, n: int) -> None:
    for i in range(n):
        core.add(f"d{i}", range(8), params(10_000))
    while any(s.status is not Status.DECODING for s in core.states.values()):
        next_plan(core)


def chunks_of(core: SchedulerCore, rid: str) -> list[tuple[int, str | None]]:
    """Run steps until `rid`'s prompt is done: its chunks' sizes and limits."""
    chunks = []
    while core.states[rid].status is not Status.DECODING:
        chunks += [(c.num_tokens, c.limit) for c in next_plan(core).chunks if c.request_id == rid]
    return chunks


# -- what sized a chunk -------------------------------------------------------------------------


def test_a_long_prompt_beside_decoders_is_cut_by_the_time_target_and_ends_at_its_prompt_end():
    core = make_core(config=TIMED, cost=DEMO_LARGE_COST)
    decoders(core, 4)
    core.add("long", range(3000), params(10))
    chunks = chunks_of(core, "long")
    assert sum(n for n, _ in chunks) == 3000
    assert [limit for _, limit in chunks] == ["time"] * (len(chunks) - 1) + ["prompt-end"]
    assert chunks[0][0] < 512 - 4  # the time target cut it, not the budget


def test_a_lone_long_prompt_is_cut_by_the_budget_and_ends_at_its_prompt_end():
    core = make_core(config=TIMED, cost=DEMO_LARGE_COST)  # nobody decodes: no time target
    core.add("long", range(1200), params(10))
    assert chunks_of(core, "long") == [(512, "budget"), (512, "budget"), (176, "prompt-end")]


def test_a_long_prompt_beside_decoders_gets_what_the_budget_leaves_when_time_is_cheap():
    core = make_core(config=TIMED, cost=StepCost(per_decode_row=0.001))  # tokens cost nothing
    decoders(core, 4)
    core.add("long", range(1000), params(10))
    assert chunks_of(core, "long") == [(508, "budget"), (492, "prompt-end")]


def test_where_the_step_stretches_past_the_target_the_chunk_is_held_at_the_floor():
    # 31 decode rows take 102 ms: the step stretches to keep MIN_PREFILL_SHARE of it for the
    # prompt, and the chunk is the smallest the time target may cut it to
    crowded = StepCost(per_decode_row=0.0033, per_prefill_token=0.001)
    core = make_core(config=TIMED, cost=crowded)
    decoders(core, 31)
    core.add("long", range(1000), params(1))
    (chunk,) = next_plan(core).chunks
    assert 0 < chunk.num_tokens < 512 - 31 and chunk.limit == "floor"


def test_a_prompt_deep_in_its_context_moves_by_the_one_token_floor():
    # attention at offset 2,900 costs 0.3 s a token: no token fits the step, but the first
    # prompt in the order always moves
    deep = StepCost(per_decode_row=0.001, per_prefill_token=0.0001, per_attention=1e-4)
    core = make_core(config=TIMED, cost=deep)
    decoders(core, 2)
    core.add("long", range(3000), params(1))
    plan = schedule(
        core.states, core.config, core.step + 1, deep, PrefixPlan(cached={"long": 2900})
    )
    assert [(c.start, c.num_tokens, c.limit) for c in plan.chunks] == [(2900, 1, "floor")]


def test_the_long_prefill_cap_names_itself_and_the_harder_limit_wins_a_tie():
    capped = SchedulerConfig(max_step_tokens=64, max_num_seqs=4, long_prefill_cap=40)
    core = make_core(config=capped)
    core.add("a", range(100), params())
    assert chunks_of(core, "a") == [(40, "long-prefill-cap")] * 2 + [(20, "prompt-end")]
    # where two limits give the same size: the prompt's end, then the budget, then the cap
    core = make_core(config=SchedulerConfig(max_step_tokens=64, long_prefill_cap=64))
    core.add("b", range(128), params())
    assert chunks_of(core, "b") == [(64, "budget"), (64, "prompt-end")]


def test_a_chunk_runs_through_a_checkpoint_and_is_named_by_what_sized_it():
    # Chunks are not cut at checkpoints (the runner snapshots inside them): no chunk says
    # "checkpoint", even one that happens to end at one.
    core = make_core(config=SchedulerConfig(max_step_tokens=50))
    core.add("a", range(120), params(), checkpoints=(30, 100))
    plans = [next_plan(core) for _ in range(3)]
    assert [(c.end, c.checkpoints, c.limit) for p in plans for c in p.chunks] == [
        (50, (30,), "budget"),
        (100, (100,), "budget"),
        (120, (), "prompt-end"),
    ]


# -- who sat a step out -------------------------------------------------------------------------


def test_a_waiting_request_past_max_num_seqs_is_held_for_it():
    core = make_core(config=SchedulerConfig(max_step_tokens=100, max_num_seqs=2))
    for rid in "abc":
        core.add(rid, range(30), params(8))
    plan = next_plan(core)
    assert [c.request_id for c in plan.chunks] == ["a", "b"]
    assert plan.held == (("c", "max-num-seqs"),)


def test_a_waiting_request_whose_kv_does_not_fit_is_held_for_kv():
    core = make_core(config=SchedulerConfig(max_step_tokens=64, max_kv_tokens=40))
    core.add("a", range(20), params(10))
    core.add("b", range(20), params(10))
    plan = next_plan(core)
    assert [c.request_id for c in plan.chunks] == ["a"] and plan.held == (("b", "kv"),)


def test_prompts_the_budget_did_not_reach_are_held_for_the_budget():
    core = make_core(config=SchedulerConfig(max_step_tokens=64, max_num_seqs=4))
    for rid in "abc":
        core.add(rid, range(100), params())
    plan = next_plan(core)
    assert [c.request_id for c in plan.chunks] == ["a"]
    assert plan.held == (("b", "budget"), ("c", "budget"))


def test_a_prompt_the_time_target_left_no_room_is_held_for_time():
    core = make_core(config=TIMED, cost=DEMO_LARGE_COST)
    decoders(core, 4)
    core.add("a", range(2000), params(1))
    core.add("b", range(2000), params(1))
    plan = next_plan(core)
    assert [c.request_id for c in plan.chunks] == ["a"] and plan.held == (("b", "time"),)


def test_a_request_waiting_for_a_prefix_being_computed_is_held_for_the_prefix():
    core = make_core(config=SchedulerConfig(max_step_tokens=64, max_num_seqs=4))
    core.add("a", range(10), params())
    core.add("b", range(10), params())
    plan = schedule(core.states, core.config, 1, prefix=PrefixPlan(deferred=frozenset({"b"})))
    assert [c.request_id for c in plan.chunks] == ["a"] and plan.held == (("b", "prefix"),)


def test_a_client_past_its_share_whose_place_another_client_took_is_held_for_fair_share():
    core = make_core(config=SchedulerConfig(max_step_tokens=10, max_num_seqs=4))
    core.add("a0", range(2), params(100), client="a")
    core.add("a1", range(2), params(100), client="a")
    next_plan(core)  # client a runs its share (4 slots / 2 clients)
    core.add("a2", range(3), params(), client="a")
    core.add("b0", range(8), params(), client="b")
    plan = next_plan(core)
    # a2 is shorter and would have gone first; b0 took the 8 tokens the decode rows left
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("b0", 8)]
    assert plan.held == (("a2", "fair-share"),)


def test_at_most_max_held_are_named_a_step_the_oldest_first():
    core = make_core(config=SchedulerConfig(max_step_tokens=64, max_num_seqs=2))
    for i in range(12):
        core.add(f"r{i:02}", range(40 - i), params())  # the youngest is the shortest
    plan = next_plan(core)
    assert [c.request_id for c in plan.chunks] == ["r11", "r10"]
    assert plan.held == tuple((f"r{i:02}", "max-num-seqs") for i in range(MAX_HELD))


def test_the_step_event_records_each_members_limit_and_the_held_requests():
    core = make_core(config=SchedulerConfig(max_step_tokens=16, max_num_seqs=4))
    core.add("d", range(4), params(10))
    next_plan(core)
    core.add("long", range(100), params())
    core.add("queued", range(100), params())
    core.add("late", range(100), params())
    next_plan(core)
    (step,) = [e for e in core.take_events() if isinstance(e, StepPlanned)][-1:]
    assert step.request_ids == ("d", "long")
    assert step.limits == (None, "budget")
    assert (step.held_ids, step.held_reasons) == (("queued", "late"), ("budget", "budget"))
