"""`stepline replay` pictures and trace export: why was a request slow?

The logs are written by hand (tests/log_builder.py) through the real writer (no model): three
requests decode at 20 ms a step until a long prompt arrives; its 2048-token chunk makes step 9
take 141 ms, and the three streams freeze for it. One log is a real run of the demo model.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import random
import re
import shutil
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest
from helpers import replay
from hypothesis import given, settings
from hypothesis import strategies as st
from log_builder import LogBuilder

from stepline.api.cli.replay import Progress
from stepline.events.models import FinishReason, RequestParams
from stepline.events.replay import summarize
from stepline.events.replay.svg import SVG_NS, render_svg
from stepline.events.replay.trace import check_trace, export_trace

GREEDY = RequestParams(max_tokens=20, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None)
LONG_ID = "chatcmpl-7f3a9c2e-4b1d-4e8a-9f6b-a1b2c3d4e5f6"  # longer than the old 20-char cut
DECODING = [LONG_ID, "r2", "r3"]
LATE = "late"  # the long prompt
STALL_STEP = 9  # the step that carries late's first chunk and takes 141 ms


def recorder(max_step_tokens: int = 2112) -> LogBuilder:
    """A log of timed steps with 1 ms of the loop's own bookkeeping between them."""
    return LogBuilder(
        max_step_tokens=max_step_tokens,
        max_num_seqs=64,
        params=GREEDY,
        timed=True,
        loop_seconds=0.001,
    )


def stalled_run() -> LogBuilder:
    rec = recorder()
    for rid in DECODING:
        rec.admit(rid, 40)
    rec.do_step([], {rid: (0, 40) for rid in DECODING}, seconds=0.03, predicted=0.03)
    for _ in range(7):  # steps 2..8
        rec.do_step(DECODING, seconds=0.02, predicted=0.02)
    rec.admit(LATE, 3000)  # arrives after step 8, 5 ms before step 9 is planned
    rec.ts += 0.005
    rec.do_step(DECODING, {LATE: (0, 2048)}, seconds=0.141, predicted=0.06)  # step 9
    rec.do_step(DECODING, {LATE: (2048, 3000)}, seconds=0.03, predicted=0.03)
    for _ in range(6):
        rec.do_step([*DECODING, LATE], seconds=0.021, predicted=0.02)
    for rid in DECODING:
        rec.end(rid, FinishReason.LENGTH)
    rec.do_step([LATE], seconds=0.015, predicted=0.015)
    rec.end(LATE, FinishReason.STOP)
    return rec


@pytest.fixture
def stall_log(tmp_path: Path) -> Path:
    return stalled_run().write(tmp_path / "run.jsonl")


def _q(tag: str) -> str:
    return f"{{{SVG_NS}}}{tag}"


def _title(element: ET.Element) -> str:
    title = element.find(_q("title"))
    return "" if title is None else (title.text or "")


def _row(root: ET.Element, rid: str) -> ET.Element:
    for g in root.iter(_q("g")):
        if g.get("class") == "request" and g.get("data-request-id") == rid:
            return g
    raise AssertionError(f"no row for {rid}")


def _strip_bars(root: ET.Element) -> dict[int, ET.Element]:
    strip = next(g for g in root.iter(_q("g")) if g.get("class") == "steps")
    return {int(r.get("data-step", -1)): r for r in strip.iter(_q("rect"))}


def _x_range(element: ET.Element) -> tuple[float, float]:
    x = float(element.get("x", 0))
    return x, x + float(element.get("width", 0))


# -- the picture ------------------------------------------------------------------------------


