"""A step's budget takes what fits and says why it took nothing (`Refused`): no model, no
policy, just the room one step has left."""

from __future__ import annotations

from core_driver import make_core, params, sampled

from stepline.actors.scheduler.budget import Refused, StepBudget
from stepline.actors.scheduler.cost_model import StepCost
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.events.fold import RequestState


def waiting(config: SchedulerConfig, *lengths: int, max_tokens: int = 3) -> list[RequestState]:
    """Waiting requests r0, r1, ... with prompts of `lengths` tokens."""
    core = make_core(config=config)
    for i, n in enumerate(lengths):
        core.add(f"r{i}", tuple(range(3, 3 + n)), params(max_tokens))
    return [core.states[f"r{i}"] for i in range(len(lengths))]


def test_a_prompt_gets_what_is_left_of_the_tokens_and_the_next_is_refused_for_the_budget():
    config = SchedulerConfig(max_step_tokens=8, max_num_seqs=4, max_step_ms=None)
    first, second = waiting(config, 20, 5)
    budget = StepBudget(config, None, running=[])

    assert budget.try_prompt(first, 0) is None
    assert [(c.start, c.end, c.limit) for c in budget.chunks] == [(0, 8, "budget")]
    assert budget.tokens_left == 0 and budget.num_running == 1
    assert budget.try_prompt(second, 0) is Refused.TOKENS
    assert Refused.TOKENS.reason == "budget"


def test_a_waiting_request_is_refused_a_slot_once_max_num_seqs_run():
    config = SchedulerConfig(max_step_tokens=64, max_num_seqs=1, max_step_ms=None)
    first, second = waiting(config, 4, 4)
    budget = StepBudget(config, None, running=[])

    assert budget.try_prompt(first, 0) is None
    assert budget.is_full
    assert budget.try_prompt(second, 0) is Refused.SEQS
    assert budget.num_scheduled == {"r0": 4}  # the refusal took nothing


def test_a_waiting_request_whose_kv_does_not_fit_beside_the_started_ones_is_refused_for_kv():
    # each request may grow to 10 + 3 tokens; two padded rows need 26 > 20
    config = SchedulerConfig(max_step_tokens=64, max_num_seqs=4, max_kv_tokens=20, max_step_ms=None)
    first, second = waiting(config, 10, 10)
    budget = StepBudget(config, None, running=[])

    assert budget.try_prompt(first, 0) is None
    assert budget.try_prompt(second, 0) is Refused.KV


def test_drafts_cut_to_the_tokens_left_say_the_budget_cut_them():
    config = SchedulerConfig(max_step_tokens=4, max_num_seqs=2, max_step_ms=None)
    core = make_core(config=config)
    core.add("d", (3, 4, 5), params(max_tokens=20))
    core.update_from_output(work := core.schedule(), sampled(work))  # prefilled: now decoding
    decoding = core.states["d"]
    budget = StepBudget(config, None, running=[decoding])
    assert budget.decodes == ["d"] and budget.tokens_left == 3

    assert budget.try_draft(decoding, (9, 9, 9, 9, 9)) is Refused.TOKENS
    assert budget.drafts == {"d": (9, 9, 9)} and budget.num_scheduled == {"d": 4}


def test_with_decode_rows_to_protect_the_first_prompt_moves_a_token_and_the_next_gets_no_time():
    config = SchedulerConfig(max_step_tokens=64, max_num_seqs=4, max_step_ms=100.0)
    cost = StepCost(per_decode_row=0.01, per_prefill_token=1.0)  # a token: 1 s, past any step
    core = make_core(config=config)
    core.add("d", (3, 4, 5), params(max_tokens=20))
    core.update_from_output(work := core.schedule(), sampled(work))
    budget = StepBudget(config, cost, running=[core.states["d"]])
    first, second = waiting(config, 4, 4)

    assert budget.try_prompt(first, 0) is None
    assert [(c.num_tokens, c.limit) for c in budget.chunks] == [(1, "floor")]
    assert budget.try_prompt(second, 0) is Refused.TIME
