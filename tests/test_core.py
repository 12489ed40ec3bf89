"""The scheduler core without a model, as vLLM tests its scheduler (tests/core_driver.py)."""

from __future__ import annotations

import pytest
from core_driver import EOS, LIMITS, make_core, params, run_step, sampled

import stepline.actors.scheduler.bookkeeping as bookkeeping
from stepline.actors.scheduler.admission import (
    AdmissionError,
    KVBudgetExceededError,
    QueueFullError,
)
from stepline.actors.scheduler.core import EngineDeadError, ModelLimits
from stepline.actors.scheduler.plan import SchedulerConfig
from stepline.actors.scheduler.prefix_index import EntryInfo, PrefixIndex
from stepline.actors.scheduler.work import PrefixReport, StepResult, TokenLogprob
from stepline.events.fold import Status, fold
from stepline.events.models import Admitted, FinishReason, StepPlanned


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget_then_decodes() -> None:
    core = make_core(max_step_tokens=8)
    core.add("a", range(3, 23), params(max_tokens=2))
    progress = []
    for _ in range(3):
        work, out = run_step(core)
        assert work.plan.num_tokens <= 8
        progress.append(out.updates["a"].num_computed_tokens)
    assert progress == [8, 16, 20]
    assert out.updates["a"].token_ids == [7]  # the first token comes with the last chunk
    assert core.states["a"].status is Status.DECODING
    work, out = run_step(core)
    assert work.plan.decodes == ("a",)
    assert out.updates["a"].finish is FinishReason.LENGTH  # its second token: max_tokens
    assert core.state_of("a").num_output_tokens == 2
    assert not core.states and core.schedule() is None


SMALL = ModelLimits(max_context=16, eos_token_ids=frozenset({EOS}))


def test_a_request_asking_past_the_context_is_admitted_with_the_room_left_and_ends_there() -> None:
    core = make_core(limits=SMALL)
    core.add("a", range(3, 13), params(max_tokens=100))  # 10 prompt tokens: room for 6
    events = core.take_events()
    (admitted,) = [e for e in events if isinstance(e, Admitted)]
    assert admitted.params.max_tokens == 6  # the limit it runs to, for replay to see
    work, out = run_step(core)
    assert work.admit[0].params.max_tokens == 6  # the runner's limit is the recorded one
    while core.states:
        _, out = run_step(core)
    assert out.updates["a"].finish is FinishReason.LENGTH
    assert out.updates["a"].num_output_tokens == 6  # prompt and output fill the context
    events += core.take_events()
    assert fold(events)["a"] == core.state_of("a")


def test_a_request_asking_past_the_context_counts_against_the_kv_budget_only_up_to_it() -> None:
    config = SchedulerConfig(max_step_tokens=64, max_num_seqs=4, max_kv_tokens=20, max_step_ms=None)
    core = make_core(config=config, limits=SMALL)
    core.add("a", range(3, 13), params(max_tokens=1000))  # 10 + 6 fits in 20; 10 + 1000 not
    assert core.states["a"].params.max_tokens == 6
    tight = SchedulerConfig(max_step_tokens=64, max_num_seqs=4, max_kv_tokens=14, max_step_ms=None)
    with pytest.raises(KVBudgetExceededError, match=r"max_tokens \(6\)"):
        make_core(config=tight, limits=SMALL).add("b", range(3, 13), params(max_tokens=1000))


def test_each_update_carries_the_requests_output_count_as_the_core_keeps_it() -> None:
    core = make_core()
    core.add("a", (3, 4), params(max_tokens=5))
    core.add("b", (3, 4, 5), params(max_tokens=5))
    counts = [run_step(core)[1].updates["a"].num_output_tokens for _ in range(3)]
    assert counts == [1, 2, 3] and core.states["a"].num_output_tokens == 3
    cancelled = core.abort("a", FinishReason.CANCELLED)
    assert cancelled is not None and cancelled.num_output_tokens == 3
    assert core.fail("executor failed")["b"].num_output_tokens == 3


