"""`stepline replay` on logs of several runs (restarts), with measured step times, and with
output ids left out. Logs are written by hand (tests/log_builder.py) through the real writer
(no model)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers import replay
from log_builder import LogBuilder

from stepline.events.log import TornLineWarning, read_runs
from stepline.events.models import FinishReason, new_run_id, new_salt
from stepline.events.replay import (
    RunNeededError,
    UnknownRequestError,
    request_timeline,
    state_at_step,
    step_records,
    summarize,
    verify,
)
from stepline.events.replay.svg import SVG_NS, render_svg


def run(t0: float, *, timed: bool = True) -> LogBuilder:
    """One engine run (its own run id and salt), with the executor's step times if `timed`."""
    return LogBuilder(t0, timed=timed, run_id=new_run_id(), salt=new_salt())


def write_runs(path: Path, *runs: LogBuilder, torn: bool = False) -> Path:
    for i, one in enumerate(runs):
        one.write(path, append=True)
        if torn and i < len(runs) - 1:
            with open(path, "ab") as f:
                f.write(b'{"seq":99,"ts":1')  # a kill mid-write
    return path


def crashed_then_restarted(tmp_path: Path, *, torn: bool = False) -> Path:
    """Run 1: r1 finishes, r2 is mid-decode when the engine is killed. Run 2 (restart with
    the same log): a new r1 and r3 finish; r4 is still waiting when the log ends."""
    one = run(1000.0)
    one.admit("r1", 4)
    one.admit("r2", 4)
    one.do_step(prefill={"r1": (0, 4), "r2": (0, 4)})
    one.end("r1", FinishReason.STOP)
    one.do_step(["r2"])
    two = run(2000.0)
    two.admit("r1", 3)
    two.admit("r3", 2)
    two.do_step(prefill={"r1": (0, 3), "r3": (0, 2)})
    two.end("r1", FinishReason.STOP)
    two.end("r3", FinishReason.LENGTH)
    two.admit("r4", 5)
    return write_runs(tmp_path / "run.jsonl", one, two, torn=torn)


# -- several runs -------------------------------------------------------------------------------


def test_verify_passes_across_a_crash_and_calls_the_cut_off_request_interrupted(
    tmp_path: Path, capsys
) -> None:
    path = crashed_then_restarted(tmp_path, torn=True)  # killed mid-write, too

    with pytest.warns(TornLineWarning):
        report = verify(path)
    assert report.ok, report.violations  # seq numbers restart, r1 comes again: not violations
    assert [(r.run, r.request_id, r.status.value) for r in report.interrupted] == [
        (1, "r2", "decoding")
    ]
    assert [(r.run, r.request_id) for r in report.in_flight] == [(2, "r4")]
    code, text = replay(str(path), "--verify")
    assert code == 0
    assert "2 runs (each verified on its own)" in text
    assert "interrupted (1;" in text and "run 1 r2: decoding, 2 tokens" in text
    assert "torn last line" in capsys.readouterr().err


def test_a_violation_in_a_later_run_is_reported_with_its_run(tmp_path: Path) -> None:
    one, two = run(1.0), run(2.0)
    one.admit("a", 2)
    two.admit("a", 2)
    two.do_step(prefill={"a": (0, 2)})
    two.end("a", FinishReason.STOP)
    two.end("a", FinishReason.CANCELLED)
    path = write_runs(tmp_path / "run.jsonl", one, two)

    report = verify(path)
    assert report.counts == {"two-terminals": 1}
    assert report.violations[0].run == 2
    assert replay(str(path), "--verify")[1].count("run 2: two-terminals") == 1


def test_the_summary_shows_each_run_and_the_interrupted_requests(tmp_path: Path) -> None:
    path = crashed_then_restarted(tmp_path)

    s = summarize(path)
    assert [(r.index, r.num_requests, r.outcomes) for r in s.runs] == [
        (1, 2, {"stop": 1, "interrupted": 1}),
        (2, 3, {"stop": 1, "length": 1, "in-flight": 1}),
    ]
    assert s.outcomes == {"stop": 2, "interrupted": 1, "length": 1, "in-flight": 1}
    assert s.runs[0].run_id == read_runs(path)[0].header.run_id
    assert summarize(path, run=2).num_requests == 3
    _, text = replay(str(path))
    assert "2 runs (the engine was restarted; each run on its own):" in text
    assert "interrupted (1;" in text and "in flight when the log ends (1;" in text


