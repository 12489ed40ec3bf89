"""The event log across restarts (runs appended to one log), its privacy switches, and a
writer that fails visibly: real files throughout."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from stepline.events.fold import fold
from stepline.events.log import (
    EventLogWriter,
    TornLineWarning,
    UnsupportedSchemaError,
    log_files,
    read_events,
    read_run_events,
    read_runs,
)
from stepline.events.models import (
    SCHEMA_VERSION,
    Admitted,
    ChunkPrefilled,
    FinishReason,
    LogHeader,
    RequestParams,
    StepFinished,
    Terminal,
    TokensSampled,
    new_run_id,
    new_salt,
    prompt_digest,
)

PARAMS = RequestParams(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=7)


def run_header(**kw) -> LogHeader:
    return LogHeader(created=1.0, model="demo", run_id=new_run_id(), salt=new_salt(), **kw)


def admitted(seq: int, rid: str, ids=(1, 2, 3), salt: str | None = None) -> Admitted:
    return Admitted(
        seq=seq,
        ts=float(seq),
        step=0,
        request_id=rid,
        num_prompt_tokens=len(ids),
        prompt_token_ids=tuple(ids),
        prompt_sha256=prompt_digest(salt, ids),
        params=PARAMS,
    )


def decoding(seq: int, rid: str, token: int) -> TokensSampled:
    return TokensSampled(seq=seq, ts=float(seq), step=seq, request_ids=(rid,), token_ids=(token,))


def write_run(path: Path, header: LogHeader, events: list, **kw) -> EventLogWriter:
    with EventLogWriter(path, header, append=True, **kw) as writer:
        for e in events:
            writer.append(e)
    return writer


# -- runs ---------------------------------------------------------------------------------------


def test_appending_to_an_existing_log_starts_a_new_run_with_its_own_header(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    first, second = run_header(), run_header()
    write_run(path, first, [admitted(1, "a"), decoding(2, "a", 5)])
    write_run(path, second, [admitted(1, "a"), decoding(2, "a", 6)])  # the same ids again

    runs = read_runs(path)
    assert [(r.index, r.header) for r in runs] == [(1, first), (2, second)]
    assert runs[0].header.run_id != runs[1].header.run_id
    tagged = [(run.index, e.seq, e.type) for run, e in read_run_events(path)]
    assert tagged == [
        (1, 1, "admitted"),
        (1, 2, "decoding"),
        (2, 1, "admitted"),
        (2, 2, "decoding"),
    ]
    assert [e.token_ids for e in read_events(path, run=2) if isinstance(e, TokensSampled)] == [(6,)]
    assert [f.name for f in tmp_path.iterdir()] == ["run.jsonl"]  # one file, two headers


def test_a_torn_line_left_by_a_kill_ends_its_run_and_the_next_run_reads_on(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    write_run(path, run_header(), [admitted(1, "a")])
    with open(path, "ab") as f:
        f.write(b'{"seq":2,"ts":2.0,"st')  # killed mid-write
    write_run(path, run_header(), [admitted(1, "b")])

    with pytest.warns(TornLineWarning, match=r"run\.jsonl:3: skipped a torn last line"):
        events = [(run.index, e.request_id) for run, e in read_run_events(path)]
    assert events == [(1, "a"), (2, "b")]
    raw = path.read_bytes()
    assert b'{"seq":2,"ts":2.0,"st\n' in raw  # closed off, not erased


def test_rotated_files_are_kept_and_the_next_run_continues_the_set(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    first = write_run(
        path, run_header(), [decoding(i, "r", i) for i in range(1, 40)], rotate_bytes=800
    )
    n_first = len(log_files(path))
    assert n_first > 2
    second = write_run(
        path, run_header(), [decoding(i, "r", i) for i in range(1, 40)], rotate_bytes=800
    )

    assert second.files[0] == first.files[-1]  # the new run starts in the last file
    assert len(log_files(path)) > n_first
    per_run = [run.index for run, _ in read_run_events(path)]
    assert per_run == [1] * 39 + [2] * 39
    assert [r.index for r in read_runs(path)] == [1, 2]


def test_a_freshly_rotated_file_with_only_a_torn_header_is_started_again(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    write_run(path, run_header(), [decoding(1, "r", 1)])
    (tmp_path / "run.1.jsonl").write_bytes(b'{"type": "hea')  # killed while rotating
    write_run(path, run_header(), [decoding(1, "r", 2)])

    assert [(run.index, e.token_ids) for run, e in read_run_events(path)] == [(1, (1,)), (2, (2,))]


def test_appending_to_a_log_from_a_newer_stepline_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    newer = {"type": "header", "schema_version": SCHEMA_VERSION + 1, "created": 1.0}
    path.write_text(json.dumps(newer) + "\n", encoding="utf-8")

    with pytest.raises(UnsupportedSchemaError, match="upgrade stepline"):
        EventLogWriter(path, run_header(), append=True)


def test_a_version_1_log_reads_and_a_run_of_this_version_appends_to_it(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    old_header = {"type": "header", "schema_version": 1, "created": 1.0, "log_prompts": True}
    old_event = {
        "seq": 1,
        "ts": 1.0,
        "step": 1,
        "type": "decoding",
        "request_id": "r",
        "token_ids": [4, 5],
    }
    path.write_text(f"{json.dumps(old_header)}\n{json.dumps(old_event)}\n", encoding="utf-8")
    write_run(path, run_header(), [decoding(1, "r", 9)])

    events = list(read_run_events(path))
    assert [(run.header.schema_version, e.type, e.request_ids) for run, e in events] == [
        (1, "decoding", ("r", "r")),  # one request's decoding event, upcast to a step's
        (SCHEMA_VERSION, "decoding", ("r",)),
    ]
    assert events[0][0].header.salt is None  # schema 1: digests unsalted


def test_the_default_writer_still_refuses_an_existing_log(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    write_run(path, run_header(), [])
    with pytest.raises(FileExistsError, match="append=True"):
        EventLogWriter(path, run_header())
    with pytest.raises(ValueError, match="exclude each other"):
        EventLogWriter(path, run_header(), append=True, overwrite=True)


# -- privacy ------------------------------------------------------------------------------------


def test_prompt_digests_are_salted_per_log(tmp_path: Path) -> None:
    ids = (11, 12, 13)
    a, b = new_salt(), new_salt()

    assert a != b
    assert prompt_digest(a, ids) != prompt_digest(b, ids)  # equal prompts do not match across logs
    assert prompt_digest(a, ids) == prompt_digest(a, ids)
    unsalted = hashlib.sha256(b"11,12,13").hexdigest()
    assert prompt_digest(None, ids) == unsalted  # what schema 1 logged
    assert unsalted not in {prompt_digest(a, ids), prompt_digest(b, ids)}


def test_without_log_outputs_a_steps_tokens_say_whose_they_were_not_which(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    header = run_header(log_prompts=False, log_outputs=False)
    events = [
        admitted(1, "a", salt=header.salt),
        ChunkPrefilled(seq=2, ts=2.0, step=1, request_id="a", start=0, end=3),
        TokensSampled(seq=3, ts=2.0, step=1, request_ids=("a", "a"), token_ids=(901, 902)),
        Terminal(seq=4, ts=3.0, step=1, request_id="a", reason=FinishReason.CANCELLED),
    ]
    write_run(path, header, events)

    text = path.read_text(encoding="utf-8")
    # Not as a number anywhere (a salted digest's hex may hold the digits: it did, 1 in ~30)
    assert re.search(r"\b90[12]\b", text) is None
    assert '"prompt_token_ids":null' in text and "[1,2,3]" not in text
    written = list(read_events(path))
    assert written[2].token_ids is None and written[2].request_ids == ("a", "a")
    assert fold(written)["a"].num_output_tokens == 2  # the fold needs only the count
    live = fold(events)["a"].evolve(prompt_token_ids=None)
    assert fold(written) == {"a": live}  # the live state, less what the log leaves out


# -- write failures -----------------------------------------------------------------------------


class _FullDisk:
    """A file whose writes fail as a full disk's do: a short write of what still fits, then
    ENOSPC. (A test cannot fill a real disk.)"""

    def __init__(self, real, budget: int) -> None:
        self.real, self.budget = real, budget

    def write(self, data) -> int:
        if self.budget == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = self.real.write(data[: self.budget])
        self.budget -= n
        return n

    def close(self) -> None:
        self.real.close()


def test_a_full_disk_degrades_the_log_counts_every_lost_event_and_never_raises(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.jsonl"
    writer = EventLogWriter(path, run_header())
    # 290 bytes end inside a line: the disk cuts it short
    writer._file = _FullDisk(writer._file, budget=290)  # type: ignore[assignment]
    events = [decoding(i, "r", i) for i in range(1, 21)]
    with capture_logs() as logs:
        for e in events:
            writer.append(e)  # the engine goes on
        writer.flush()
        assert writer.degraded and "No space left" in (writer.error_message or "")
        writer.append(decoding(21, "r", 21))
        writer.close()

    with pytest.warns(TornLineWarning):  # the line the disk cut short ends the run
        written = list(read_events(path))
    assert writer.num_dropped == 21 - len(written)  # nothing lost goes uncounted
    assert 0 < len(written) < 21
    failures = [e for e in logs if e["event"] == "event_log_write_failed"]
    assert len(failures) == 1 and "No space left" in failures[0]["error"]


def test_a_log_file_that_disappears_with_its_directory_degrades_the_log(tmp_path: Path) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    writer = EventLogWriter(folder / "run.jsonl", run_header(), rotate_bytes=200)
    writer.append(decoding(1, "r", 1))
    writer.flush()
    shutil.rmtree(folder)  # the next rotation has nowhere to go
    for i in range(2, 12):
        writer.append(decoding(i, "r", i))
    writer.close()

    assert writer.degraded and isinstance(writer.error, OSError)
    assert writer.num_dropped >= 1
    assert writer.lag == 0


def test_a_healthy_log_is_not_degraded(tmp_path: Path) -> None:
    writer = write_run(tmp_path / "run.jsonl", run_header(), [decoding(1, "r", 1)])
    assert (writer.degraded, writer.error, writer.error_message, writer.num_dropped) == (
        False,
        None,
        None,
        0,
    )


def test_importing_the_log_fold_and_models_loads_no_mlx_and_no_openblas() -> None:
    code = (
        "import sys, stepline.events.log, stepline.events.fold, stepline.events.models, "
        "stepline.events.replay\n"
        "bad = [m for m in sys.modules if m.startswith('mlx') or 'blas' in m.lower()]\n"
        "maps = open('/proc/self/maps').read().lower()\n"
        "assert not bad, bad\n"
        "assert 'openblas' not in maps, 'openblas loaded'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_an_empty_last_file_left_by_a_kill_while_rotating_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    write_run(path, run_header(), [decoding(1, "r", 1)])
    (tmp_path / "run.1.jsonl").write_bytes(b"")  # created, killed before its header

    with pytest.warns(TornLineWarning, match=r"run\.1\.jsonl:1"):
        assert [e.seq for e in read_events(path)] == [1]
    assert len(read_runs(path)) == 1
    write_run(path, run_header(), [decoding(1, "r", 2)])  # and a restart writes it afresh
    assert [run.index for run, _ in read_run_events(path)] == [1, 2]


async def test_an_engine_logging_no_outputs_writes_counts_salted_digests_and_step_times(
    tmp_path: Path, model_cache_dir
) -> None:
    from stepline.api import Engine, SamplingParams

    path = tmp_path / "run.jsonl"
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    async with Engine.open(
        "stepline-demo", event_log=path, log_prompts=False, log_outputs=False
    ) as engine:
        stream = await engine.submit(list(range(5, 25)), params=params, request_id="q")
        tokens = [t async for out in stream for t in out.token_ids]
        live = engine.step_loop.state_of("q")

    (run,) = read_runs(path)
    assert (run.header.log_prompts, run.header.log_outputs) == (False, False)
    events = list(read_events(path))
    sampled = [e for e in events if isinstance(e, TokensSampled)]
    assert sampled and all(e.token_ids is None for e in sampled)  # not one output id written
    # The log's fold is the live state, less the prompt ids the header says it leaves out.
    assert fold(events)["q"] == live.evolve(prompt_token_ids=None)
    assert live.num_output_tokens == len(tokens) == 6
    (adm,) = [e for e in events if isinstance(e, Admitted)]
    assert adm.prompt_sha256 == prompt_digest(run.header.salt, range(5, 25))
    assert adm.prompt_sha256 != prompt_digest(None, range(5, 25))
    steps = [e for e in events if isinstance(e, StepFinished)]
    assert steps and all(s.seconds > 0 for s in steps)  # every step's executor time


def test_a_version_2_log_reads_as_steps_of_rows_and_folds_and_verifies_as_written(
    tmp_path: Path,
) -> None:
    """Schema 2 logged a step's members as `entries` and each request's tokens as its own
    `decoding` event; read today, they are a plan's rows and a step's tokens, and the
    requests' states and the checks come out as they did."""
    from stepline.events.replay.verify import verify

    path = tmp_path / "v2.jsonl"
    params = {"max_tokens": 2, "temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0, "seed": None}
    at = {"ts": 1.0, "step": 1}
    lines = [
        {"type": "header", "schema_version": 2, "created": 1.0},
        *(
            {"seq": i + 1, **at, "type": "admitted", "request_id": rid, "num_prompt_tokens": 2,
             "prompt_token_ids": [3, 4], "prompt_sha256": "x", "params": params}
            for i, rid in enumerate("ab")
        ),
        {"seq": 3, **at, "type": "step", "request_id": None, "max_step_tokens": 8,
         "max_num_seqs": 4, "entries": [{"request_id": r, "num_tokens": 2, "kind": "prefill"}
                                        for r in "ab"]},
        *({"seq": 4 + i, **at, "type": "chunk-prefilled", "request_id": r, "start": 0, "end": 2}
          for i, r in enumerate("ab")),
        {"seq": 6, **at, "type": "decoding", "request_id": "a", "token_ids": [7]},
        {"seq": 7, **at, "type": "decoding", "request_id": "b", "token_ids": None,
         "token_count": 1},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")

    events = list(read_events(path))
    step = events[2]
    assert (step.request_ids, step.num_tokens, step.kinds) == (("a", "b"), (2, 2), ("prefill",) * 2)
    assert [(e.request_ids, e.token_ids) for e in events[5:]] == [(("a",), (7,)), (("b",), None)]
    states = fold(events)
    assert [states[r].num_output_tokens for r in "ab"] == [1, 1]
    report = verify(path)
    assert report.ok and [(r.request_id, r.status) for r in report.in_flight] == [
        ("a", "decoding"),
        ("b", "decoding"),
    ]


def test_a_version_6_logs_tokens_events_read_as_decoding_events(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    old_header = {"type": "header", "schema_version": 6, "created": 1.0}
    old_event = {"seq": 1, "ts": 1.0, "step": 1, "type": "tokens", "request_ids": ["r", "q"]}
    old_event["token_ids"] = [4, 5]
    path.write_text(f"{json.dumps(old_header)}\n{json.dumps(old_event)}\n", encoding="utf-8")

    [(run, event)] = read_run_events(path)
    assert (run.header.schema_version, event.type) == (6, "decoding")
    assert isinstance(event, TokensSampled) and event.request_ids == ("r", "q")
