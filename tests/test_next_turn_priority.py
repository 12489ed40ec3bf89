"""A next turn's prefill (`Admitted.origin` "next-turn", api/pipeline/next_turn.py) takes only
what no client's request wants (actors/scheduler/background.py): a client's request is
scheduled exactly as it would be without it, under a fixed cost model; one that needs its seat
or its KV ends it. The scheduler core alone, no model."""

from __future__ import annotations

from core_driver import make_core, params, run_step

from stepline.actors.scheduler.background import PREEMPTED, STALE
from stepline.actors.scheduler.cost_model import StepCost
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.actors.scheduler.prefix_index import PrefixIndex
from stepline.events.fold import fold
from stepline.events.models import FinishReason

# Prefill 1 ms a token, 5 ms a step, a decode row 2 ms: a 40 ms target holds ~30 prompt
# tokens beside a decode row.
COST = StepCost(step=5e-3, per_prefill_token=1e-3, per_decode_row=2e-3)


def _config(**kw) -> SchedulerConfig:
    return SchedulerConfig(**{"max_step_tokens": 64, "max_num_seqs": 4, "max_step_ms": 40.0, **kw})


def _client_schedule(with_next_turns: bool) -> tuple[list[tuple[int, str, int, int]], int]:
    """A chat decoding while a second client's long prompt arrives, with (or without) two next
    turns' prefills waiting from the start: each step's work for the clients' requests, and
    the prompt tokens the prefills got."""
    core = make_core(config=_config(), cost=COST)
    if with_next_turns:
        core.add("next-a", list(range(1, 90)), params(1), client="x", origin="next-turn")
    core.add("chat", list(range(100, 120)), params(12), client="x")
    if with_next_turns:
        core.add("next-b", list(range(200, 260)), params(1), client="y", origin="next-turn")
    seen, ours = [], 0
    for step in range(1, 40):
        if step == 3:
            core.add("long", list(range(300, 420)), params(2), client="y")
        work, _ = run_step(core)
        for c in work.plan.chunks:
            if c.request_id.startswith("next-"):
                ours += c.end - c.start
            else:
                seen.append((step, c.request_id, c.start, c.end))
        for rid in work.plan.decodes:
            if not rid.startswith("next-"):
                seen.append((step, rid, -1, -1))
        if not core.states:
            break
    return seen, ours


def test_a_client_request_is_scheduled_as_if_no_next_turn_prefill_waited():
    alongside, prefilled = _client_schedule(with_next_turns=True)
    alone, _ = _client_schedule(with_next_turns=False)
    assert alongside == alone
    assert prefilled == 89 + 60  # and both prefills ran, in what the clients left


def test_a_next_turn_prefill_starts_only_once_no_client_request_waits():
    core = make_core(config=_config(max_step_ms=None))
    core.add("next-a", list(range(1, 30)), params(1), origin="next-turn")
    core.add("chat", list(range(100, 110)), params(2))
    work, _ = run_step(core)
    assert [c.request_id for c in work.plan.chunks] == ["chat"]  # room left, yet it waits
    work, _ = run_step(core)
    assert [c.request_id for c in work.plan.chunks] == ["next-a"]  # no client waits now


def test_a_client_request_that_needs_the_seat_ends_the_running_next_turn_prefill():
    core = make_core(config=_config(max_step_tokens=8, max_num_seqs=1, max_step_ms=None))
    core.add("next-a", list(range(1, 40)), params(1), origin="next-turn")
    run_step(core)  # its first chunk
    assert core.preemptions() == ()
    core.add("chat", list(range(100, 110)), params(2))
    assert core.preemptions() == ("next-a",)
    update = core.abort("next-a", FinishReason.CANCELLED, PREEMPTED)
    assert update is not None and update.finish is FinishReason.CANCELLED
    work, _ = run_step(core)
    assert [c.request_id for c in work.plan.chunks] == ["chat"]
    ended = fold(core.take_events())["next-a"]
    assert ended.finish_reason is FinishReason.CANCELLED and ended.origin == "next-turn"