def test_a_request_id_in_two_runs_needs_the_run_to_be_named(tmp_path: Path, capsys) -> None:
    path = crashed_then_restarted(tmp_path)

    with pytest.raises(UnknownRequestError, match="in 2 runs"):
        request_timeline(path, "r1")
    assert request_timeline(path, "r1", run=2).num_prompt_tokens == 3
    assert request_timeline(path, "r1", run=read_runs(path)[0].header.run_id).run == 1
    r2 = request_timeline(path, "r2")  # only in run 1: found without --run
    assert r2.interrupted and r2.terminal is None
    assert replay(str(path), "--request", "r1")[0] == 2
    assert "pick one with --run" in capsys.readouterr().err
    code, text = replay(str(path), "--request", "r2")
    assert code == 0 and "interrupted (run 1 ended without ending it" in text


def test_state_at_a_step_is_shown_for_each_run_or_the_one_asked_for(tmp_path: Path) -> None:
    path = crashed_then_restarted(tmp_path)

    with pytest.raises(RunNeededError):
        state_at_step(path, 1)
    assert state_at_step(path, 1, run=2).counts == {"finished": 2, "waiting": 1}
    code, text = replay(str(path), "--at-step", "1")
    assert code == 0
    assert "== run 1 ==" in text and "== run 2 ==" in text
    code, text = replay(str(path), "--at-step", "1", "--run", "2", "--json")
    assert json.loads(text)["run"] == 2
    assert replay(str(path), "--at-step", "1", "--json")[1].startswith('{\n  "runs": [')


def test_asking_for_a_step_past_the_end_says_so(tmp_path: Path) -> None:
    path = crashed_then_restarted(tmp_path)

    s = state_at_step(path, 50, run=1)
    assert (s.past_end, s.last_step) == (True, 2)
    _, text = replay(str(path), "--at-step", "50", "--run", "1")
    assert "step 50 is past the end of the log (its last step is 2)" in text
    assert not state_at_step(path, 2, run=1).past_end
    _, text = replay(str(path), "--steps", "40..50", "--run", "1")
    assert "no steps in that range (the log's last step is 2)" in text


def test_an_unknown_run_is_an_error(tmp_path: Path, capsys) -> None:
    path = crashed_then_restarted(tmp_path)
    assert replay(str(path), "--run", "3")[0] == 2
    assert "no run '3'" in capsys.readouterr().err


# -- time ---------------------------------------------------------------------------------------


def idle_run(*, timed: bool) -> LogBuilder:
    """Three steps of 20 ms; a 5 s idle gap after the second."""
    one = run(10.0, timed=timed)
    one.admit("a", 2)
    one.do_step(prefill={"a": (0, 2)}, seconds=0.02, predicted=0.01)
    one.do_step(["a"], seconds=0.02, predicted=0.01, idle=5.0)
    one.do_step(["a"], seconds=0.02, predicted=0.01)
    one.end("a", FinishReason.LENGTH)
    return one


def test_step_times_are_the_executors_and_idle_gaps_are_idle(tmp_path: Path) -> None:
    path = write_runs(tmp_path / "run.jsonl", idle_run(timed=True))

    steps = step_records(path).steps
    assert [s.duration_s for s in steps] == pytest.approx([0.02, 0.02, 0.02])
    assert not any(s.duration_estimated for s in steps)
    assert steps[1].idle_after_s == pytest.approx(5.0)
    assert steps[0].predicted_s == pytest.approx(0.01)
    s = summarize(path)
    assert s.slowest_steps[0].seconds == pytest.approx(0.02)  # not the 5 s gap
    assert s.longest_idle[0].after_step == 2 and s.longest_idle[0].seconds == pytest.approx(5.0)
    assert s.busy_s == pytest.approx(0.06) and s.idle_s == pytest.approx(5.0)
    _, text = replay(str(path), "--steps", "1..3")
    assert "took 20.0 ms, predicted 10.0 ms" in text and "idle 5.000 s" in text
    _, text = replay(str(path))
    assert "slowest steps (executor time):" in text and "after step 2: 5.000 s" in text


