"""Requests refused at a door (400, 404, 413, 429): each is one lone `terminal` in the event
log (reason rejected, the error's code and HTTP status, nothing of its prompt), folded,
verified and counted by replay as a rejected request; one the engine refuses after looking
at its prompt stays `admitted` then `terminal`.

The HTTP tests drive a real uvicorn on 127.0.0.1 with the official `openai` client."""

from __future__ import annotations

from pathlib import Path

import pytest
from core_driver import make_core, params
from helpers import replay
from log_builder import LogBuilder

from stepline.engine.policy import QueueFullError, SchedulerConfig
from stepline.events.fold import FoldError, Status, fold
from stepline.events.models import FinishReason
from stepline.events.replay import (
    UnknownRequestError,
    request_timeline,
    state_at_step,
    summarize,
    verify,
)
from stepline.events.replay.reexecute import load_recorded_run
from stepline.events.replay.svg import render_svg

# -- the fold and the scheduler core (no model) ------------------------------------------------


def test_a_lone_rejected_terminal_folds_to_a_request_that_ended_where_it_arrived() -> None:
    b = LogBuilder()
    b.refuse("door-1", "invalid_value", 400)

    state = fold(b.events)["door-1"]
    assert state.status is Status.FINISHED and state.finish_reason is FinishReason.REJECTED
    assert not state.admitted
    assert (state.num_prompt_tokens, state.num_computed_tokens, state.num_output_tokens) == (
        0,
        0,
        0,
    )
    assert state.prompt_token_ids is None and state.params.max_tokens == 0


def test_a_lone_terminal_that_is_no_refusal_is_still_an_unknown_request() -> None:
    b = LogBuilder()
    b.end("ghost", FinishReason.STOP)

    with pytest.raises(FoldError) as err:
        fold(b.events)
    assert err.value.kind == "unknown-request"


def test_the_core_records_a_refusal_once_and_its_state_is_the_folds() -> None:
    core = make_core()
    refused = core.refuse("chatcmpl-1", "temperature: too high", code="invalid_value", status=400)

    assert refused is not None and (refused.code, refused.status) == ("invalid_value", 400)
    events = core.take_events()
    assert events == [refused]  # no admission before it
    assert fold(events)["chatcmpl-1"] == core.state_of("chatcmpl-1")
    assert not core.states and core.housekeeping() is None  # nothing for the executor
    # An id the core has seen is not refused again, nor admitted later.
    assert core.refuse("chatcmpl-1", "again", code="invalid_value", status=400) is None
    core.add("r1", (3, 4), params())
    assert core.refuse("r1", "late", code="invalid_value", status=400) is None
    assert [e.type for e in core.take_events()] == ["admitted"]


def test_a_full_queue_refuses_with_a_lone_terminal_naming_429_and_nothing_of_the_prompt() -> None:
    config = SchedulerConfig(max_step_tokens=8, max_num_seqs=1, max_waiting=1, max_step_ms=None)
    core = make_core(config=config)
    core.add("waits", (3,), params())
    with pytest.raises(QueueFullError):
        core.add("one-too-many", (3, 4, 5), params())

    events = [e for e in core.take_events() if e.request_id == "one-too-many"]
    assert [(e.type, e.code, e.status) for e in events] == [("terminal", "queue_full", 429)]
    assert core.state_of("one-too-many").finish_reason is FinishReason.REJECTED


# -- replay of a log that holds refusals (hand-made) -------------------------------------------


def served_and_refused() -> LogBuilder:
    """r1 served (stop) between two refusals: a 400 and a 413."""
    b = LogBuilder(step_every=0.1)
    b.refuse("bad-params", "invalid_value", 400)
    b.admit("r1", 2)
    b.do_step(prefill={"r1": (0, 2)})
    b.end("r1", FinishReason.STOP)
    b.refuse("too-big", "request_too_large", 413)
    return b


def test_replay_counts_refusals_as_rejected_and_verifies_the_log(tmp_path: Path) -> None:
    path = served_and_refused().write(tmp_path / "run.jsonl")

    assert summarize(path).outcomes == {"rejected": 2, "stop": 1}
    code, text = replay(str(path))
    assert code == 0 and "requests: 3 (2 rejected, 1 stop)" in text
    report = verify(path)
    assert report.ok and report.num_requests == 3
    at_end = state_at_step(path, 9)
    assert at_end.counts == {"finished": 3}
    assert "finished: rejected, 0 tokens" in [r.description for r in at_end.requests]


def test_asking_for_a_refused_request_says_it_was_refused_and_why(tmp_path: Path, capsys) -> None:
    path = served_and_refused().write(tmp_path / "run.jsonl")

    with pytest.raises(UnknownRequestError, match="refused before it was admitted"):
        request_timeline(path, "too-big")
    assert replay(str(path), "--request", "too-big")[0] == 2
    assert "(413 request_too_large: refused: request_too_large)" in capsys.readouterr().err


def test_pictures_traces_and_reexecution_leave_refusals_out(tmp_path: Path) -> None:
    path = served_and_refused().write(tmp_path / "run.jsonl")
    trace = tmp_path / "trace.json"

    assert render_svg(path).count('class="request"') == 1
    assert replay(str(path), "--trace", str(trace))[0] == 0
    assert "too-big" not in trace.read_text() and "r1" in trace.read_text()
    assert [r.admitted.request_id for r in load_recorded_run(path).requests] == ["r1"]
