"""Commit without MLX: a hand-made plan and result become events and actor messages."""

from __future__ import annotations

from stepline.actors.commit import ModelLimits, Recorder, commit
from stepline.actors.messages import CacheHit, NewTokens, Progress
from stepline.engine.policy import ScheduledChunk, StepPlan
from stepline.engine.work import StepResult
from stepline.events.fold import Status, fold
from stepline.events.models import Admitted, ChunkPrefilled, Decoding, RequestParams

LIMITS = ModelLimits(max_context=100, eos_token_ids=frozenset({2}))
PARAMS = RequestParams(max_tokens=3, temperature=0, top_p=1, top_k=0, min_p=0, seed=None)


class ListLog:
    def __init__(self) -> None:
        self.events: list = []

    def append(self, event) -> None:
        self.events.append(event)


def admitted(recorder: Recorder, rid: str, n: int, checkpoints=()) -> None:
    recorder.record(
        Admitted,
        request_id=rid,
        num_prompt_tokens=n,
        prompt_token_ids=None,
        prompt_sha256="x",
        checkpoints=checkpoints,
        params=PARAMS,
    )


def step(recorder: Recorder, plan: StepPlan, result: StepResult, sources=None):
    recorder.step += 1
    recorder.in_step = True
    try:
        return commit(recorder, plan, result, LIMITS, sources or {})
    finally:
        recorder.in_step = False


def test_a_chunk_split_at_a_checkpoint_records_both_pieces_and_tells_progress() -> None:
    log = ListLog()
    rec = Recorder(log)
    admitted(rec, "a", 10, checkpoints=(4,))
    plan = StepPlan(step=1, chunks=(ScheduledChunk("a", 0, 6, (4,), False),))
    out = step(rec, plan, StepResult(checkpoints={"a": (4,)}))
    kinds = [(e.type, getattr(e, "start", None), getattr(e, "end", None)) for e in log.events]
    assert kinds[1:] == [
        ("chunk-prefilled", 0, 4),
        ("checkpoint-reached", None, None),
        ("chunk-prefilled", 4, 6),
    ]
    assert out == [("a", Progress(6, 10))]
    assert rec.states["a"].status is Status.PREFILLING
    assert fold(log.events) == {"a": rec.states["a"]}  # the live state is the log's fold


def test_a_chunk_that_ends_at_its_checkpoint_records_the_checkpoint_once() -> None:
    log = ListLog()
    rec = Recorder(log)
    admitted(rec, "a", 10, checkpoints=(4,))
    plan = StepPlan(step=1, chunks=(ScheduledChunk("a", 0, 4, (4,), False),))
    step(rec, plan, StepResult(checkpoints={"a": (4,)}))
    assert [e.type for e in log.events[1:]] == ["chunk-prefilled", "checkpoint-reached"]
    assert fold(log.events)["a"].checkpoints_reached == (4,)


def test_a_first_chunk_from_the_cache_records_the_hit_and_tells_the_actor() -> None:
    rec = Recorder()
    admitted(rec, "a", 10)
    plan = StepPlan(step=1, chunks=(ScheduledChunk("a", 7, 10, (), True),))
    out = step(rec, plan, StepResult(tokens={"a": 5}), {"a": "disk"})
    state = rec.states["a"]
    assert (state.num_cached_tokens, state.cache_source, state.num_computed_tokens) == (
        7,
        "disk",
        10,
    )
    assert out[0] == ("a", CacheHit(7))
    assert isinstance(out[1][1], NewTokens) and out[1][1].token_ids == (5,)


def test_a_stop_token_and_the_length_limit_end_requests_in_the_same_step() -> None:
    rec = Recorder()
    for rid in ("eos", "long", "goes-on"):
        admitted(rec, rid, 2)
    rec.record(ChunkPrefilled, request_id="long", start=0, end=2)
    plan = StepPlan(
        step=1,
        decodes=("long",),
        chunks=(ScheduledChunk("eos", 0, 2, (), True), ScheduledChunk("goes-on", 0, 2, (), True)),
    )
    for _ in range(2):  # "long" reaches max_tokens=3 on its third token
        rec.record(Decoding, request_id="long", token_ids=(9,))
    out = step(rec, plan, StepResult(tokens={"eos": 2, "long": 9, "goes-on": 7}))
    finishes = {rid: msg.finish for rid, msg in out}
    assert finishes == {"eos": "stop", "long": "length", "goes-on": None}
    assert out[0][1].stop_token  # the stop token is counted, not printed
    assert set(rec.states) == {"goes-on"}
    assert rec.finished["eos"].finish_reason == "stop"


def test_a_request_cancelled_while_its_step_ran_gets_nothing() -> None:
    rec = Recorder()
    admitted(rec, "a", 3)
    plan = StepPlan(step=1, chunks=(ScheduledChunk("a", 0, 3, (), True),))
    rec.states.pop("a")  # as if its terminal event was recorded meanwhile
    assert step(rec, plan, StepResult(tokens={"a": 1})) == []


def test_ended_requests_kept_for_inspection_hold_a_bounded_number_of_prompt_ids() -> None:
    from stepline.actors import commit as commit_module
    from stepline.events.models import FinishReason, Terminal

    rec = Recorder()
    prompt = tuple(range(100_000))  # a long prompt: its state holds every id
    for i in range(10):
        rec.record(
            Admitted,
            request_id=f"r{i}",
            num_prompt_tokens=len(prompt),
            prompt_token_ids=prompt,
            prompt_sha256="x",
            checkpoints=(),
            params=PARAMS,
        )
        rec.record(Terminal, request_id=f"r{i}", reason=FinishReason.CANCELLED)
    kept = list(rec.finished)
    assert kept == [f"r{i}" for i in range(10 - len(kept), 10)]  # the most recent ones
    held = sum(len(s.prompt_token_ids or ()) for s in rec.finished.values())
    assert held <= commit_module._KEEP_FINISHED_TOKENS and len(kept) >= 1