def test_a_client_request_whose_kv_does_not_fit_ends_the_next_turn_prefill_in_its_way():
    core = make_core(config=_config(max_step_tokens=16, max_kv_tokens=64, max_step_ms=None))
    core.add("next-a", list(range(1, 50)), params(1), origin="next-turn")
    run_step(core)
    core.add("chat", list(range(100, 130)), params(4))  # 34 more tokens: 84 > 64
    assert core.preemptions() == ("next-a",)
    core2 = make_core(config=_config(max_step_tokens=16, max_kv_tokens=64, max_step_ms=None))
    core2.add("next-a", list(range(1, 20)), params(1), origin="next-turn")
    run_step(core2)
    core2.add("small", list(range(200, 205)), params(1))
    assert core2.preemptions() == ()  # room for both: nothing is ended


def test_a_next_turn_prefill_is_in_no_clients_fair_share():
    core = make_core(config=_config(max_num_seqs=2, max_step_ms=None))
    core.add("next-a", list(range(1, 200)), params(1), client="x", origin="next-turn")
    run_step(core)
    core.add("x1", list(range(100, 104)), params(8), client="x")
    core.add("y1", list(range(200, 204)), params(8), client="y")
    # both clients' requests get the two seats (the prefill is ended for the second)
    assert core.preemptions() == ("next-a",)


def test_a_next_turn_prefill_its_clients_next_request_does_not_start_with_is_ended():
    core = make_core(config=_config(max_step_tokens=16, max_step_ms=None))
    history = list(range(1, 60))
    core.add("next-a", history, params(1), client="x", origin="next-turn")
    run_step(core)  # under way
    assert core.stale() == ()
    # the client rewrote the end of its history: the prediction serves nothing
    core.add("turn-2", [*history[:50], 900, 901, 902], params(2), client="x")
    assert core.stale() == ("next-a",)
    core.abort("next-a", FinishReason.CANCELLED, STALE)
    work, _ = run_step(core)
    assert [c.request_id for c in work.plan.chunks] == ["turn-2"]  # its seat and KV are free
    ended = fold(core.take_events())["next-a"]
    assert ended.finish_reason is FinishReason.CANCELLED


def test_a_next_turn_prefill_its_clients_next_request_starts_with_goes_on():
    index = PrefixIndex(max_bytes=1 << 20)
    core = make_core(config=_config(max_step_tokens=16, max_step_ms=None), index=index)
    history = list(range(1, 60))
    core.add("next-a", history, params(1), client="x", origin="next-turn")
    run_step(core)
    core.add("turn-2", [*history, 900, 901], params(2), client="x")
    assert core.stale() == ()
    work, _ = run_step(core)
    # the request waits for the prefill's snapshot rather than computing the prefix again
    assert [c.request_id for c in work.plan.chunks] == ["next-a"]


def test_a_next_turn_prefill_not_started_when_its_clients_next_request_arrives_is_ended():
    core = make_core(config=_config(max_num_seqs=1, max_step_ms=None))
    core.add("chat", list(range(100, 110)), params(30), client="x")
    run_step(core)  # decoding: it holds the only seat
    history = list(range(1, 60))
    core.add("next-a", history, params(1), client="x", origin="next-turn")
    assert core.stale() == ()
    core.add("turn-2", [*history, 900], params(2), client="x")
    assert core.stale() == ("next-a",)  # it would only ever compute what turn-2 computes


def test_another_conversation_or_client_leaves_a_next_turn_prefill_alone():
    core = make_core(config=_config(max_step_tokens=16, max_step_ms=None))
    history = list(range(1, 60))
    core.add("next-a", history, params(1), client="x", origin="next-turn")
    run_step(core)
    core.add("subagent", [*history[:20], 700, 701], params(2), client="x")  # its system prompt
    core.add("other", [*history[:50], 800], params(2), client="y")
    assert core.stale() == ()