def test_a_steps_plan_names_each_members_tokens_and_kind() -> None:
    core = make_core(max_step_tokens=8)
    core.add("chat", (3, 4), params(max_tokens=10))
    run_step(core)  # its prompt, whole: it decodes from now on
    core.add("long", range(3, 23), params())
    core.take_events()
    work = core.schedule()
    assert work is not None
    (plan,) = [e for e in core.take_events() if isinstance(e, StepPlanned)]
    assert list(zip(plan.request_ids, plan.num_tokens, plan.kinds, strict=True)) == [
        ("chat", 1, "decode"),
        ("long", 7, "prefill"),
    ]


def test_a_chunk_split_at_a_checkpoint_records_both_pieces_and_the_snapshot() -> None:
    core = make_core(max_step_tokens=6)
    core.add("a", range(3, 13), params(), checkpoints=(4,))
    work = core.schedule()
    assert work is not None and [(c.start, c.end) for c in work.plan.chunks] == [(0, 6)]
    out = core.update_from_output(work, StepResult(checkpoints={"a": (4,)}))
    kinds = [
        (e.type, getattr(e, "start", None), getattr(e, "end", None)) for e in core.take_events()
    ]
    assert kinds[1:] == [
        ("step", None, None),
        ("step-finished", None, None),
        ("chunk-prefilled", 0, 4),
        ("checkpoint-reached", None, None),
        ("chunk-prefilled", 4, 6),
    ]
    assert out.updates["a"].num_computed_tokens == 6 and not out.updates["a"].token_ids
    assert core.states["a"].checkpoints_reached == (4,)


def test_a_chunk_that_ends_at_its_checkpoint_records_the_checkpoint_once() -> None:
    core = make_core(max_step_tokens=4)
    core.add("a", range(3, 13), params(), checkpoints=(4,))
    work = core.schedule()
    assert work is not None
    core.update_from_output(work, StepResult(checkpoints={"a": (4,)}))
    types = [e.type for e in core.take_events()]
    assert types.count("checkpoint-reached") == 1 and types.count("chunk-prefilled") == 1


def test_a_prompt_whose_prefix_is_on_disk_waits_for_the_load_then_starts_from_it() -> None:
    index = PrefixIndex(max_bytes=1 << 20)
    cached = tuple(range(3, 10))  # 7 tokens, written by an earlier engine
    index.add_disk(cached, trimmable=True)
    core = make_core(index=index)
    core.add("a", (*cached, 50, 51, 52), params())
    assert core.schedule() is None  # nothing runs while its entry is loaded
    chores = core.housekeeping()
    assert chores is not None and chores.promote == (cached,)
    core.apply_prefix_report(PrefixReport(new=(EntryInfo(cached, 100, True),)))
    work = core.schedule()
    assert work is not None and work.admit[0].num_cached_tokens == 7
    assert [(c.start, c.end) for c in work.plan.chunks] == [(7, 10)]
    out = core.update_from_output(work, sampled(work))
    state = core.states["a"]
    assert (state.num_cached_tokens, state.cache_source) == (7, "disk")
    assert out.updates["a"].num_cached_tokens == 7 and out.cache_lookups == [7]


def test_a_stop_token_and_the_length_limit_end_requests_in_the_same_step() -> None:
    core = make_core()
    for rid in ("eos", "long", "goes-on"):
        core.add(rid, (3, 4), params(max_tokens=1 if rid == "long" else 3))
    work = core.schedule()
    assert work is not None
    result = StepResult(tokens={"eos": EOS, "long": 9, "goes-on": 7})
    out = core.update_from_output(work, result)
    finishes = {rid: u.finish for rid, u in out.updates.items()}
    assert finishes == {"eos": "stop", "long": "length", "goes-on": None}
    assert out.updates["eos"].stop_token  # the stop token is counted, not printed
    assert set(core.states) == {"goes-on"}
    # Their arrays are freed, and the cleanly ended ones offered to the prefix cache.
    chores = core.housekeeping()
    assert chores is not None and set(chores.free) == set(chores.retire) == {"eos", "long"}