@pytest.mark.parametrize("time_axis", [True, False], ids=["time-axis", "step-axis"])
def test_a_stall_is_marked_on_every_row_it_froze_with_the_step_that_caused_it(
    stall_log: Path, time_axis: bool
) -> None:
    root = ET.fromstring(render_svg(stall_log, time_axis=time_axis))

    bars = _strip_bars(root)
    cause = bars[STALL_STEP]
    assert cause.get("fill") == "#e15759"  # the strip shows the step that stalled someone
    assert float(cause.get("height", 0)) == max(float(b.get("height", 0)) for b in bars.values())
    assert "step 9 took 141.0 ms (predicted 60.0 ms): late prefill 2048 tokens" in _title(cause)
    for rid in DECODING:
        stalls = [r for r in _row(root, rid).iter(_q("rect")) if r.get("class") == "stall"]
        assert len(stalls) == 1, rid
        assert stalls[0].get("data-cause-step") == str(STALL_STEP)
        assert _title(stalls[0]).startswith(f"{rid} stalled 147.0 ms between tokens at steps 8")
        assert "step 9 took 141.0 ms" in _title(stalls[0])
        # drawn where it happened: from the token before to the token after, over the step
        # that caused it
        (x0, x1), (c0, c1) = _x_range(stalls[0]), _x_range(cause)
        assert x0 <= c0 + 0.6 and x1 >= c1 - 0.6 and x1 - x0 < 1.2 * (c1 - c0)
    late = _row(root, LATE)
    assert not [r for r in late.iter(_q("rect")) if r.get("class") == "stall"]
    texts = [t.text or "" for t in root.iter(_q("text"))]
    assert "steps that stalled requests longest: 9 (3 requests, took 141.0 ms)" in texts


def test_the_step_time_strip_shows_measured_and_predicted_time_on_hover(stall_log: Path) -> None:
    root = ET.fromstring(render_svg(stall_log))

    bars = _strip_bars(root)
    assert sorted(bars) == list(range(1, 18))
    h = {step: float(bar.get("height", 0)) for step, bar in bars.items()}
    assert h[2] / h[STALL_STEP] == pytest.approx(0.02 / 0.141, rel=0.02)  # heights are times
    assert "step 2 took 20.0 ms (predicted 20.0 ms): 3 decode rows (3/2112 tokens)" in _title(
        bars[2]
    )
    predicted = [_title(line) for line in root.iter(_q("line")) if "predicted" in _title(line)]
    assert "step 9 predicted 60.0 ms" in predicted


def test_the_step_time_strip_draws_the_configured_target_as_a_line(tmp_path: Path) -> None:
    rec = stalled_run()
    rec.header = rec.header.model_copy(update={"config": {**rec.header.config, "max_step_ms": 60}})
    root = ET.fromstring(render_svg(rec.write(tmp_path / "run.jsonl")))

    bars = _strip_bars(root)
    line = next(e for e in root.iter(_q("line")) if e.get("class") == "target")
    bottom = float(bars[2].get("y", 0)) + float(bars[2].get("height", 0))
    tallest = float(bars[STALL_STEP].get("height", 0))
    assert (bottom - float(line.get("y1", 0))) / tallest == pytest.approx(60 / 141, rel=0.02)
    assert _title(line).startswith("step-time target 60.0 ms (max_step_ms)")
    assert "1 of 17 steps took longer" in _title(line)  # step 9
    label = next(t for t in root.iter(_q("text")) if t.text == "target 60.0 ms")
    assert float(label.get("x", 0)) > float(line.get("x2", 0))  # right of the plot, in view
    assert float(label.get("x", 0)) + len("target 60.0 ms") * 6.7 <= float(root.get("width", 0))


def test_a_target_above_every_step_stays_in_view_and_none_draws_no_line(
    stall_log: Path, tmp_path: Path
) -> None:
    rec = stalled_run()
    rec.header = rec.header.model_copy(update={"config": {**rec.header.config, "max_step_ms": 500}})
    root = ET.fromstring(render_svg(rec.write(tmp_path / "slow-target.jsonl")))
    line = next(e for e in root.iter(_q("line")) if e.get("class") == "target")
    strip_top = min(float(b.get("y", 0)) for b in _strip_bars(root).values())
    assert float(line.get("y1", 0)) <= strip_top  # the top of the strip: 500 ms
    assert "0 of 17 steps took longer" in _title(line)

    plain = ET.fromstring(render_svg(stall_log))  # a header without max_step_ms
    assert not [e for e in plain.iter(_q("line")) if e.get("class") == "target"]


def test_every_row_shows_its_step_boundaries(stall_log: Path) -> None:
    root = ET.fromstring(render_svg(stall_log))

    for rid, steps in ((LONG_ID, range(2, 17)), (LATE, range(10, 18))):
        paths = [p for p in _row(root, rid).iter(_q("path")) if p.get("class") == "step-boundaries"]
        assert len(paths) == 1
        # one hairline at the start of each of its steps but its first
        assert paths[0].get("d", "").count("M") == len(steps)


