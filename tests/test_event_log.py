"""The append-only event log: writer thread, rotation, torn lines, schema versions."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from stepline.events.log import (
    EventLogWriter,
    LogClosedError,
    LogCorruptError,
    TornLineWarning,
    UnsupportedSchemaError,
    read_events,
    read_header,
    register_upcaster,
    unregister_upcaster,
)
from stepline.events.models import (
    SCHEMA_VERSION,
    Admitted,
    CheckpointReached,
    ChunkPrefilled,
    FinishReason,
    LogHeader,
    RequestParams,
    StepPlanned,
    Terminal,
    TokensSampled,
)

# A made-up schema older than every real one (which stepline upcasts by itself).
OLD_VERSION = 0

PARAMS = RequestParams(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=7)


def header() -> LogHeader:
    return LogHeader(created=1_700_000_000.0, model="demo", config={"max_step_tokens": 64})


def one_request(rid: str = "r1", first_seq: int = 1) -> list:
    """A complete life of one request: every event kind once at least."""
    s = first_seq
    return [
        Admitted(
            seq=s,
            ts=1.0,
            step=0,
            request_id=rid,
            num_prompt_tokens=6,
            prompt_token_ids=(1, 2, 3, 4, 5, 6),
            prompt_sha256="ab" * 32,
            checkpoints=(4,),
            params=PARAMS,
        ),
        StepPlanned(
            seq=s + 1,
            ts=1.1,
            step=1,
            request_ids=(rid,),
            num_tokens=(4,),
            kinds=("prefill",),
            max_step_tokens=4,
            max_num_seqs=2,
        ),
        ChunkPrefilled(seq=s + 2, ts=1.2, step=1, request_id=rid, start=0, end=4),
        CheckpointReached(seq=s + 3, ts=1.2, step=1, request_id=rid, offset=4),
        ChunkPrefilled(seq=s + 4, ts=1.3, step=2, request_id=rid, start=4, end=6),
        TokensSampled(seq=s + 5, ts=1.3, step=2, request_ids=(rid,), token_ids=(42,)),
        Terminal(seq=s + 6, ts=1.4, step=3, request_id=rid, reason=FinishReason.ERROR, message="ü"),
    ]


def many_events(n: int) -> list:
    return [
        TokensSampled(seq=i, ts=float(i), step=i, request_ids=("r",), token_ids=(i,))
        for i in range(n)
    ]


def write_log(path: Path, events: list, **kwargs) -> None:
    with EventLogWriter(path, header(), **kwargs) as writer:
        for event in events:
            writer.append(event)


def test_every_event_kind_round_trips(tmp_path: Path) -> None:
    events = one_request()
    write_log(tmp_path / "run.jsonl", events)

    assert read_header(tmp_path / "run.jsonl") == header()
    assert list(read_events(tmp_path / "run.jsonl")) == events


def test_the_log_is_json_lines_with_the_header_first(tmp_path: Path) -> None:
    write_log(tmp_path / "run.jsonl", one_request())

    lines = (tmp_path / "run.jsonl").read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[0])["type"] == "header"
    assert json.loads(lines[0])["schema_version"] == SCHEMA_VERSION
    assert [json.loads(line)["seq"] for line in lines[1:]] == list(range(1, 8))


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    events = one_request()
    write_log(path, events)
    with open(path, "ab") as f:
        f.write(b'{"seq": 8, "ts": 1.5, "st')  # the crash came mid-write

    with pytest.warns(TornLineWarning, match=r"run\.jsonl:9: skipped a torn last line"):
        assert list(read_events(path)) == events


def test_a_torn_last_line_raises_in_strict_mode(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    write_log(path, one_request())
    with open(path, "ab") as f:
        f.write(b"\x00\x00\x00")

    with pytest.raises(LogCorruptError) as info:
        list(read_events(path, strict=True))
    assert info.value.line == 9


def test_a_corrupt_line_in_the_middle_raises_with_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    write_log(path, one_request())
    lines = path.read_bytes().splitlines(keepends=True)
    lines[3] = b'{"seq": 3, "type": "chunk-prefilled"}\n'  # valid JSON, not a valid event
    path.write_bytes(b"".join(lines))

    events = read_events(path)
    assert next(events).seq == 1
    assert next(events).seq == 2
    with pytest.raises(LogCorruptError, match=r"run\.jsonl:4: corrupt") as info:
        next(events)
    assert (info.value.path, info.value.line) == (path, 4)


def test_a_steps_tokens_whose_rows_do_not_line_up_are_a_corrupt_line(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    write_log(path, one_request())
    lines = path.read_bytes().splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if b'"type":"decoding"' in line)
    lines[i] = lines[i].replace(b'"token_ids":[42]', b'"token_ids":[42,43]')
    path.write_bytes(b"".join(lines))

    with pytest.raises(LogCorruptError, match=rf"run\.jsonl:{i + 1}: corrupt.*one token per"):
        list(read_events(path))


def test_a_log_from_a_newer_schema_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    future = {"type": "header", "schema_version": SCHEMA_VERSION + 1, "created": 1.0, "new": 1}
    path.write_text(json.dumps(future) + "\n", encoding="utf-8")

    with pytest.raises(UnsupportedSchemaError, match="upgrade stepline"):
        read_header(path)
    with pytest.raises(UnsupportedSchemaError, match=f"version {SCHEMA_VERSION + 1}"):
        list(read_events(path))


@pytest.fixture
def version_zero_upcaster():
    """A made-up schema 0 where decoding events called their tokens `tokens`."""

    def upcast(record: dict) -> dict:
        if record.get("type") == "decoding":
            record = dict(record)
            record["token_ids"] = record.pop("tokens")
        return record

    register_upcaster(OLD_VERSION, upcast)
    yield upcast
    unregister_upcaster(OLD_VERSION)


def test_an_older_schema_is_upcast_on_read(tmp_path: Path, version_zero_upcaster) -> None:
    path = tmp_path / "old.jsonl"
    old_header = {"type": "header", "schema_version": OLD_VERSION, "created": 1.0}
    old_event = {"type": "decoding", "seq": 1, "ts": 2.0, "step": 1, "request_id": "r"}
    old_event["tokens"] = [5, 6]
    path.write_text(f"{json.dumps(old_header)}\n{json.dumps(old_event)}\n", encoding="utf-8")

    assert read_header(path).schema_version == OLD_VERSION  # as written
    assert list(read_events(path)) == [
        TokensSampled(seq=1, ts=2.0, step=1, request_ids=("r", "r"), token_ids=(5, 6))
    ]


def test_an_older_schema_without_an_upcaster_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.jsonl"
    old_header = {"type": "header", "schema_version": OLD_VERSION, "created": 1.0}
    path.write_text(json.dumps(old_header) + "\n", encoding="utf-8")

    with pytest.raises(UnsupportedSchemaError, match="no upcaster"):
        read_header(path)


def test_an_upcaster_cannot_be_registered_twice(version_zero_upcaster) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_upcaster(OLD_VERSION, version_zero_upcaster)


def test_rotation_names_the_files_stably_and_reads_back_in_order(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    events = many_events(50)
    write_log(path, events, rotate_bytes=1000)

    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) > 3
    expected = ["run.jsonl"] + [f"run.{i}.jsonl" for i in range(1, len(files))]
    assert sorted(files) == sorted(expected)
    for name in files:
        assert read_header(tmp_path / name) == header()
        assert (tmp_path / name).stat().st_size < 1000 + 200  # at most one line over
    assert list(read_events(path)) == events


def test_a_torn_header_of_a_freshly_rotated_file_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    events = many_events(20)
    write_log(path, events, rotate_bytes=10_000_000)
    (tmp_path / "run.1.jsonl").write_bytes(b'{"type": "hea')

    with pytest.warns(TornLineWarning, match=r"run\.1\.jsonl:1"):
        assert list(read_events(path)) == events


def test_a_corrupt_last_line_of_an_earlier_rotated_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    write_log(path, many_events(50), rotate_bytes=1000)
    with open(path, "ab") as f:
        f.write(b"{")

    with pytest.raises(LogCorruptError, match=r"run\.jsonl:"):
        list(read_events(path))


def test_append_serialises_and_writes_on_the_writer_thread_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    serialising_threads = []
    original = TokensSampled.model_dump_json

    def slow_dump(self, **kwargs):
        serialising_threads.append(threading.current_thread())
        gate.wait(timeout=10)  # a slow disk, as far as the caller can tell
        return original(self, **kwargs)

    monkeypatch.setattr(TokensSampled, "model_dump_json", slow_dump)
    path = tmp_path / "run.jsonl"
    with EventLogWriter(path, header()) as writer:
        started = time.perf_counter()
        for event in many_events(10):
            writer.append(event)
        elapsed = time.perf_counter() - started

        assert elapsed < 5  # a writer that waited for the disk would take the gate's 10 s
        assert writer.lag == 10
        assert len(path.read_bytes().splitlines()) == 1  # only the header so far
        gate.set()
        writer.flush()
        assert writer.lag == 0
        assert len(path.read_bytes().splitlines()) == 11

    assert serialising_threads
    assert all(t is not threading.current_thread() for t in serialising_threads)
    assert {t.name for t in serialising_threads} == {"stepline-event-log"}


def test_flush_makes_everything_appended_so_far_readable(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    with EventLogWriter(path, header()) as writer:
        events = many_events(100)
        for event in events:
            writer.append(event)
        writer.flush()
        assert list(read_events(path)) == events


def test_a_write_error_is_recorded_and_logged_once_not_raised(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    writer = EventLogWriter(path, header(), rotate_bytes=1)
    (tmp_path / "run.1.jsonl").mkdir()  # the next file cannot be created: like a full disk
    with capture_logs() as logs:
        for event in many_events(5):
            writer.append(event)  # the engine keeps going
        writer.flush()
        writer.append(many_events(1)[0])
        writer.close()

    assert isinstance(writer.error, OSError)
    assert writer.lag == 0
    assert writer.num_dropped == 5  # the first event went into run.jsonl before rotating
    failures = [e for e in logs if e["event"] == "event_log_write_failed"]
    assert len(failures) == 1
    assert failures[0]["log_level"] == "error"


def test_an_existing_log_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    write_log(path, many_events(50), rotate_bytes=1000)

    with pytest.raises(FileExistsError, match="overwrite=True"):
        EventLogWriter(path, header())
    write_log(path, many_events(3), overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["run.jsonl"]  # stale rotated files gone
    assert len(list(read_events(path))) == 3


def test_close_is_idempotent_and_appending_after_it_raises(tmp_path: Path) -> None:
    writer = EventLogWriter(tmp_path / "run.jsonl", header())
    writer.close()
    writer.close()
    writer.flush()  # returns at once

    with pytest.raises(LogClosedError):
        writer.append(many_events(1)[0])


def test_appending_something_that_is_not_an_event_is_refused(tmp_path: Path) -> None:
    with EventLogWriter(tmp_path / "run.jsonl", header()) as writer:
        with pytest.raises(TypeError, match="not an event"):
            writer.append({"type": "decoding"})  # type: ignore[arg-type]


def test_reading_a_missing_log_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no event log"):
        list(read_events(tmp_path / "nope.jsonl"))


def test_a_hundred_thousand_events_write_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    events = many_events(100_000)

    started = time.perf_counter()
    with EventLogWriter(path, header()) as writer:
        for event in events:
            writer.append(event)
        append_s = time.perf_counter() - started
    write_s = time.perf_counter() - started
    started = time.perf_counter()
    num_read = sum(1 for _ in read_events(path))
    read_s = time.perf_counter() - started

    print(f"100k events: append {append_s:.2f}s, write {write_s:.2f}s, read {read_s:.2f}s")
    assert num_read == 100_000


def test_the_log_imports_without_mlx() -> None:
    code = (
        "import sys, stepline.events.log; assert not any(m.startswith('mlx') for m in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
