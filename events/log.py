"""The append-only event log: JSON lines, written off the hot path, read back streaming.

Format: the first line of every file is the `LogHeader`; every further line is one event
(`model_dump_json()`). A log may rotate by size into a *set* of files with stable names:

    run.jsonl, run.1.jsonl, run.2.jsonl, ...   (the index goes before the last suffix)

Every file of the set starts with the same header; `read_events("run.jsonl")` reads the whole
set in order. A crash mid-write leaves at most a torn last line, which the reader skips with a
`TornLineWarning`; damage anywhere else raises `LogCorruptError`.

Schema versions: a log written by an older schema is upcast on read, one version at a time, by
functions registered with `register_upcaster`; a newer one raises `UnsupportedSchemaError`.
"""

from __future__ import annotations

import json
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Any, get_args

import structlog
from pydantic import ValidationError

from stepline.events.models import EVENT_ADAPTER, SCHEMA_VERSION, Event, LogHeader

log = structlog.get_logger(__name__)

# The concrete event classes, for a cheap type check on the caller's thread.
_EVENT_TYPES: tuple[type, ...] = get_args(get_args(Event)[0])

# Items on the writer queue besides events.
_STOP = object()
_MAX_BATCH = 4096  # events serialised per wake-up of the writer thread


class LogCorruptError(Exception):
    """A line of the log is not a valid record (and is not a torn last line)."""

    def __init__(self, path: str | Path, line: int, reason: str) -> None:
        self.path = Path(path)
        self.line = line  # 1-based line number within `path`
        self.reason = reason
        super().__init__(
            f"{self.path}:{line}: corrupt event log line: {reason}. Everything before this "
            "line is readable; the log was damaged or written by something else."
        )


class UnsupportedSchemaError(Exception):
    """The log's schema version cannot be read by this version of stepline."""


class LogClosedError(RuntimeError):
    """An event was appended to a writer that is already closed."""


class TornLineWarning(UserWarning):
    """The last line of a log was incomplete (a crash mid-write) and was skipped."""


# ---------------------------------------------------------------------------------------------
# Upcasting: version n -> n + 1, on the raw dict of each record.

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
_UPCASTERS: dict[int, Upcaster] = {}


def register_upcaster(from_version: int, fn: Upcaster) -> Upcaster:
    """Register `fn` to turn a raw record of schema `from_version` into one of `from_version + 1`.

    `fn` receives every record of such a log as a plain dict, the header (``type == "header"``)
    included, and returns the upgraded dict (return the header unchanged if nothing about it
    changed). Raises ValueError if an upcaster for `from_version` is already registered.
    """
    if from_version >= SCHEMA_VERSION:
        raise ValueError(
            f"an upcaster from version {from_version} makes no sense: the current schema "
            f"version is {SCHEMA_VERSION}"
        )
    if from_version in _UPCASTERS:
        raise ValueError(f"an upcaster from schema version {from_version} is already registered")
    _UPCASTERS[from_version] = fn
    return fn


def unregister_upcaster(from_version: int) -> None:
    """Remove the upcaster from `from_version` (no-op if there is none)."""
    _UPCASTERS.pop(from_version, None)


def _upcast(raw: dict[str, Any], version: int) -> dict[str, Any]:
    for v in range(version, SCHEMA_VERSION):
        raw = _UPCASTERS[v](raw)
    return raw


def _check_readable(path: Path, version: object) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise LogCorruptError(path, 1, f"header has an invalid schema_version {version!r}")
    if version > SCHEMA_VERSION:
        raise UnsupportedSchemaError(
            f"{path} was written with event-log schema version {version}, but this stepline "
            f"reads versions up to {SCHEMA_VERSION}: upgrade stepline to read it"
        )
    missing = [v for v in range(version, SCHEMA_VERSION) if v not in _UPCASTERS]
    if missing:
        raise UnsupportedSchemaError(
            f"{path} was written with event-log schema version {version}, and no upcaster "
            f"from version {missing[0]} to {missing[0] + 1} is registered (register_upcaster)"
        )
    return version


# ---------------------------------------------------------------------------------------------
# File naming.


def rotated_path(path: str | Path, index: int) -> Path:
    """The name of file `index` of a rotated set (`index` 0 is `path` itself)."""
    path = Path(path)
    if index == 0:
        return path
    return path.with_name(f"{path.stem}.{index}{path.suffix}")


def log_files(path: str | Path) -> list[Path]:
    """The files of the log set that starts at `path`, in order (only those that exist)."""
    files = []
    index = 0
    while (candidate := rotated_path(path, index)).exists():
        files.append(candidate)
        index += 1
    return files