def test_the_first_token_is_a_marker_where_it_came_out_not_a_bar(stall_log: Path) -> None:
    root = ET.fromstring(render_svg(stall_log, time_axis=True))

    row = _row(root, LATE)
    marker = next(p for p in row.iter(_q("polygon")) if p.get("class") == "first-token")
    xs = [float(pt.split(",")[0]) for pt in marker.get("points", "").split()]
    chunk = next(r for r in row.iter(_q("rect")) if "prefill [2048, 3000)" in _title(r))
    assert max(xs) - min(xs) <= 10  # a point in time, whatever the step's width
    # at the end of the step that produced it
    assert (min(xs) + max(xs)) / 2 == pytest.approx(_x_range(chunk)[1], abs=0.6)
    assert "first token at step 10: TTFT 177.0 ms" in _title(marker)


def test_a_request_picture_zooms_to_its_life_with_its_numbers_and_full_id(
    stall_log: Path, tmp_path: Path
) -> None:
    whole = ET.fromstring(render_svg(stall_log))
    zoomed_svg = render_svg(stall_log, request_ids={LATE})
    zoomed = ET.fromstring(zoomed_svg)

    def chunk_width(root: ET.Element) -> float:
        row = _row(root, LATE)
        return float(
            next(r for r in row.iter(_q("rect")) if "prefill [0, 2048)" in _title(r)).get(
                "width", 0
            )
        )

    assert chunk_width(zoomed) > 1.5 * chunk_width(whole)
    assert "steps 8..17" in zoomed_svg
    texts = ["".join(t.itertext()) for t in zoomed.iter(_q("text"))]
    facts = next(t for t in texts if t.startswith(f"{LATE}: TTFT"))
    assert "TTFT 177.0 ms · queued 5.0 ms · 2 prefill chunks · worst gap" in facts
    assert "0 cached tokens · 8 output tokens · stop after" in facts

    labels = {t.text for t in whole.iter(_q("text"))}
    assert LONG_ID in labels  # the whole id, so it can be pasted back into --request
    code, _ = replay(str(stall_log), "--request", LONG_ID, "--svg", str(tmp_path / "one.svg"))
    assert code == 0
    assert (tmp_path / "one.svg").read_text(encoding="utf-8").count('class="request"') == 1


def test_the_summary_names_the_step_that_caused_each_stall(stall_log: Path) -> None:
    top = summarize(stall_log).longest_stalls[0]

    assert (top.from_step, top.to_step, top.cause_step) == (8, 9, STALL_STEP)
    assert top.cause is not None
    assert top.cause.startswith("step 9 took 141.0 ms (predicted 60.0 ms): late prefill 2048")
    _, text = replay(str(stall_log))
    # one wait of three requests, shown once, then added up under the prompt that caused it
    assert " and 2 other requests: 147.0 ms from step 8 to 9: step 9 took 141.0 ms" in text
    assert "  late: 3 stalls, 441.0 ms in total, in 1 step (worst: step 9, 147.0 ms)" in text


def test_request_and_steps_combine(stall_log: Path, tmp_path: Path) -> None:
    code, text = replay(str(stall_log), "--request", "r2", "--steps", "8..10")

    assert code == 0
    steps = [int(m) for m in re.findall(r"^\s+(\d+)\s+[\d.]+ ms", text, re.MULTILINE)]
    assert steps and set(steps) == {8, 9, 10}
    assert "steps 8..10 only" in text
    assert "TTFT 30.0 ms" in text  # the latencies are still the whole life's
    code, _ = replay(
        str(stall_log), "--request", "r2", "--steps", "8..10", "--svg", str(tmp_path / "z.svg")
    )
    assert code == 0 and "steps 8..10" in (tmp_path / "z.svg").read_text(encoding="utf-8")
    assert replay(str(stall_log), "--request", "r2", "--verify")[0] == 2


# -- many requests ---------------------------------------------------------------------------


