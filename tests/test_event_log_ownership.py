"""Who may write an event log, and what happens when its file goes away under the writer:
one live writer per log (a second is refused, naming the first), a file deleted or rotated
away while serving is reported as degraded, a full disk at start serves on with the log off
and says so. Real files, real processes."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import textwrap

import httpx
import pytest
from helpers import serve_argv
from structlog.testing import capture_logs

from stepline.api import Engine
from stepline.api.http.app import create_app
from stepline.api.http.serve import serve_in_process
from stepline.api.pipeline.served import OneModel
from stepline.events.log import (
    EventLogWriter,
    LogInUseError,
    LogPathError,
    read_events,
    read_run_events,
    read_runs,
)
from stepline.events.models import LogHeader, TokensSampled, new_run_id, new_salt


def run_header() -> LogHeader:
    return LogHeader(created=1.0, model="demo", run_id=new_run_id(), salt=new_salt())


def decoding(seq: int, rid: str = "r") -> TokensSampled:
    return TokensSampled(seq=seq, ts=float(seq), step=seq, request_ids=(rid,), token_ids=(seq,))


HOLD_LOG = """
import sys, time
from stepline.events.log import EventLogWriter
from stepline.events.models import LogHeader, new_run_id, new_salt
header = LogHeader(created=1.0, model="demo", run_id=new_run_id(), salt=new_salt())
with EventLogWriter(sys.argv[1], header, append=True):
    print("holding", flush=True)
    sys.stdin.read()  # until the test closes it
"""


def test_a_second_writer_is_refused_naming_the_first_and_a_new_run_only_appends(tmp_path):
    path = tmp_path / "run.jsonl"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOG, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        with pytest.raises(LogInUseError, match=f"pid {holder.pid} on "):
            EventLogWriter(path, run_header(), append=True)
        with pytest.raises(LogInUseError):  # overwrite is no way round it
            EventLogWriter(path, run_header(), overwrite=True)
    finally:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    assert holder.returncode == 0
    with EventLogWriter(path, run_header(), append=True) as writer:  # the holder has gone
        writer.append(decoding(1))
    assert len(read_runs(path)) == 2  # appended, not replaced
    assert [e.seq for _, e in read_run_events(path, run=2)] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.jsonl"]  # no lock file left


def test_two_writers_in_one_process_are_refused_too(tmp_path):
    path = tmp_path / "run.jsonl"
    with EventLogWriter(path, run_header(), append=True) as first:
        with pytest.raises(LogInUseError, match=f"pid {os.getpid()}"):
            EventLogWriter(path, run_header(), append=True)
        first.append(decoding(1))
    assert [e.seq for e in read_events(path)] == [1]


def test_a_lock_file_left_on_a_read_only_folder_is_said_and_the_writer_closes(
    tmp_path, monkeypatch
):
    path = tmp_path / "run.jsonl"
    writer = EventLogWriter(path, run_header())
    writer.append(decoding(1))

    def read_only(self, missing_ok=False):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(type(path), "unlink", read_only)  # the folder was remounted read-only
    with capture_logs() as logs:
        writer.close()  # no error: the run is whole, only the lock file stays
    monkeypatch.undo()
    [left] = [e for e in logs if e["event"] == "event_log_lock_left"]
    assert left["path"].endswith("run.jsonl.lock") and "Read-only" in left["error"]
    assert [e.seq for e in read_events(path)] == [1]
    EventLogWriter(path, run_header(), append=True).close()  # the next writer takes it over


def test_serve_on_a_log_another_process_writes_exits_with_a_message_naming_it(demo, tmp_path):
    path = tmp_path / "run.jsonl"
    with EventLogWriter(path, run_header(), append=True):
        proc = subprocess.run(
            serve_argv("--event-log", str(path)),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"is being written by another process (pid {os.getpid()}" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("afile/run.jsonl", "afile is a file, not a folder"),
        ("afile/deeper/run.jsonl", "afile is a file, not a folder"),
        ("missing/run.jsonl", "does not exist: create it"),
        (".", "is a folder"),
    ],
)
def test_a_log_path_no_log_can_be_written_at_is_a_clear_error(tmp_path, where, says):
    (tmp_path / "afile").write_text("x")
    path = tmp_path / where
    with pytest.raises(LogPathError, match=says):
        EventLogWriter(path, run_header())
    assert not list(tmp_path.glob("*.lock"))


def test_serve_with_a_log_whose_folder_is_a_file_exits_2_without_a_traceback(tmp_path):
    (tmp_path / "afile").write_text("x")
    proc = subprocess.run(
        serve_argv("--event-log", str(tmp_path / "afile" / "run.jsonl")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "afile is a file, not a folder" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("how", ["deleted", "rotated"])
def test_a_log_file_deleted_or_rotated_away_while_written_degrades_the_log(tmp_path, how):
    path = tmp_path / "run.jsonl"
    with capture_logs() as logs, EventLogWriter(path, run_header()) as writer:
        writer.append(decoding(1))
        writer.flush()
        assert not writer.degraded
        if how == "deleted":
            path.unlink()
        else:
            path.rename(tmp_path / "run.jsonl.1")
            path.write_text("")  # what a rotator leaves: a new, empty file
        writer.append(decoding(2))
        writer.flush()
        assert writer.degraded
        assert str(path) in (writer.error_message or "")
        writer.append(decoding(3))
    assert writer.num_dropped == 1
    assert [e["event"] for e in logs].count("event_log_write_failed") == 1


@pytest.mark.asyncio
async def test_health_says_degraded_once_the_log_file_is_deleted_while_serving(demo, tmp_path):
    path = tmp_path / "run.jsonl"
    async with (
        Engine.open("stepline-demo", max_step_tokens=128, event_log=path) as engine,
        serve_in_process(create_app(OneModel(engine))) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        body = {"prompt": "hi", "max_tokens": 2}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        assert (await http.get("/health")).json()["status"] == "ok"
        path.unlink()
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        engine.step_loop.event_log.flush()
        health = await http.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "degraded"
    assert "was deleted" in health.json()["event_log"]


FULL_DISK_START = """
import resource, signal, sys
import anyio
from stepline.api import Engine, SamplingParams

path = sys.argv[1]
# The log's file may grow no more: every write to it fails as on a full disk (EFBIG here).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
import errno
import os
size = os.path.getsize(path)
resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))


async def main():
    async with Engine.open("stepline-demo", max_step_tokens=128, event_log=path) as engine:
        print("problem:", engine.event_log_problem, flush=True)
        outs = [o async for o in engine.generate([1, 2, 3], params=SamplingParams(max_tokens=2))]
        print("finished:", outs[-1].finish_reason, "healthy:", engine.healthy, flush=True)

anyio.run(main)
"""


def test_a_start_on_a_full_disk_serves_with_the_log_off_and_says_so(demo, tmp_path):
    path = tmp_path / "run.jsonl"
    with EventLogWriter(path, run_header(), append=True) as writer:  # an earlier run
        writer.append(decoding(1))
    before = path.read_bytes()
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FULL_DISK_START), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    problem = re.search(r"problem: (.*)", proc.stdout)
    assert problem and "could not be started" in problem.group(1)
    assert "this run is not recorded" in problem.group(1)
    assert "finished: length healthy: True" in proc.stdout
    assert "event_log_not_started" in proc.stdout + proc.stderr  # said loudly in the log
    assert path.read_bytes() == before  # the earlier run untouched