def _existing_set(path: Path) -> list[Path]:
    """Files of a set at `path`, also stale rotated ones whose first file is gone."""
    found = []
    index = 0
    while True:
        candidate = rotated_path(path, index)
        if candidate.exists():
            found.append(candidate)
        elif index > 0:
            return found
        index += 1


# ---------------------------------------------------------------------------------------------
# Writing.


class EventLogWriter:
    """Appends events to a JSON-lines log from a dedicated writer thread.

    `append` never does I/O or serialisation on the caller's thread (the asyncio step loop):
    it puts the event on a queue, and the writer thread serialises, writes and flushes.
    The header is written at construction, so a bad path fails there, not later.

    A write error on the thread (disk full) does not propagate: the writer records it in
    `error`, logs it once, and drops every later event (counted in `num_dropped`).

    Raises FileExistsError at construction if the log (or a rotated file of it) exists,
    unless `overwrite` is true, in which case the old set is removed first.
    """

    def __init__(
        self,
        path: str | Path,
        header: LogHeader,
        *,
        rotate_bytes: int | None = None,
        overwrite: bool = False,
    ) -> None:
        if rotate_bytes is not None and rotate_bytes <= 0:
            raise ValueError(f"rotate_bytes must be positive or None, got {rotate_bytes}")
        if header.schema_version != SCHEMA_VERSION:
            raise ValueError(
                f"the writer writes schema version {SCHEMA_VERSION}, "
                f"but the header says {header.schema_version}"
            )
        self.path = Path(path)
        self.header = header
        self.rotate_bytes = rotate_bytes
        existing = _existing_set(self.path)
        if existing and not overwrite:
            raise FileExistsError(
                f"event log {existing[0]} already exists: choose a new path, remove it, "
                "or pass overwrite=True"
            )
        for old in existing:
            old.unlink(missing_ok=True)

        self._header_line = header.model_dump_json().encode() + b"\n"
        self._file_index = 0
        self._file: IO[bytes] | None = None
        self._file_bytes = 0
        self._open_next_file()  # on the caller's thread: set-up errors reach the caller

        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _num_appended and _closed against close()
        self._num_appended = 0
        self._num_done = 0  # written or dropped; only the writer thread changes it
        self._num_dropped = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="stepline-event-log", daemon=True)
        self._thread.start()

    # -- caller side -------------------------------------------------------------------------

    def append(self, event: Event) -> None:
        """Queue `event` for writing; returns at once. Raises LogClosedError after close()."""
        if not isinstance(event, _EVENT_TYPES):
            raise TypeError(f"not an event: {type(event).__name__}")
        with self._lock:
            if self._closed:
                raise LogClosedError(f"event log {self.path} is closed; cannot append")
            self._num_appended += 1
            self._queue.put(event)

    @property
    def lag(self) -> int:
        """Events appended but not yet written (or dropped after an error)."""
        return self._num_appended - self._num_done

    @property
    def error(self) -> BaseException | None:
        """The write error that stopped the log, or None while it is healthy."""
        return self._error

    @property
    def num_dropped(self) -> int:
        """Events discarded because of `error`."""
        return self._num_dropped

    @property
    def files(self) -> list[Path]:
        """The files written so far, in order."""
        return [rotated_path(self.path, i) for i in range(self._file_index)]

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

    def _open_next_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        path = rotated_path(self.path, self._file_index)
        self._file = open(path, "xb", buffering=1 << 16)  # closed in _close_file
        self._file_index += 1
        self._file.write(self._header_line)
        self._file.flush()
        self._file_bytes = len(self._header_line)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < _MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if self._handle(batch):
                return

    def _handle(self, batch: list[Any]) -> bool:
        """Write a batch in order; returns True when the stop sentinel was met."""
        for item in batch:
            if item is _STOP:
                self._flush_file()
                self._close_file()
                return True
            if isinstance(item, threading.Event):
                self._flush_file()
                item.set()
                continue
            if self._error is None:
                try:
                    self._write(item)
                except Exception as exc:  # disk full, permissions, ...: never crash the engine
                    self._fail(exc)
            if self._error is not None:
                self._num_dropped += 1
            self._num_done += 1
        self._flush_file()  # so that a crash loses at most the batch in flight
        return False

    def _write(self, event: Event) -> None:
        line = event.model_dump_json().encode() + b"\n"
        if (
            self.rotate_bytes is not None
            and self._file_bytes >= self.rotate_bytes
            and self._file_bytes > len(self._header_line)
        ):
            self._open_next_file()
        assert self._file is not None
        self._file.write(line)
        self._file_bytes += len(line)

    def _flush_file(self) -> None:
        if self._error is None and self._file is not None:
            try:
                self._file.flush()
            except Exception as exc:
                self._fail(exc)

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except Exception as exc:
                if self._error is None:
                    self._fail(exc)
            self._file = None

    def _fail(self, exc: Exception) -> None:
        self._error = exc
        log.error(
            "event_log_write_failed",
            path=str(rotated_path(self.path, max(self._file_index - 1, 0))),
            error=repr(exc),
            note="later events are dropped; the engine keeps running",
        )