def busy_run(num_requests: int, *, slow: str) -> LogBuilder:
    """`num_requests` short requests, 64 in flight, 10 ms steps; `slow` sits out 30 steps
    after its first token, so it alone waits over 300 ms."""
    rec = recorder(max_step_tokens=512)
    arriving = iter(f"req-{i:05d}" for i in range(num_requests))
    tokens: dict[str, int] = {}  # running request -> its tokens so far
    sat_out = 0
    while True:
        new = list(itertools.islice(arriving, 64 - len(tokens)))
        for rid in new:
            rec.admit(rid, 4)
        if not tokens and not new:
            return rec
        held = slow in tokens and sat_out < 30
        sat_out += held
        decode = [rid for rid in tokens if not (held and rid == slow)]
        rec.do_step(decode, {rid: (0, 4) for rid in new}, seconds=0.01)
        for rid in decode:
            tokens[rid] += 1
            if tokens[rid] == 3:
                rec.end(rid, FinishReason.LENGTH)
                del tokens[rid]
        tokens.update(dict.fromkeys(new, 1))


@pytest.fixture(scope="module")
def busy_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return busy_run(10_000, slow="req-04321").write(tmp_path_factory.mktemp("busy") / "busy.jsonl")


def test_ten_thousand_requests_give_a_readable_picture_of_a_few_megabytes(
    busy_log: Path, tmp_path: Path
) -> None:
    target = tmp_path / "busy.svg"
    code, _ = replay(str(busy_log), "--svg", str(target), "--top", "20")
    assert code == 0

    svg = target.read_text(encoding="utf-8")
    assert len(svg.encode()) < 3 * 2**20
    root = ET.fromstring(svg)
    assert int(root.get("height", 0)) < 1000 and int(root.get("width", 0)) < 2500
    rows = [g.get("data-request-id") for g in root.iter(_q("g")) if g.get("class") == "request"]
    assert len(rows) == 20
    assert rows[0] == "req-04321"  # slowest first: it waited 30 steps
    assert "… and 9980 more requests folded" in svg
    assert "10000 requests" in svg
    bars = _strip_bars(root)
    assert len(bars) <= 1600  # narrow steps are bucketed, one bar per 2 px at least


# -- trace export -----------------------------------------------------------------------------

# The Trace Event format (Google's "Trace Event Format" document), as far as stepline uses it:
# the JSON object form, complete ("X"), instant ("i"), counter ("C"), flow ("s"/"f") and
# metadata ("M") events.
TRACE_EVENT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "traceEvents": {"type": "array", "items": {"$ref": "#/$defs/event"}},
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "otherData": {"type": "object"},
    },
    "$defs": {
        "event": {
            "type": "object",
            "required": ["ph", "name", "pid"],
            "properties": {
                "ph": {"enum": ["X", "i", "C", "s", "f", "M"]},
                "name": {"type": "string", "minLength": 1},
                "cat": {"type": "string"},
                "pid": {"type": "integer"},
                "tid": {"type": "integer"},
                "ts": {"type": "number", "minimum": 0},
                "dur": {"type": "number", "minimum": 0},
                "args": {"type": "object"},
            },
            "allOf": [
                {
                    "if": {"properties": {"ph": {"const": "X"}}},
                    "then": {"required": ["ts", "dur", "tid"]},
                },
                {
                    "if": {"properties": {"ph": {"const": "i"}}},
                    "then": {
                        "required": ["ts", "tid", "s"],
                        "properties": {"s": {"enum": ["g", "p", "t"]}},
                    },
                },
                {
                    "if": {"properties": {"ph": {"const": "C"}}},
                    "then": {
                        "required": ["ts", "args"],
                        "properties": {
                            "args": {"additionalProperties": {"type": "number"}, "minProperties": 1}
                        },
                    },
                },
                {
                    "if": {"properties": {"ph": {"enum": ["s", "f"]}}},
                    "then": {"required": ["ts", "tid", "id", "cat"]},
                },
                {
                    "if": {"properties": {"ph": {"const": "f"}}},
                    "then": {"properties": {"bp": {"const": "e"}}},
                },
                {
                    "if": {"properties": {"ph": {"const": "M"}}},
                    "then": {
                        "required": ["args"],
                        "properties": {
                            "name": {
                                "enum": [
                                    "process_name",
                                    "thread_name",
                                    "process_sort_index",
                                    "thread_sort_index",
                                ]
                            }
                        },
                    },
                },
            ],
        }
    },
}