def test_a_log_without_step_times_says_its_durations_are_estimated(tmp_path: Path) -> None:
    path = write_runs(tmp_path / "run.jsonl", idle_run(timed=False))

    steps = step_records(path).steps
    assert steps[1].duration_estimated and steps[1].duration_s == pytest.approx(5.02)
    s = summarize(path)
    assert s.slowest_steps[0].estimated and s.busy_s is None
    _, text = replay(str(path))
    assert "slowest steps (estimated:" in text
    assert "step times not recorded in this log" in text
    _, text = replay(str(path), "--steps", "1..3")
    assert "(estimated)" in text


def _rect_x(svg: str, title_part: str) -> tuple[float, float]:
    root = ET.fromstring(svg)
    for rect in root.iter(f"{{{SVG_NS}}}rect"):
        title = rect.find(f"{{{SVG_NS}}}title")
        if title is not None and title_part in (title.text or ""):
            return float(rect.get("x", 0)), float(rect.get("width", 0))
    raise AssertionError(f"no rect titled {title_part!r}")


def test_the_picture_can_lay_steps_out_by_time_with_idle_gaps_blank(tmp_path: Path) -> None:
    path = write_runs(tmp_path / "run.jsonl", idle_run(timed=True))

    by_step = render_svg(path)
    x1, w1 = _rect_x(by_step, "prefill [0, 2)")
    x2, w2 = _rect_x(by_step, "decoding steps 2..3")
    assert (x2, w2) == pytest.approx((x1 + w1, 2 * w1))  # one equal cell per step

    by_time = render_svg(path, time_axis=True)
    x1, w1 = _rect_x(by_time, "prefill [0, 2)")
    x2, w2 = _rect_x(by_time, "decoding steps 2..2")
    x3, w3 = _rect_x(by_time, "decoding steps 3..3")
    assert w3 == pytest.approx(w1, abs=0.02)
    assert x2 == pytest.approx(x1 + w1, abs=0.02) and w2 == pytest.approx(w1, abs=0.02)
    assert x3 - (x2 + w2) > 100 * w1  # the 5 s idle gap is blank space, 250 steps' worth
    assert "seconds" in by_time
    code, _ = replay(str(path), "--svg", str(tmp_path / "t.svg"), "--time-axis")
    assert code == 0 and "seconds" in (tmp_path / "t.svg").read_text(encoding="utf-8")


# -- outputs left out ---------------------------------------------------------------------------


def test_without_logged_outputs_replay_says_what_it_cannot_show(tmp_path: Path) -> None:
    one = idle_run(timed=True)
    one.header = one.header.model_copy(update={"log_outputs": False})
    path = write_runs(tmp_path / "run.jsonl", one)

    t = request_timeline(path, "a")
    assert t.num_output_tokens == 3 and not t.outputs_logged
    assert all(tok.token_ids is None for tok in t.tokens)
    code, text = replay(str(path), "--request", "a")
    assert code == 0
    assert "output token ids were not logged (log_outputs=False)" in text
    assert "first token 1 token (ids not logged)" in text
    assert "outputs logged: False" in replay(str(path))[1]
    assert verify(path).ok

    code, text = replay(str(path), "--reexecute")
    assert code == 2
    assert "log_outputs=False" in text and "--log-outputs=true" in text


def test_reexecution_of_a_log_of_several_runs_needs_a_run(tmp_path: Path) -> None:
    code, text = replay(str(crashed_then_restarted(tmp_path)), "--reexecute")
    assert code == 2 and "holds 2 runs" in text and "--run" in text
