"""`stepline replay`: timelines, state at a step, steps, summary, verify, pictures, --json.

Every log here is fabricated by hand (no model): `LogBuilder` (tests/log_builder.py) records
what a small engine would, step by step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers import replay
from log_builder import PARAMS, T0, LogBuilder

from stepline.api.cli.replay import parse_step_range
from stepline.events.log import (
    EventLogWriter,
    TornLineWarning,
    log_files,
    read_events,
    read_header,
)
from stepline.events.models import (
    ChunkPrefilled,
    FinishReason,
    LogHeader,
    StepPlanned,
    TokensSampled,
)
from stepline.events.replay import (
    Distribution,
    UnknownRequestError,
    ViolationKind,
    request_timeline,
    state_at_step,
    step_records,
    summarize,
    verify,
)
from stepline.events.replay.svg import SVG_NS, render_html, render_svg

STEP = 0.1  # a step starts every 100 ms; its results come 50 ms in


def two_requests() -> LogBuilder:
    """r1 (10-token prompt, checkpoint at 4) and r2 (3 tokens) share steps 2 and 3."""
    b = LogBuilder(step_every=STEP)
    b.admit("r1", 10, checkpoints=(4,))
    b.admit("r2", 3)
    b.plan(("r1", "prefill", 8))
    b.chunk("r1", 0, 4)
    b.checkpoint("r1", 4)
    b.chunk("r1", 4, 8)
    b.plan(("r1", "prefill", 2), ("r2", "prefill", 3))
    b.chunk("r1", 8, 10)
    b.chunk("r2", 0, 3)
    b.token("r1", 5)
    b.token("r2", 7)
    b.plan(("r1", "decode", 1), ("r2", "decode", 1))
    b.token("r1", 6)
    b.token("r2", 8)
    b.end("r2", FinishReason.STOP)
    b.plan(("r1", "decode", 1))
    b.token("r1", 9)
    b.end("r1", FinishReason.LENGTH)
    return b


def write(tmp_path: Path, events: list) -> Path:
    """`events` as tmp_path/run.jsonl, under the header `LogBuilder` writes."""
    return LogBuilder().write(tmp_path / "run.jsonl", events)


def renumber(events: list) -> list:
    return [e.model_copy(update={"seq": i}) for i, e in enumerate(events, start=1)]


# -- timeline of one request ----------------------------------------------------------------


def test_a_request_timeline_shows_chunks_checkpoints_tokens_and_its_end(tmp_path: Path) -> None:
    t = request_timeline(write(tmp_path, two_requests().events), "r1")

    assert [(c.step, c.start, c.end) for c in t.chunks] == [(1, 0, 4), (1, 4, 8), (2, 8, 10)]
    assert [(c.step, c.offset) for c in t.checkpoints_reached] == [(1, 4)]
    assert [(x.step, x.token_ids) for x in t.tokens] == [(2, (5,)), (3, (6,)), (4, (9,))]
    assert t.terminal is not None and t.terminal.reason is FinishReason.LENGTH
    assert t.num_output_tokens == 3


def test_a_request_timeline_derives_latencies_from_timestamps(tmp_path: Path) -> None:
    t = request_timeline(write(tmp_path, two_requests().events), "r1")

    assert t.queueing_s == pytest.approx(0.1)  # admitted at 0, first scheduled in step 1
    assert t.ttft_s == pytest.approx(0.25)  # first token with the last chunk, in step 2
    assert t.itl_s == pytest.approx((0.1, 0.1))
    assert t.e2e_s == pytest.approx(0.45)


def test_a_request_timeline_tells_what_else_shared_each_step(tmp_path: Path) -> None:
    t = request_timeline(write(tmp_path, two_requests().events), "r1")

    assert [(s.step, s.kind, s.num_tokens, s.others) for s in t.steps] == [
        (1, "prefill", 8, ()),
        (2, "prefill", 2, ("r2",)),
        (3, "decode", 1, ("r2",)),
        (4, "decode", 1, ()),
    ]
    code, text = replay(str(tmp_path / "run.jsonl"), "--request", "r1")
    assert code == 0
    assert "checkpoint at 4" in text and "with r2]" in text


def test_asking_for_an_unknown_request_is_an_error(tmp_path: Path, capsys) -> None:
    path = write(tmp_path, two_requests().events)
    with pytest.raises(UnknownRequestError):
        request_timeline(path, "nope")

    assert replay(str(path), "--request", "nope")[0] == 2
    assert "no request 'nope'" in capsys.readouterr().err


# -- state at a step --------------------------------------------------------------------------


def test_state_at_a_step_describes_every_request(tmp_path: Path) -> None:
    b = two_requests()
    b.admit("r3", 5)  # arrives after step 4 and never runs: the log ends
    path = write(tmp_path, b.events)

    def described(step: int) -> dict[str, str]:
        return {r.request_id: r.description for r in state_at_step(path, step).requests}

    assert described(0) == {"r1": "waiting (10 prompt tokens)", "r2": "waiting (3 prompt tokens)"}
    assert described(1) == {"r1": "prefilling 8 of 10", "r2": "waiting (3 prompt tokens)"}
    assert described(2) == {"r1": "decoding, 1 token", "r2": "decoding, 1 token"}
    assert described(3)["r2"] == "finished: stop, 2 tokens"
    assert described(4)["r1"] == "finished: length, 3 tokens"
    assert state_at_step(path, 4).counts == {"finished": 2, "waiting": 1}


def test_state_at_a_step_counts_prefix_cache_hits_as_computed(tmp_path: Path) -> None:
    b = LogBuilder(step_every=STEP)
    b.admit("r1", 10, cached=6)
    b.plan(("r1", "prefill", 4))
    b.chunk("r1", 6, 10)
    path = write(tmp_path, b.events)

    assert state_at_step(path, 0).requests[0].num_computed_tokens == 6
    assert verify(path).ok


# -- steps A..B ------------------------------------------------------------------------------


def test_steps_list_members_tokens_and_budget_used(tmp_path: Path) -> None:
    report = step_records(write(tmp_path, two_requests().events), 2, 3)

    assert [s.step for s in report.steps] == [2, 3]
    two = report.steps[0]
    assert [(m.request_id, m.kind, m.num_tokens, m.prompt_range) for m in two.members] == [
        ("r1", "prefill", 2, (8, 10)),
        ("r2", "prefill", 3, (0, 3)),
    ]
    assert (two.num_tokens, two.max_step_tokens, two.utilisation) == (5, 8, 5 / 8)
    assert two.duration_s == pytest.approx(0.1)
    assert report.steps[1].finished == ("r2",)


def test_a_step_range_is_written_a_dot_dot_b() -> None:
    assert parse_step_range("3..7") == (3, 7)
    assert parse_step_range("3..") == (3, None)
    assert parse_step_range("..7") == (None, 7)
    assert parse_step_range("5") == (5, 5)
    with pytest.raises(argparse.ArgumentTypeError, match="ends before it starts"):
        parse_step_range("7..3")
    with pytest.raises(argparse.ArgumentTypeError, match="not a step range"):
        parse_step_range("a-b")


# -- summary ---------------------------------------------------------------------------------


def test_the_summary_counts_outcomes_latencies_and_budget(tmp_path: Path) -> None:
    s = summarize(write(tmp_path, two_requests().events))

    assert s.num_requests == 2
    assert s.outcomes == {"stop": 1, "length": 1}
    assert s.num_steps == 4
    assert s.num_output_tokens == 5
    assert s.ttft_s.count == 2 and s.ttft_s.p50 == pytest.approx(0.25)
    assert s.itl_s.count == 3 and s.itl_s.max == pytest.approx(0.1)
    assert s.queueing_s.max == pytest.approx(0.2)  # r2 waited for step 2
    assert s.budget_utilisation.mean == pytest.approx((8 + 5 + 2 + 1) / 4 / 8)
    assert s.in_flight == ()


def test_the_summary_finds_the_longest_stall(tmp_path: Path) -> None:
    b = LogBuilder(step_every=STEP)
    b.admit("slow", 2)
    b.plan(("slow", "prefill", 2))
    b.chunk("slow", 0, 2)
    b.token("slow", 1)
    for _ in range(5):  # steps with nothing for it: its tokens stall
        b.plan()
    b.plan(("slow", "decode", 1))
    b.token("slow", 2)
    path = write(tmp_path, b.events)

    stall = summarize(path).longest_stalls[0]
    assert (stall.request_id, stall.from_step, stall.to_step) == ("slow", 1, 7)
    assert stall.seconds == pytest.approx(0.6)


def test_the_summary_lists_requests_in_flight_when_the_log_ends(tmp_path: Path) -> None:
    b = two_requests()
    b.admit("r3", 20)
    b.plan(("r3", "prefill", 8))
    b.chunk("r3", 0, 8)
    path = write(tmp_path, b.events)  # the run crashed here

    s = summarize(path)
    assert s.outcomes["in-flight"] == 1
    assert [(r.request_id, r.status.value, r.num_computed_tokens) for r in s.in_flight] == [
        ("r3", "prefilling", 8)
    ]
    code, text = replay(str(path))
    assert code == 0
    assert "in flight when the log ends" in text and "r3: prefilling 8 of 20" in text


def test_the_summary_reads_a_rotated_set_and_skips_a_torn_last_line(tmp_path: Path, capsys) -> None:
    path = tmp_path / "run.jsonl"
    with EventLogWriter(path, LogHeader(created=T0), rotate_bytes=600) as writer:
        for event in two_requests().events:
            writer.append(event)
    last = log_files(path)[-1]
    with open(last, "ab") as f:
        f.write(b'{"seq": 99, "ty')

    code, _ = replay(str(path))
    assert code == 0
    assert "torn last line" in capsys.readouterr().err
    with pytest.warns(TornLineWarning):
        s = summarize(path)
    assert s.num_events == len(two_requests().events)
    assert len(s.files) > 1


# -- verify ----------------------------------------------------------------------------------


def test_a_sound_log_verifies(tmp_path: Path) -> None:
    path = write(tmp_path, two_requests().events)

    report = verify(path)
    assert report.ok and report.violations == () and report.num_requests == 2
    code, text = replay(str(path), "--verify")
    assert code == 0
    assert "OK: no violations" in text


def _events() -> list:
    return two_requests().events


def _two_terminals(ev: list) -> list:
    b = two_requests()
    b.end("r2", FinishReason.CANCELLED)
    return b.events


def _after_terminal(ev: list) -> list:
    b = two_requests()
    b.token("r2", 11)
    return b.events


def _gap_in_chunks(ev: list) -> list:
    return [
        e.model_copy(update={"start": 5}) if isinstance(e, ChunkPrefilled) and e.start == 4 else e
        for e in ev
    ]


def _overlapping_chunks(ev: list) -> list:
    return [
        e.model_copy(update={"start": 2}) if isinstance(e, ChunkPrefilled) and e.start == 4 else e
        for e in ev
    ]


def _prompt_not_covered(ev: list) -> list:
    return renumber(
        [
            e
            for e in ev
            if not (isinstance(e, ChunkPrefilled) and (e.request_id, e.start) == ("r1", 8))
        ]
    )


def _chunk_past_prompt(ev: list) -> list:
    return [
        e.model_copy(update={"end": 11}) if isinstance(e, ChunkPrefilled) and e.start == 8 else e
        for e in ev
    ]


def _over_budget(ev: list) -> list:
    def bigger(e):
        return e.model_copy(update={"num_tokens": (9,) * len(e.num_tokens)})

    return [bigger(e) if isinstance(e, StepPlanned) and e.step == 1 else e for e in ev]


def _over_max_num_seqs(ev: list) -> list:
    return [
        e.model_copy(update={"max_num_seqs": 1})
        if isinstance(e, StepPlanned) and e.step == 2
        else e
        for e in ev
    ]


def _seq_gap(ev: list) -> list:
    return [e for e in ev if not (isinstance(e, TokensSampled) and e.token_ids == (6,))]


def _seq_duplicate(ev: list) -> list:
    i = next(i for i, e in enumerate(ev) if isinstance(e, StepPlanned) and e.step == 3)
    return ev[: i + 1] + [ev[i]] + ev[i + 1 :]


def _unknown_request(ev: list) -> list:
    b = two_requests()
    b.token("ghost", 1)
    return b.events


def _admitted_twice(ev: list) -> list:
    b = two_requests()
    b.admit("r1", 4)
    return b.events


@pytest.mark.parametrize(
    ("mutate", "kind"),
    [
        (_two_terminals, ViolationKind.TWO_TERMINALS),
        (_after_terminal, ViolationKind.AFTER_TERMINAL),
        (_gap_in_chunks, ViolationKind.NON_CONTIGUOUS_CHUNK),
        (_overlapping_chunks, ViolationKind.NON_CONTIGUOUS_CHUNK),
        (_prompt_not_covered, ViolationKind.PROMPT_NOT_COVERED),
        (_chunk_past_prompt, ViolationKind.CHUNK_PAST_PROMPT),
        (_over_budget, ViolationKind.STEP_OVER_BUDGET),
        (_over_max_num_seqs, ViolationKind.STEP_OVER_MAX_NUM_SEQS),
        (_seq_gap, ViolationKind.SEQ_GAP),
        (_seq_duplicate, ViolationKind.SEQ_DUPLICATE),
        (_unknown_request, ViolationKind.UNKNOWN_REQUEST),
        (_admitted_twice, ViolationKind.ADMITTED_TWICE),
    ],
    ids=lambda p: p.value if isinstance(p, ViolationKind) else p.__name__.strip("_"),
)
def test_verify_reports_each_violation_with_its_events_and_exit_code_1(
    tmp_path: Path, mutate, kind: ViolationKind
) -> None:
    path = write(tmp_path, mutate(_events()))

    report = verify(path)
    assert not report.ok
    assert kind.value in report.counts
    shown = next(v for v in report.violations if v.kind is kind)
    assert shown.events, "a violation names the events that show it"
    code, text = replay(str(path), "--verify", "--json")
    assert code == 1
    assert kind.value in json.loads(text)["counts"]


def test_verify_names_the_two_terminals(tmp_path: Path) -> None:
    code, text = replay(str(write(tmp_path, _two_terminals(_events()))), "--verify")

    assert code == 1
    assert "two-terminals: request r2 ends twice: stop, then cancelled" in text
    assert "terminal r2: stop" in text and "terminal r2: cancelled" in text


def test_verify_shows_the_tokens_that_came_before_the_prompt_was_covered(tmp_path: Path) -> None:
    code, text = replay(str(write(tmp_path, _prompt_not_covered(_events()))), "--verify")

    assert code == 1
    assert "prompt-not-covered" in text
    assert "decoding r1 [5]" in text  # the request's part of the step's tokens


def test_verify_reports_requests_in_flight_apart_from_violations(tmp_path: Path) -> None:
    b = two_requests()
    b.admit("r3", 20)
    report = verify(write(tmp_path, b.events))

    assert report.ok
    assert [r.request_id for r in report.in_flight] == ["r3"]


def test_verify_reports_a_corrupt_line_and_stops_there(tmp_path: Path, capsys) -> None:
    path = write(tmp_path, two_requests().events)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[4] = b"garbage\n"
    path.write_bytes(b"".join(lines))

    report = verify(path)
    assert report.counts == {"corrupt-log": 1}
    assert replay(str(path), "--verify")[0] == 1
    assert replay(str(path))[0] == 2  # the summary cannot be made
    assert "run.jsonl:5" in capsys.readouterr().err


# -- machine-readable output ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        ((), "outcomes"),
        (("--summary",), "outcomes"),
        (("--request", "r2"), "ttft_s"),
        (("--at-step", "2"), "requests"),
        (("--steps", "1..2"), "steps"),
        (("--verify",), "violations"),
    ],
)
def test_every_view_has_json_output(tmp_path: Path, argv, key: str) -> None:
    code, text = replay(str(write(tmp_path, two_requests().events)), *argv, "--json")

    assert code == 0
    assert key in json.loads(text)


# -- pictures --------------------------------------------------------------------------------


def _assert_self_contained(markup: str) -> None:
    root = ET.fromstring(markup)
    for element in root.iter():
        for name in element.attrib:
            assert not name.endswith("href") and name != "src", f"external reference: {name}"
    lowered = markup.replace(f'xmlns="{SVG_NS}"', "").lower()
    for needle in ("http", "url(", "<script", "@import", "<image"):
        assert needle not in lowered


def test_the_svg_is_well_formed_with_one_row_per_request_and_nothing_external(
    tmp_path: Path,
) -> None:
    b = two_requests()
    b.admit("r<3>&", 2)  # ids are escaped
    svg = render_svg(write(tmp_path, b.events))

    _assert_self_contained(svg)
    root = ET.fromstring(svg)
    rows = [g for g in root.iter(f"{{{SVG_NS}}}g") if g.get("class") == "request"]
    assert [g.get("data-request-id") for g in rows] == ["r1", "r2", "r<3>&"]
    titles = " ".join(t.text or "" for t in root.iter(f"{{{SVG_NS}}}title"))
    assert "r1: prefill [0, 8) of 10 at step 1" in titles
    assert "r1: checkpoint at prompt offset 4" in titles
    assert "r1: decoding steps 3..4, 2 tokens" in titles
    assert "r2: stop at step 3" in titles


def test_the_cli_writes_svg_and_html_pictures(tmp_path: Path) -> None:
    path = write(tmp_path, two_requests().events)
    svg, page = tmp_path / "t.svg", tmp_path / "t.html"

    code, text = replay(str(path), "--svg", str(svg), "--html", str(page))
    assert (code, text) == (0, "")
    _assert_self_contained(svg.read_text(encoding="utf-8"))
    html_text = page.read_text(encoding="utf-8")
    assert html_text.startswith("<!DOCTYPE html>") and "http" not in html_text
    assert html_text.count('class="request"') == 2


def test_a_picture_can_be_limited_to_steps_and_one_request(tmp_path: Path) -> None:
    path = write(tmp_path, two_requests().events)

    svg = render_svg(path, first_step=2, last_step=3, request_ids={"r2"})
    assert svg.count('class="request"') == 1
    assert 'data-request-id="r2"' in svg
    assert render_html(path, request_ids={"r1"}).count('class="request"') == 1


# -- re-execution without the prompts --------------------------------------------------------


def test_reexecution_says_why_it_cannot_run_without_logged_prompts(tmp_path: Path) -> None:
    b = LogBuilder(log_prompts=False)
    b.admit("r1", 4)
    path = b.write(tmp_path / "run.jsonl")

    code, text = replay(str(path), "--reexecute")
    assert code == 2
    assert "log_prompts=False" in text and "--log-prompts=true" in text


def test_a_model_the_log_does_not_serve_is_an_error_naming_its_model(
    tmp_path: Path, capsys
) -> None:
    path = write(tmp_path, two_requests().events)
    assert replay(str(path), "--model", "m")[0] == 2
    assert "no model 'm'" in (err := capsys.readouterr().err) and "its models are demo" in err
    assert replay(str(path), "--model", "demo", "--at-step", "2")[0] == 0  # its one model


# -- distributions ---------------------------------------------------------------------------


def test_percentiles_are_exact_for_small_samples_and_within_one_percent_for_large() -> None:
    small = Distribution()
    for v in (1.0, 2.0, 3.0, 4.0):
        small.add(v)
    assert small.percentiles().p50 == pytest.approx(2.5)

    large = Distribution()
    values = [(i % 1000 + 1) / 1000 for i in range(150_000)]  # past the exact limit
    for v in values:
        large.add(v)
    p = large.percentiles()
    assert p.count == 150_000 and p.max == 1.0
    assert p.mean == pytest.approx(sum(values) / len(values))
    assert p.p50 == pytest.approx(0.5, rel=0.01)
    assert p.p99 == pytest.approx(0.99, rel=0.01)


# -- re-execution with the demo model --------------------------------------------------------


async def _record_a_run(path: Path) -> None:
    from stepline.api import Engine, SamplingParams

    async with Engine.open(
        "stepline-demo", max_step_tokens=32, max_num_seqs=4, event_log=path
    ) as engine:
        streams = []
        for i in range(6):  # greedy and seeded sampling, sharing steps
            params = SamplingParams(
                max_tokens=10, temperature=0.0 if i % 2 else 0.8, seed=None if i % 2 else i
            )
            prompt = f"request {i} says hello " * (i + 2)
            streams.append(
                await engine.submit(prompt, params=params, request_id=f"r{i}", checkpoints=(4,))
            )
        for stream in streams:
            async for _ in stream:
                pass


def test_reexecuting_a_greedy_and_seeded_run_reproduces_every_token(
    tmp_path: Path, model_cache_dir, capsys
) -> None:
    path = tmp_path / "run.jsonl"
    asyncio.run(_record_a_run(path))

    code, text = replay(str(path), "--reexecute", "--json")
    report = json.loads(text)
    assert code == 0, text
    assert (report["num_same"], report["num_diverged"], report["num_skipped"]) == (6, 0, 0)
    assert "6 of 6 requests can be compared (greedy or seeded)" in capsys.readouterr().err


def test_reexecution_reports_the_first_divergence(tmp_path: Path, model_cache_dir) -> None:
    recorded = tmp_path / "run.jsonl"
    asyncio.run(_record_a_run(recorded))
    events = list(read_events(recorded))
    steps = [i for i, e in enumerate(events) if isinstance(e, TokensSampled)]
    i = [i for i in steps if "r3" in events[i].request_ids][1]  # the step of r3's 2nd token
    row = events[i].request_ids.index("r3")
    ids = list(events[i].token_ids)
    original, ids[row] = ids[row], ids[row] + 1
    events[i] = events[i].model_copy(update={"token_ids": tuple(ids)})
    tampered = tmp_path / "tampered.jsonl"
    with EventLogWriter(tampered, read_header(recorded)) as writer:
        for event in events:
            writer.append(event)

    code, text = replay(str(tampered), "--reexecute")
    assert code == 1
    assert (
        f"first divergence: request r3 at output position 1: recorded {original + 1}, "
        f"re-executed {original}"
    ) in text


def test_reexecution_says_up_front_what_it_can_compare_and_fails_when_nothing_was(
    tmp_path: Path, capsys
) -> None:
    sampled = PARAMS.model_copy(update={"temperature": 0.8})  # no seed: not reproducible
    b = LogBuilder(step_every=STEP)
    for rid in ("a", "b"):
        b.admit(rid, 2, params=sampled)
    b.plan(("a", "prefill", 2), ("b", "prefill", 2))
    b.chunk("a", 0, 2)
    b.chunk("b", 0, 2)
    b.token("a", 5)
    b.token("b", 6)
    b.end("a", FinishReason.LENGTH)
    b.end("b", FinishReason.LENGTH)
    path = write(tmp_path, b.events)

    code, text = replay(str(path), "--reexecute")  # no model is loaded: nothing to run
    assert code == 1
    assert "0 same, 0 diverged, 2 skipped" in text
    assert "FAILED: nothing was compared" in text
    err = capsys.readouterr().err
    assert (
        "0 of 2 requests can be compared (greedy or seeded); 2 will be skipped: "
        "2 sampled without a seed, so not reproducible"
    ) in err