def _slices(trace: dict, pid: int, tid: int) -> list[dict]:
    return [
        e for e in trace["traceEvents"] if e["ph"] == "X" and (e["pid"], e["tid"]) == (pid, tid)
    ]


def _life(trace: dict, rid: str) -> dict:
    """A request's own slice: named by its id, its phases nested in it."""
    return next(e for e in trace["traceEvents"] if e.get("cat") == "request" and e["name"] == rid)


def _phases(trace: dict, rid: str, ph: str = "X") -> list[dict]:
    return [
        e
        for e in trace["traceEvents"]
        if e["ph"] == ph
        and e.get("args", {}).get("request_id") == rid
        and not (ph == "X" and e.get("cat") == "request")  # its life, not a phase
    ]


def test_the_trace_is_trace_event_json_with_the_stall_where_it_happened(
    stall_log: Path, tmp_path: Path, capsys
) -> None:
    target = tmp_path / "run.trace.json"
    code, _ = replay(str(stall_log), "--trace", str(target))
    assert code == 0
    assert "wrote" in capsys.readouterr().err

    trace = json.loads(target.read_text(encoding="utf-8"))
    jsonschema.validate(trace, TRACE_EVENT_SCHEMA)
    assert check_trace(trace) == []
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    engine = next(k for k, v in names.items() if v == "steps")
    # Four requests in flight at once: four tracks, each request a slice named by its full id.
    assert sorted(v for v in names.values() if v != "steps") == [
        f"requests #{i}" for i in (1, 2, 3, 4)
    ]
    lives = {rid: _life(trace, rid) for rid in [*DECODING, LATE]}
    assert len({(e["pid"], e["tid"]) for e in lives.values()}) == 4

    step9 = next(e for e in _slices(trace, *engine) if e["name"] == f"step {STALL_STEP}")
    assert step9["dur"] == 141_000
    assert step9["args"]["predicted_ms"] == 60.0 and step9["args"]["chunk_tokens"] == 2048
    for rid in DECODING:
        stall = [e for e in _phases(trace, rid) if e["cat"] == "stall"]
        assert [s["name"] for s in stall] == ["stall 147.0 ms"]
        assert (stall[0]["ts"], stall[0]["dur"]) == (step9["ts"], step9["dur"])
        assert stall[0]["args"]["cause_step"] == STALL_STEP
        assert stall[0]["tid"] == lives[rid]["tid"]
    flows = [e for e in trace["traceEvents"] if e["ph"] in "sf"]
    assert len(flows) == 6
    for start in (e for e in flows if e["ph"] == "s"):
        assert step9["ts"] <= start["ts"] <= step9["ts"] + step9["dur"]  # from inside step 9
    kinds = [e["name"] for e in _phases(trace, LATE)]
    assert kinds == ["queued", "prefill [0, 2048)", "prefill [2048, 3000)", "decode"]
    assert [e["name"] for e in _phases(trace, LATE, "i")] == ["first token", "stop"]
    late = lives[LATE]
    for phase in [*_phases(trace, LATE), *_phases(trace, LATE, "i")]:  # nested in its life
        assert (
            late["ts"]
            <= phase["ts"]
            <= phase["ts"] + phase.get("dur", 0)
            <= late["ts"] + late["dur"]
        )


def test_steps_back_to_back_meet_at_one_whole_microsecond(tmp_path: Path) -> None:
    # Steps that start where the one before ends, at times with fractions of a microsecond:
    # rounding each slice's start and length apart made 28 of these 200 steps end a
    # nanosecond after the next one began, and Perfetto drops such a slice.
    rec = recorder()
    rec.loop_seconds = 0.0
    rec.admit("r1", 40)
    rec.do_step([], {"r1": (0, 40)}, seconds=0.01)
    for i in range(200):
        rec.do_step(["r1"], seconds=0.002 + i * 1e-6 / 7)
    rec.end("r1", FinishReason.LENGTH)
    path = rec.write(tmp_path / "run.jsonl")
    export_trace(path, tmp_path / "t.json", stall_s=1.0)

    trace = json.loads((tmp_path / "t.json").read_text(encoding="utf-8"))
    assert check_trace(trace, max_tracks=2) == []
    steps = _slices(trace, 1, 1)
    assert len(steps) == 201
    for slice_, following in itertools.pairwise(steps):
        assert isinstance(slice_["ts"], int) and isinstance(slice_["dur"], int)
        assert slice_["ts"] + slice_["dur"] == following["ts"]
    decode = next(e for e in _phases(trace, "r1") if e["name"] == "decode")
    assert decode["ts"] == steps[1]["ts"]  # the same boundary, the same number
    assert decode["ts"] + decode["dur"] == steps[-1]["ts"] + steps[-1]["dur"]


