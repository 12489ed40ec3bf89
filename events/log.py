"""The append-only event log: JSON lines, written off the hot path, read back streaming.

Format: the first line of every file is a `LogHeader`; every further line is one event
(`model_dump_json()`). A log may rotate by size into a *set* of files with stable names:

    run.jsonl, run.1.jsonl, run.2.jsonl, ...   (the index goes before the last suffix)

Runs: a restarted engine appends to the same log (`EventLogWriter(..., append=True)`): a new
header line, with a fresh run id, starts a new run in the last file, and rotation continues
from there; every file a run rotates into starts with that run's header. `read_run_events`
tells each event's run; sequence numbers are contiguous within a run.

A crash mid-write leaves at most a torn last line at the end of its run; the reader skips it
with a `TornLineWarning`; damage anywhere else raises `LogCorruptError`.

Schema versions: a log written by an older schema is upcast on read, one version at a time, by
functions registered with `register_upcaster`; a newer one raises `UnsupportedSchemaError`.

This module is the writer; the format lives in events/log_format.py and the reader in
events/log_reader.py (both re-exported here).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any, get_args

import structlog

from stepline.events.log_format import (
    LogClosedError,
    LogCorruptError,
    TornLineWarning,
    UnsupportedSchemaError,
    existing_set,
    log_files,
    parse_header_line,
    register_upcaster,
    rotated_path,
    unregister_upcaster,
)
from stepline.events.log_lock import LogInUseError, LogLock
from stepline.events.log_reader import (
    LogRun,
    read_events,
    read_header,
    read_models,
    read_run_events,
    read_runs,
)
from stepline.events.models import SCHEMA_VERSION, Admitted, Event, LogHeader, TokensSampled

__all__ = [
    "EventLogWriter",
    "LogClosedError",
    "LogInUseError",
    "LogCorruptError",
    "LogPathError",
    "LogRun",
    "TornLineWarning",
    "UnsupportedSchemaError",
    "check_log_path",
    "log_files",
    "read_events",
    "read_header",
    "read_models",
    "read_run_events",
    "read_runs",
    "register_upcaster",
    "rotated_path",
    "unregister_upcaster",
]

log = structlog.get_logger(__name__)

# The concrete event classes, for a cheap type check on the caller's thread.
_EVENT_TYPES: tuple[type, ...] = get_args(get_args(Event)[0])

# Items on the writer queue besides events.
_STOP = object()
_MAX_BATCH = 4096  # events serialised per wake-up of the writer thread
# After a write, the writer lets events gather this long before it looks again: a busy engine
# appends a few events every step (every few ms), and a wake-up of this thread cost more than
# the serialising it then did (~90 us of CPU a step, ~55 us of it waking, at batch 32 on a
# 2-core x86 box). An idle writer still sleeps until the next event, and a crash can lose at
# most this much more of the log than before.
_GATHER_S = 0.01


class LogPathError(ValueError):
    """No log can be written at the path given: it is a folder, or its folder is missing or
    is a file. The message says which and what to do."""


def check_log_path(path: str | Path) -> None:
    """Raise LogPathError for a path no log can be written at (its lock file's and its own
    open would fail with an OSError that names neither the log nor the fix)."""
    path = Path(path)
    if path.is_dir():
        raise LogPathError(f"event log {path} is a folder: give a file's path in it")
    folder = path.parent
    if folder.is_dir():
        return
    # The first ancestor there is: a file where a folder should be, or a missing folder.
    there = next((p for p in folder.parents if p.exists()), None)
    if folder.exists() or (there is not None and not there.is_dir()):
        blocker = folder if folder.exists() else there
        raise LogPathError(
            f"event log {path}: {blocker} is a file, not a folder: choose another path"
        )
    raise LogPathError(
        f"event log {path}: the folder {folder} does not exist: create it, or choose another path"
    )


class EventLogWriter:
    """Appends events to a JSON-lines log from a dedicated writer thread.

    `append` never does I/O or serialisation on the caller's thread (the asyncio step loop):
    it puts the event on a queue, and the writer thread serialises each batch and writes it
    with one unbuffered write. The header is written at construction, so a bad path fails
    there, not later.

    The header's promises are kept here: with `log_prompts` false an `Admitted` event is
    written without its prompt ids, with `log_outputs` false a `TokensSampled` event without
    its token ids (its rows still say which request sampled how many).

    One writer per log: the constructor takes an advisory lock (`log_lock`), held until
    close(), and raises LogInUseError naming the process that holds it.

    A write error on the thread (disk full, the file gone) never reaches the caller: the
    writer becomes *degraded* — `error` holds the exception, one structlog error says why,
    and every later event is dropped and counted in `num_dropped` (with those of the failed
    write that did not reach the file in full; a line cut short is the run's torn last
    line). It does not recover: the log ends at the error (resuming later would leave a gap
    in the run's sequence numbers), and a restart appends a new run. A file deleted or moved
    away (a log rotator) while written is such an error too, found after the next write. A
    header that cannot be written at construction (a full disk at start) makes the writer
    degraded from the start, recording nothing, rather than failing: the engine serves.

    An existing log (or a rotated file of it) raises FileExistsError at construction,
    unless `append` (a new run is added after the last one, in the last file, and rotation
    continues from there) or `overwrite` (the old set is removed first). Appending also
    raises UnsupportedSchemaError for a log written by a newer stepline, and
    FileExistsError for stray rotated files that do not continue the set.
    """

    def __init__(
        self,
        path: str | Path,
        header: LogHeader,
        *,
        rotate_bytes: int | None = None,
        overwrite: bool = False,
        append: bool = False,
    ) -> None:
        if rotate_bytes is not None and rotate_bytes <= 0:
            raise ValueError(f"rotate_bytes must be positive or None, got {rotate_bytes}")
        if header.schema_version != SCHEMA_VERSION:
            raise ValueError(
                f"the writer writes schema version {SCHEMA_VERSION}, "
                f"but the header says {header.schema_version}"
            )
        if overwrite and append:
            raise ValueError("overwrite and append exclude each other")
        self.path = Path(path)
        self.header = header
        self.rotate_bytes = rotate_bytes
        self._header_line = header.model_dump_json().encode() + b"\n"
        self._file: IO[bytes] | None = None
        self._file_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the open file
        self._file_bytes = 0
        self._error: BaseException | None = None
        self._started = True  # False: the header could not be written, nothing is recorded
        check_log_path(self.path)
        # Before looking at the files: a second live writer would interleave its run.
        self._log_lock = LogLock(self.path)
        try:
            self._open(overwrite=overwrite, append=append)
        except _CannotWrite as exc:  # a full disk at start: serve on, record nothing
            self._drop_file()
            self._started = False
            self._error = exc.error
            log.error(
                "event_log_not_started",
                path=str(self.path),
                error=repr(exc.error),
                note="this run is not recorded (events are dropped); free space and restart",
            )
        except BaseException:
            self._drop_file()
            self._log_lock.release()
            raise

        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _num_appended and _closed against close()
        self._num_appended = 0
        self._num_done = 0  # written or dropped; only the writer thread changes it
        self._num_dropped = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="stepline-event-log", daemon=True)
        self._thread.start()

    def _open(self, *, overwrite: bool, append: bool) -> None:
        existing = existing_set(self.path)
        if existing and not (overwrite or append):
            raise FileExistsError(
                f"event log {existing[0]} already exists: choose a new path, remove it, "
                "pass append=True to add a run to it, or overwrite=True"
            )
        if overwrite:
            for old in existing:
                old.unlink(missing_ok=True)
            existing = []
        if existing:
            self._open_to_append(existing)  # on the caller's thread: errors reach the caller
        else:
            self._file_index = 0
            self._first_index = 0
            self._open_next_file()

    # -- caller side -------------------------------------------------------------------------

    def append(self, event: Event) -> None:
        """Queue `event` for writing; returns at once. Raises LogClosedError after close()."""
        self.append_many([event])

    def append_many(self, events: list[Event]) -> None:
        """Queue `events` for writing, in order, as one item (one lock and one wake-up of
        the writer for a whole step's events); returns at once. Raises TypeError for
        anything that is not an event, LogClosedError after close()."""
        for event in events:
            if not isinstance(event, _EVENT_TYPES):
                raise TypeError(f"not an event: {type(event).__name__}")
        with self._lock:
            if self._closed:
                raise LogClosedError(f"event log {self.path} is closed; cannot append")
            self._num_appended += len(events)
            self._queue.put(list(events))

    @property
    def lag(self) -> int:
        """Events appended but not yet written (or dropped after an error)."""
        return self._num_appended - self._num_done

    @property
    def error(self) -> BaseException | None:
        """The write error that stopped the log, or None while it is healthy."""
        return self._error

    @property
    def degraded(self) -> bool:
        """True once a write failed: events are being dropped (see `error`)."""
        return self._error is not None

    @property
    def error_message(self) -> str | None:
        """Why the log is degraded, for /health and people; None while it is healthy."""
        if self._error is None:
            return None
        if not self._started:
            return (
                f"event log could not be started ({self._error!r}): this run is not recorded; "
                "free space and restart"
            )
        return f"event log write failed: {self._error!r}; later events are dropped"

    @property
    def num_dropped(self) -> int:
        """Events lost because of `error`: dropped after it, or lost in the failed write."""
        return self._num_dropped

    @property
    def salt(self) -> str | None:
        """The key of this run's prompt digests (`prompt_digest(writer.salt, ids)`)."""
        return self.header.salt

    @property
    def files(self) -> list[Path]:
        """The files this run has written to so far, in order."""
        return [rotated_path(self.path, i) for i in range(self._first_index, self._file_index)]

    def flush(self) -> None:
        """Block until every event appended so far is written and flushed to the OS.

        Does not raise on a write error (see `error`); returns at once after close().
        """
        done = threading.Event()
        with self._lock:
            if self._closed:
                return
            self._queue.put(done)
        done.wait()

    def close(self) -> None:
        """Flush, stop the writer thread and close the file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join()
        self._log_lock.release()

    def __enter__(self) -> EventLogWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- writer thread -----------------------------------------------------------------------

    def _open_to_append(self, existing: list[Path]) -> None:
        files = log_files(self.path)
        if files != existing:
            stray = sorted(set(existing) - set(files))
            raise FileExistsError(
                f"cannot append to event log {self.path}: {', '.join(map(str, stray))} "
                "do not continue its set of files; move them away"
            )
        with open(files[0], "rb") as f:
            first = f.readline()
        if first.strip():
            parse_header_line(files[0], first)  # a newer schema: refuse to mix it with ours
        last = files[-1]
        self._first_index = len(files) - 1
        self._file_index = len(files)
        data_end = _complete_bytes(last)
        if data_end == 0:
            # Nothing but a torn header (a crash just after rotating): start the file again.
            self._file_index -= 1
            self._open_next_file(mode="wb")
            return
        self._file = open(last, "ab", buffering=0)  # closed in _close_file
        size = last.stat().st_size
        # A torn last line (a kill mid-write) is closed off, not removed: it stays the last
        # line of the previous run, which the reader skips with a warning.
        prefix = b"\n" if size > data_end else b""
        self._file_id = _identity(os.fstat(self._file.fileno()))
        _write_header(self._file, prefix + self._header_line)
        self._file_bytes = size + len(prefix) + len(self._header_line)

    def _open_next_file(self, mode: str = "xb") -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        path = rotated_path(self.path, self._file_index)
        # Unbuffered: each batch is one write, so after an error the writer knows exactly
        # which events reached the file and which were lost.
        self._file = open(path, mode, buffering=0)  # closed in _close_file
        self._file_index += 1
        self._file_id = _identity(os.fstat(self._file.fileno()))
        _write_header(self._file, self._header_line)
        self._file_bytes = len(self._header_line)

    def _run(self) -> None:
        while True:
            batch = _items(self._queue.get())
            while len(batch) < _MAX_BATCH:
                try:
                    batch.extend(_items(self._queue.get_nowait()))
                except queue.Empty:
                    break
            if self._handle(batch):
                return
            time.sleep(_GATHER_S)

    def _handle(self, batch: list[Any]) -> bool:
        """Write a batch in order; returns True when the stop sentinel was met."""
        lines: list[bytes] = []  # serialised, not yet written to the current file
        pending = 0  # their bytes
        for item in batch:
            if item is _STOP:
                self._write_lines(lines)
                self._close_file()
                return True
            if isinstance(item, threading.Event):
                self._write_lines(lines)
                lines, pending = [], 0
                item.set()
                continue
            if self._error is None:
                try:
                    line = self._serialise(item)
                    if self._must_rotate(self._file_bytes + pending):
                        self._write_lines(lines)
                        lines, pending = [], 0
                        if self._error is None:
                            self._open_next_file()
                    lines.append(line)
                    pending += len(line)
                except Exception as exc:  # disk full, permissions, ...: never crash the engine
                    self._fail(exc.error if isinstance(exc, _CannotWrite) else exc, lost=len(lines))
                    lines, pending = [], 0
            if self._error is not None:
                self._num_dropped += 1
            self._num_done += 1
        self._write_lines(lines)  # so that a crash loses at most the batch in flight
        return False

    def _check_file_is_there(self) -> None:
        """Become degraded if the file just written is no longer the one at its path
        (deleted, or moved away by a log rotator): what follows would be lost with it. One
        stat per write (a batch), microseconds beside the write."""
        if self._error is not None or self._file_id is None:
            return
        current = rotated_path(self.path, self._file_index - 1)
        try:
            there = _identity(os.stat(current))
        except FileNotFoundError:
            there = None
        except OSError:
            return  # cannot tell (a stale network mount): writing goes on
        if there != self._file_id:
            what = "deleted" if there is None else "replaced by another file"
            self._fail(
                FileNotFoundError(
                    f"the event log file {current} was {what} while it was being written"
                ),
                lost=0,
            )

    def _serialise(self, event: Event) -> bytes:
        if not self.header.log_outputs and isinstance(event, TokensSampled) and event.token_ids:
            event = event.model_copy(update={"token_ids": None})
        elif not self.header.log_prompts and isinstance(event, Admitted):
            event = event.model_copy(update={"prompt_token_ids": None})
        # the run's one model, the base model (no adapter): not said on every line
        left_out = _NO_MODEL if event.model is None else frozenset()
        if isinstance(event, Admitted):
            if event.adapter is None:
                left_out = left_out | _NO_ADAPTER
            if event.origin == "client":
                left_out = left_out | _NO_ORIGIN
        if left_out:
            return event.model_dump_json(exclude=set(left_out)).encode() + b"\n"
        return event.model_dump_json().encode() + b"\n"

    def _must_rotate(self, size: int) -> bool:
        """Whether a file of `size` bytes is full (a file always takes one event at least)."""
        return (
            self.rotate_bytes is not None
            and size >= self.rotate_bytes
            and size > len(self._header_line)
        )

    def _write_lines(self, lines: list[bytes]) -> None:
        """Write `lines` to the current file in one go; on an error, count the lines that did
        not reach it in full as dropped (a partly written one is a torn last line)."""
        if not lines or self._error is not None:
            return
        assert self._file is not None
        data = b"".join(lines)
        written = 0
        try:
            written = _write_all(self._file, data)
        except _PartialWrite as partial:
            written = partial.written
            complete, total = 0, 0
            for line in lines:
                total += len(line)
                if total > written:
                    break
                complete += 1
            self._file_bytes += written
            self._fail(partial.error, lost=len(lines) - complete)
            return
        self._file_bytes += written
        self._check_file_is_there()

    def _drop_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except Exception as exc:
                if self._error is None:
                    self._fail(exc, lost=0)
            self._file = None

    def _fail(self, exc: BaseException, *, lost: int) -> None:
        """Become degraded: `lost` events already taken from the queue did not make it."""
        self._error = exc
        self._num_dropped += lost
        log.error(
            "event_log_write_failed",
            path=str(rotated_path(self.path, max(self._file_index - 1, 0))),
            error=repr(exc),
            note="the log is degraded: later events are dropped; the engine keeps running",
        )


_NO_MODEL = frozenset({"model"})
_NO_ADAPTER = frozenset({"adapter"})
_NO_ORIGIN = frozenset({"origin"})


def _items(item: Any) -> list[Any]:
    """A queued item as a list: events come as lists (`append_many`), the writer's own
    markers (flush, stop) one each."""
    return item if type(item) is list else [item]


class _CannotWrite(Exception):
    """A log file opened, but its header could not be written (a full disk)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        super().__init__(repr(error))


def _write_header(file: Any, data: bytes) -> None:
    try:
        _write_all(file, data)
    except _PartialWrite as partial:
        raise _CannotWrite(partial.error) from None


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class _PartialWrite(Exception):
    def __init__(self, written: int, error: BaseException) -> None:
        self.written, self.error = written, error
        super().__init__(f"wrote {written} bytes, then {error!r}")


def _write_all(file: Any, data: bytes) -> int:
    """Write all of `data` to an unbuffered file; raises _PartialWrite on an error."""
    written = 0
    view = memoryview(data)
    try:
        while written < len(data):
            n = file.write(view[written:])
            if not n:
                raise OSError(f"the file took no bytes ({n!r})")
            written += n
    except OSError as exc:
        raise _PartialWrite(written, exc) from exc
    return written


def _complete_bytes(path: Path) -> int:
    """The length of `path` up to and including its last newline (0 if it has none)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        pos = size
        while pos > 0:
            start = max(0, pos - 65536)
            f.seek(start)
            chunk = f.read(pos - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                return start + newline + 1
            pos = start
    return 0