def test_a_request_aborted_while_its_step_ran_gets_nothing_from_that_step() -> None:
    core = make_core()
    core.add("a", (3, 4, 5), params())
    work = core.schedule()
    assert work is not None
    update = core.abort("a", FinishReason.CANCELLED, "cancelled by the client")
    assert update is not None and update.finish is FinishReason.CANCELLED
    out = core.update_from_output(work, sampled(work))
    assert out.updates == {} and not out.gaps and not out.firsts
    assert core.state_of("a").finish_reason is FinishReason.CANCELLED
    assert core.abort("a", FinishReason.CANCELLED) is None  # ends once
    chores = core.housekeeping()
    assert chores is not None and chores.free == ("a",) and not chores.retire


def test_a_request_the_executor_dropped_ends_with_its_error_and_the_others_go_on() -> None:
    core = make_core()
    core.add("bad", (3, 4), params())
    core.add("good", (5, 6), params())
    work = core.schedule()
    assert work is not None
    result = StepResult(tokens={"good": 7}, failed={"bad": "sampling failed"})
    out = core.update_from_output(work, result)
    assert out.updates["bad"].finish is FinishReason.ERROR
    assert out.updates["bad"].message == "sampling failed"
    assert out.updates["good"].token_ids == [7]
    assert core.state_of("bad").finish_reason is FinishReason.ERROR


def test_each_request_gets_one_update_a_step_with_its_logprobs() -> None:
    core = make_core()
    core.add("a", (3, 4), params(max_tokens=5, logprobs=1))
    work = core.schedule()
    assert work is not None and work.admit[0].params.logprobs == 1
    lp = TokenLogprob(7, -0.5)
    out = core.update_from_output(work, sampled(work, logprobs={"a": lp}))
    assert list(out.updates) == ["a"] and out.updates["a"].logprobs == [lp]
    assert len(out.firsts) == 1 and not out.gaps  # its first token's latency is a TTFT
    _, out = run_step(core)
    assert len(out.gaps) == 1 and not out.firsts


def test_the_live_state_is_the_fold_of_the_events_at_every_step() -> None:
    core = make_core(max_step_tokens=5)
    events = []
    for i, n in enumerate((3, 9, 14)):
        core.add(f"r{i}", range(3, 3 + n), params(max_tokens=4), checkpoints=(2,))
    while core.states:
        run_step(core, checkpoints={})
        events += core.take_events()
        live = {rid: s for rid, s in fold(events).items() if not s.is_finished}
        assert live == core.states
    assert fold(events) == {rid: core.state_of(rid) for rid in ("r0", "r1", "r2")}


def test_a_request_that_cannot_be_served_is_logged_as_rejected_and_raises() -> None:
    core = make_core()
    with pytest.raises(AdmissionError, match="context"):
        core.add("huge", range(LIMITS.max_context), params())
    assert [e.type for e in core.take_events()] == ["admitted", "terminal"]
    assert core.state_of("huge").finish_reason is FinishReason.REJECTED
    assert core.housekeeping() is None  # never reached the executor: nothing to free
    with pytest.raises(AdmissionError, match="already used"):
        core.add("huge", (3,), params())


def test_the_waiting_queue_is_bounded() -> None:
    config = SchedulerConfig(max_step_tokens=8, max_num_seqs=1, max_waiting=2, max_step_ms=None)
    core = make_core(config=config)
    core.add("a", (3,), params())
    core.add("b", (3,), params())
    with pytest.raises(QueueFullError):
        core.add("c", (3,), params())


def test_a_dead_engine_ends_every_request_and_admits_none() -> None:
    core = make_core()
    core.add("a", (3, 4), params())
    core.schedule()
    updates = core.fail("executor failed")
    assert updates["a"].finish is FinishReason.ERROR and not core.states
    with pytest.raises(EngineDeadError, match="executor failed"):
        core.add("b", (3,), params())


def test_ended_requests_kept_for_inspection_hold_a_bounded_number_of_prompt_ids() -> None:
    core = make_core()
    prompt = tuple(range(3, 90))
    for i in range(bookkeeping._KEEP_FINISHED_TOKENS // len(prompt) + 10):
        core.add(f"r{i}", prompt, params(max_tokens=1))
        core.abort(f"r{i}", FinishReason.CANCELLED)
    held = sum(len(s.prompt_token_ids or ()) for s in core.finished.values())
    assert held <= bookkeeping._KEEP_FINISHED_TOKENS
    assert next(reversed(core.finished)) == f"r{i}"  # the most recent are kept