def test_ten_thousand_requests_share_a_bounded_number_of_tracks(
    busy_log: Path, tmp_path: Path
) -> None:
    stats = export_trace(busy_log, tmp_path / "busy.json")

    assert stats.num_requests == stats.num_requests_drawn == 10_000
    assert stats.num_tracks <= 128  # 64 in flight, and those admitted in their last step
    trace = json.loads((tmp_path / "busy.json").read_text(encoding="utf-8"))
    assert len(trace["traceEvents"]) == stats.num_events
    assert check_trace(trace, max_tracks=stats.num_tracks + 1) == []
    assert trace["otherData"]["requests_not_drawn"] == 0
    stall = [e for e in trace["traceEvents"] if e.get("cat") == "stall" and e["ph"] == "X"]
    assert [e["args"]["gap_ms"] > 290 for e in stall] == [True]
    assert stall[0]["args"]["request_id"] == "req-04321"
    # Validating 100,000 events takes jsonschema seconds: the first few thousand and the stall
    # cover every kind of event the export writes.
    jsonschema.validate({"traceEvents": trace["traceEvents"][:3000] + stall}, TRACE_EVENT_SCHEMA)
    assert (tmp_path / "busy.json").stat().st_size < 40 * 2**20


def test_past_its_tracks_a_trace_draws_the_requests_that_waited_longest(
    busy_log: Path, tmp_path: Path, capsys
) -> None:
    target = tmp_path / "few.json"
    code, _ = replay(str(busy_log), "--trace", str(target), "--trace-tracks", "16")
    assert code == 0
    assert "10000 requests on 16 tracks (" in capsys.readouterr().err

    trace = json.loads(target.read_text(encoding="utf-8"))
    assert check_trace(trace, max_tracks=17) == []
    lives = [e for e in trace["traceEvents"] if e.get("cat") == "request" and e["ph"] == "X"]
    assert 0 < len(lives) < 10_000
    assert "req-04321" in {e["name"] for e in lives}  # the one that waited 300 ms
    not_drawn = trace["otherData"]["requests_not_drawn"]
    assert not_drawn == 10_000 - len(lives)
    process = next(e for e in trace["traceEvents"] if e["ph"] == "M" and e["pid"] == 2)
    assert f"{not_drawn} of 10000 not drawn" in process["args"]["name"]


def test_a_trace_of_one_request_draws_it_alone_beside_every_step(
    stall_log: Path, tmp_path: Path
) -> None:
    target = tmp_path / "one.json"
    assert replay(str(stall_log), "--request", "r2", "--trace", str(target))[0] == 0

    trace = json.loads(target.read_text(encoding="utf-8"))
    lives = [
        e["name"] for e in trace["traceEvents"] if e.get("cat") == "request" and e["ph"] == "X"
    ]
    assert lives == ["r2"]
    assert len(_slices(trace, 1, 1)) == 17


