"""Replay says why: stalls added up per causing request, steps against the step-time target,
what sized each chunk and why a request sat steps out; and the fast reader behind it agrees
with the validated one and with `apply`."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from bulk_check import check_log
from log_builder import LogBuilder

from stepline.api.cli import main
from stepline.events.log import read_events
from stepline.events.models import (
    Admitted,
    CheckpointReached,
    ChunkPrefilled,
    FinishReason,
    StepFinished,
    StepPlanned,
    Terminal,
    TokensSampled,
)
from stepline.events.replay import request_timeline, summarize, verify
from stepline.events.replay.stalls import DecodingRows
from stepline.events.scan import ALL_KINDS, scan_run_events, to_builtins


def replay(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["replay", *argv])
    return code, capsys.readouterr().out


def prompt_beside_decoders(tmp_path: Path) -> Path:
    """Three chats decode in 50 ms steps; a 2,000-token prompt then takes two 400 ms steps
    (its chunks cut by the token budget, then the prompt's end) and a third request, queued
    behind it, sits those steps out for the budget. The target is 100 ms."""
    b = LogBuilder(timed=True, max_step_tokens=1024, max_step_ms=100.0)
    for rid in ("d1", "d2", "d3"):
        b.admit(rid, 4)
    b.do_step(prefill={"d1": (0, 4), "d2": (0, 4), "d3": (0, 4)}, predicted=0.05)
    decoders = ["d1", "d2", "d3"]
    for _ in range(10):
        b.do_step(decoders, predicted=0.05)
    b.admit("big", 2000)
    b.admit("queued", 10)
    b.plan(
        *((d, "decode", 1) for d in decoders),
        ("big", "prefill", 1021),
        seconds=0.4,
        predicted=0.1,
        limits=(None, None, None, "budget"),
        held={"queued": "budget"},
    )
    b.chunk("big", 0, 1021)
    b.tokens(*decoders)
    b.plan(
        *((d, "decode", 1) for d in decoders),
        ("big", "prefill", 979),
        ("queued", "prefill", 10),
        seconds=0.4,
        predicted=0.1,
        limits=(None, None, None, "prompt-end", "prompt-end"),
    )
    b.chunk("big", 1021, 2000)
    b.chunk("queued", 0, 10)
    b.tokens("big", "queued", *decoders)
    for _ in range(10):
        b.do_step([*decoders, "big", "queued"], predicted=0.05)
    for rid in (*decoders, "big", "queued"):
        b.end(rid, FinishReason.LENGTH)
    return b.write(tmp_path / "run.jsonl")


def test_the_summary_adds_stalls_up_per_request_that_caused_them(tmp_path: Path) -> None:
    s = summarize(prompt_beside_decoders(tmp_path))

    assert s.stall_threshold_s == pytest.approx(0.15)  # three times the 50 ms median wait
    (cause,) = s.stall_causes
    assert (cause.request_id, cause.num_stalls, cause.num_steps) == ("big", 6, 2)
    assert cause.seconds == pytest.approx(6 * 0.4)
    # one wait of three requests is one line, not three
    assert s.longest_stalls[0].num_requests == 3


def test_the_summary_reports_steps_over_the_target_and_the_prediction_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = prompt_beside_decoders(tmp_path)
    t = summarize(path).step_time

    assert t is not None and t.target_s == pytest.approx(0.1)
    assert (t.num_decode_steps, t.num_over, t.worst_s) == (22, 2, pytest.approx(0.4))
    assert t.over_prediction.max == pytest.approx(4.0)  # 400 ms against 100 predicted
    _, text = replay(str(path), capsys=capsys)
    assert "step time: 2 of 22 decode steps over the 100.0 ms target" in text
    assert "big: 6 stalls, 2.400 s in total, in 2 steps" in text
    assert "prompt chunks sized by: prompt-end 2, budget 1" in text
    assert "requests sat steps out for: budget 1" in text


def test_request_names_what_bound_its_chunks_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = prompt_beside_decoders(tmp_path)
    why = request_timeline(path, "big").why

    assert why is not None
    assert (why.num_chunks, why.num_prefill_tokens, why.limits) == (
        2,
        2000,
        {"budget": 1, "prompt-end": 1},
    )
    assert why.caused is not None and why.caused.num_stalls == 6
    _, text = replay(str(path), "--request", "big", capsys=capsys)
    assert (
        "prefill: 2 chunks x 400.0 ms mean step (2000 tokens in 800 ms), bound by the token "
        "budget 1, the prompt's end 1" in text
    )
    assert "its prompt stalled other requests' streams 6 times, 2.400 s in total over" in text


def test_request_names_the_prompt_that_stalled_it_and_why_it_waited(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = prompt_beside_decoders(tmp_path)

    _, text = replay(str(path), "--request", "d2", capsys=capsys)
    assert "stalled twice (waits over 150.0 ms), 800.0 ms in total: twice by big's prompt" in text
    _, text = replay(str(path), "--request", "queued", capsys=capsys)
    assert "it sat out steps for: budget 1" in text


def test_decoding_rows_count_pauses_extra_rows_and_ends_as_apply_does(tmp_path: Path) -> None:
    rows = DecodingRows()
    assert rows.feed(("a", "b"), 1.0, 1) == (["a", "b"], [], 0)
    assert rows.feed(("a", "b"), 2.0, 2) == ([], [], 2)
    assert rows.feed(("a",), 3.0, 3) == ([], [], 1)  # b pauses
    assert rows.feed(("a", "b", "b"), 5.0, 4) == ([], [("b", 3.0, 2)], 1)  # b: two tokens
    assert rows.feed(("a", "b", "b"), 6.0, 5) == ([], [], 2)
    assert (rows.num_tokens("a"), rows.num_tokens("b")) == (5, 6)
    ended = rows.end("a")
    assert ended is not None and (ended.num_tokens, ended.last_ts, ended.last_step) == (5, 6.0, 5)
    assert rows.feed(("b",), 7.0, 6) == ([], [], 1)
    assert rows.num_tokens("b") == 7

    b = LogBuilder()  # the same shapes in a log: the bulk reads agree with `apply`
    for rid in ("a", "b"):
        b.admit(rid, 2)
    b.do_step(prefill={"a": (0, 2), "b": (0, 2)})
    b.do_step(["a", "b"])
    b.do_step(["a"])
    b.plan(("a", "decode", 1), ("b", "decode", 2))
    b._add(TokensSampled, request_ids=("a", "b", "b"), token_ids=(1, 2, 3))
    b.end("a", FinishReason.STOP)
    assert check_log(b.write(tmp_path / "run.jsonl"))


def test_the_fast_reader_reads_what_the_validated_one_reads(tmp_path: Path) -> None:
    path = prompt_beside_decoders(tmp_path)
    validated = list(read_events(path))
    light = [event for _, event in scan_run_events(path)]

    assert len(light) == len(validated)
    for fast, slow in zip(light, validated, strict=True):
        seen = to_builtins(fast) if isinstance(fast, msgspec.Struct) else fast.model_dump()
        full = slow.model_dump(mode="json")
        assert {k: v for k, v in full.items() if k in seen} == {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in seen.items()
        }


def test_every_light_struct_has_every_field_of_its_event() -> None:
    events = {
        "step": StepPlanned,
        "decoding": TokensSampled,
        "step-finished": StepFinished,
        "admitted": Admitted,
        "chunk-prefilled": ChunkPrefilled,
        "checkpoint-reached": CheckpointReached,
        "terminal": Terminal,
    }
    assert {kind.__struct_config__.tag for kind in ALL_KINDS} == set(events)
    for kind in ALL_KINDS:
        tag = kind.__struct_config__.tag
        model = events.get(tag)
        if model is not None:  # made from its event: the same fields, of the same types
            assert set(kind.__struct_fields__) == set(model.model_fields) - {"type"}, tag
            for field in msgspec.structs.fields(kind):
                if field.type is not msgspec.Raw:  # (a raw part: JSON a bulk fold skips)
                    assert field.type == model.model_fields[field.name].annotation, (tag, field)


def test_a_light_row_that_does_not_line_up_is_still_a_corrupt_line(tmp_path: Path) -> None:
    path = prompt_beside_decoders(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if b'"type":"decoding"' in line)
    lines[i] = lines[i].replace(b'"token_ids":[7,7,7]', b'"token_ids":[7,7]')
    path.write_bytes(b"".join(lines))

    report = verify(path)
    assert report.counts == {"corrupt-log": 1}
    assert f"run.jsonl:{i + 1}" in report.violations[0].message