# ---------------------------------------------------------------------------------------------
# Reading.


def _parse_header_line(path: Path, line: bytes) -> tuple[LogHeader, int]:
    """The file's header (its schema_version as written) and that version."""
    try:
        raw = json.loads(line)
    except ValueError as exc:
        raise LogCorruptError(path, 1, f"the header is not JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("type") != "header":
        raise LogCorruptError(path, 1, "the first line is not a log header")
    version = _check_readable(path, raw.get("schema_version"))
    if version < SCHEMA_VERSION:
        raw = _upcast(raw, version)
        raw["schema_version"] = version
    try:
        return LogHeader.model_validate(raw), version
    except ValidationError as exc:
        raise LogCorruptError(path, 1, f"invalid header: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]


def read_header(path: str | Path) -> LogHeader:
    """The header of the log at `path` (its `schema_version` is the version it was written in).

    Raises FileNotFoundError, LogCorruptError, UnsupportedSchemaError.
    """
    path = Path(path)
    with open(path, "rb") as f:
        first = f.readline()
    if not first.strip():
        raise LogCorruptError(path, 1, "the file is empty (no header)")
    return _parse_header_line(path, first)[0]


def _parse_event(path: Path, line_no: int, line: bytes, version: int) -> Event:
    try:
        if version == SCHEMA_VERSION:
            return EVENT_ADAPTER.validate_json(line)
        raw = json.loads(line)
        if not isinstance(raw, dict):
            raise LogCorruptError(path, line_no, "not a JSON object")
        return EVENT_ADAPTER.validate_python(_upcast(raw, version))
    except ValidationError as exc:
        raise LogCorruptError(path, line_no, _first_error(exc)) from None
    except ValueError as exc:  # json.loads
        raise LogCorruptError(path, line_no, f"not JSON ({exc})") from None
    except (KeyError, TypeError) as exc:  # an upcaster meeting a record it did not expect
        raise LogCorruptError(
            path, line_no, f"could not upcast from version {version}: {exc!r}"
        ) from exc


def _torn(path: Path, line_no: int, line: bytes, strict: bool, exc: LogCorruptError) -> None:
    if strict:
        raise exc
    warnings.warn(
        f"{path}:{line_no}: skipped a torn last line ({len(line)} bytes; the writer "
        "probably stopped mid-write); everything before it was read",
        TornLineWarning,
        stacklevel=3,
    )


def read_events(path: str | Path, *, strict: bool = False) -> Iterator[Event]:
    """Yield every event of the log set that starts at `path`, in order, streaming.

    A torn or partial last line of the last file is skipped with a TornLineWarning (with
    `strict`, it raises LogCorruptError instead). Raises FileNotFoundError if `path` does not
    exist, LogCorruptError (with path and line number) for a bad line anywhere else, and
    UnsupportedSchemaError for a schema version this stepline cannot read.
    """
    path = Path(path)
    files = log_files(path)
    if not files:
        raise FileNotFoundError(f"no event log at {path}")
    for file_index, file_path in enumerate(files):
        is_last_file = file_index == len(files) - 1
        with open(file_path, "rb") as f:
            first = f.readline()
            if not first.strip():
                raise LogCorruptError(file_path, 1, "the file is empty (no header)")
            try:
                _, version = _parse_header_line(file_path, first)
            except LogCorruptError as exc:
                # A crash while writing the header of a freshly rotated file.
                if is_last_file and not f.readline():
                    _torn(file_path, 1, first, strict, exc)
                    return
                raise
            # One line of lookahead: only the very last line of the set may be torn.
            pending: bytes | None = None
            line_no = 1
            for line in f:
                if pending is not None:
                    yield _parse_event(file_path, line_no, pending, version)
                pending = line
                line_no += 1
            if pending is None:
                continue
            try:
                event = _parse_event(file_path, line_no, pending, version)
            except LogCorruptError as exc:
                if not is_last_file:
                    raise
                _torn(file_path, line_no, pending, strict, exc)
                return
            yield event