def random_run(rng: random.Random) -> LogBuilder:
    """Requests arriving at random, 4 at a time under a 16-token budget, steps of random
    length (fractions of a microsecond included), back to back or not; a request now and
    then sits steps out, so some gaps are stalls."""
    rec = recorder(max_step_tokens=16)
    rec.loop_seconds = rng.choice([0.0, 1e-7, 0.0003])
    arriving = [(f"q{i}", rng.randint(1, 40), rng.randint(1, 8)) for i in range(rng.randint(1, 24))]
    waiting: list[tuple[str, int, int]] = []
    prefilling: dict[str, int] = {}  # request -> prompt tokens computed
    decoding: dict[str, int] = {}  # request -> tokens still to make
    lengths: dict[str, tuple[int, int]] = {}
    while arriving or waiting or prefilling or decoding:
        for _ in range(rng.randint(0, 3)):
            if arriving:
                rid, n, out = arriving.pop(0)
                rec.admit(rid, n)
                waiting.append((rid, n, out))
                lengths[rid] = (n, out)
        while waiting and len(prefilling) + len(decoding) < 4:
            prefilling[waiting.pop(0)[0]] = 0
        decode = [rid for rid in decoding if rng.random() > 0.15]  # the rest sit it out
        budget = 16 - len(decode)
        chunks = {}
        for rid, done in prefilling.items():
            n = min(lengths[rid][0] - done, budget)
            if n > 0:
                chunks[rid] = (done, done + n)
                budget -= n
        rec.do_step(decode, chunks, seconds=rng.uniform(0.0005, 0.05), predicted=0.01)
        for rid, (_, end) in chunks.items():
            prefilling[rid] = end
            if end == lengths[rid][0]:
                del prefilling[rid]
                decoding[rid] = lengths[rid][1] - 1
        for rid in decode:
            decoding[rid] -= 1
        for rid in [r for r, left in decoding.items() if left <= 0]:
            del decoding[rid]
            rec.end(rid, rng.choice([FinishReason.STOP, FinishReason.LENGTH]))
    return rec


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), tracks=st.integers(1, 6))
def test_any_run_gives_a_trace_with_no_partly_overlapping_slices(seed: int, tracks: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = random_run(random.Random(seed)).write(Path(tmp) / "run.jsonl")
        stats = export_trace(path, Path(tmp) / "t.json", tracks=tracks)
        trace = json.loads((Path(tmp) / "t.json").read_text(encoding="utf-8"))
    assert check_trace(trace, max_tracks=tracks + 1) == []
    assert stats.num_tracks <= tracks and stats.num_requests_drawn >= 1


# What the checker must refuse, each in a trace of its own: name, events, the problem's words.
def _x(name: str, ts, dur, tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


BROKEN_TRACES = {
    "partly overlapping": ([_x("a", 0, 10), _x("b", 5, 10)], "overlaps 'a' [0, 10) partly"),
    "negative duration": ([_x("a", 0, -1)], "negative duration"),
    "fractional time": ([_x("a", 0.5, 10)], "is not an integer"),
    "unknown phase": ([{"ph": "Q", "name": "a", "pid": 1, "tid": 1, "ts": 0}], "unknown phase"),
    "end without begin": (
        [{"ph": "E", "name": "a", "pid": 1, "tid": 1, "ts": 3}],
        "an E with no B open",
    ),
    "begin without end": (
        [{"ph": "B", "name": "a", "pid": 1, "tid": 1, "ts": 3}],
        "is never closed",
    ),
    "too many tracks": ([_x("a", 0, 1, tid=1), _x("b", 0, 1, tid=2)], "2 tracks, more than 1"),
    "flow backwards": (
        [
            _x("a", 0, 10),
            {"ph": "s", "name": "f", "cat": "c", "id": 1, "pid": 1, "tid": 1, "ts": 8},
            {"ph": "f", "name": "f", "cat": "c", "id": 1, "pid": 1, "tid": 1, "ts": 2, "bp": "e"},
        ],
        "before it starts",
    ),
}


@pytest.mark.parametrize("broken", BROKEN_TRACES, ids=list(BROKEN_TRACES))
def test_the_checker_catches_what_a_viewer_would_drop(broken: str) -> None:
    events, words = BROKEN_TRACES[broken]
    problems = check_trace({"traceEvents": events}, max_tracks=1)
    assert any(words in p for p in problems), problems


def test_the_checker_accepts_nested_and_adjacent_slices() -> None:
    events = [
        _x("life", 0, 30),
        _x("queued", 0, 10),
        _x("prefill", 10, 10),
        _x("decode", 20, 10),
        _x("empty", 30, 0),
        _x("next life", 30, 5),
        {"ph": "B", "name": "b", "pid": 1, "tid": 1, "ts": 40},
        {"ph": "E", "name": "b", "pid": 1, "tid": 1, "ts": 45},
    ]
    assert check_trace({"traceEvents": events}, max_tracks=1) == []


# -- a real engine's run ---------------------------------------------------------------------


async def _record_a_run(path: Path) -> None:
    """Eight requests of the demo model, four at a time: more in flight than three tracks."""
    from stepline.api import Engine, SamplingParams

    async with Engine.open(
        "stepline-demo", max_step_tokens=32, max_num_seqs=4, max_step_ms=50.0, event_log=path
    ) as engine:
        streams = [
            await engine.submit(
                f"request {i} says hello " * (i + 2),
                params=SamplingParams(max_tokens=6 + i, temperature=0.0),
                request_id=f"r{i}",
            )
            for i in range(8)
        ]
        for stream in streams:
            async for _ in stream:
                pass


@pytest.fixture(scope="module")
def engine_log(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("engine") / "run.jsonl"
    asyncio.run(_record_a_run(path))
    return path


@pytest.mark.parametrize("tracks", [3, 128])
def test_a_trace_of_a_real_engine_run_passes_the_check(
    engine_log: Path, tmp_path: Path, tracks: int
) -> None:
    stats = export_trace(engine_log, tmp_path / "t.json", tracks=tracks)

    trace = json.loads((tmp_path / "t.json").read_text(encoding="utf-8"))
    assert check_trace(trace, max_tracks=tracks + 1) == []
    assert stats.num_requests == 8 and stats.num_tracks <= tracks
    drawn = {
        e["name"] for e in trace["traceEvents"] if e.get("cat") == "request" and e["ph"] == "X"
    }
    assert len(drawn) == stats.num_requests_drawn
    if tracks == 128:
        assert drawn == {f"r{i}" for i in range(8)}
    else:
        assert 3 <= len(drawn) < 8


def test_the_picture_of_a_real_run_draws_its_step_time_target(engine_log: Path) -> None:
    root = ET.fromstring(render_svg(engine_log))

    line = next(e for e in root.iter(_q("line")) if e.get("class") == "target")
    assert _title(line).startswith("step-time target 50.0 ms (max_step_ms)")


def test_perfetto_reads_the_trace_of_a_real_run_without_dropping_a_slice(
    engine_log: Path, tmp_path: Path
) -> None:
    """Perfetto's own trace processor. It is a binary the `perfetto` package downloads from
    Google at run time; give its path in STEPLINE_TRACE_PROCESSOR where it cannot."""
    tp_module = pytest.importorskip("perfetto.trace_processor", reason="no perfetto package")
    binary = os.environ.get("STEPLINE_TRACE_PROCESSOR") or shutil.which("trace_processor_shell")
    if binary is None:
        pytest.skip("no trace_processor_shell binary (STEPLINE_TRACE_PROCESSOR or on PATH)")
    target = tmp_path / "t.json"
    stats = export_trace(engine_log, target, tracks=3)
    trace = json.loads(target.read_text(encoding="utf-8"))
    written = sum(e["ph"] in ("X", "i") for e in trace["traceEvents"])

    config = tp_module.TraceProcessorConfig(bin_path=binary)
    with tp_module.TraceProcessor(trace=str(target), config=config) as tp:
        num_slices = next(iter(tp.query("select count(*) as n from slice"))).n
        lost = [
            (row.name, row.value)
            for row in tp.query(
                "select name, value from stats where value > 0 "
                "and severity in ('error', 'data_loss')"
            )
        ]
        steps = next(iter(tp.query("select count(*) as n from slice where name glob 'step *'"))).n
    assert lost == []
    assert num_slices == written  # every complete slice and instant, none dropped
    assert steps == stats.num_steps


# -- progress ---------------------------------------------------------------------------------


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_long_replays_show_progress_on_a_terminal_only(busy_log: Path) -> None:
    screen = TtyStream()
    progress = Progress(screen, busy_log)
    summarize(busy_log, progress=progress.events)
    progress.done()

    shown = screen.getvalue()
    assert "reading busy.jsonl: 10,000 events (~" in shown and "30,000 events (~9" in shown
    assert shown.endswith("\r\x1b[K")  # the line is cleared when it is done
    piped = io.StringIO()
    quiet = Progress(piped, busy_log)
    summarize(busy_log, progress=quiet.events)
    quiet.done()
    assert piped.getvalue() == ""
