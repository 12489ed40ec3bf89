"""Reading an event log back: streaming, run by run, tolerant of a crash's torn line.

A log set (run.jsonl, run.1.jsonl, ...) holds one or more runs. A run starts at a header line:
the first line of the log, a header in the middle of a file (a restart appended a run), or
the first line of a rotated file whose header differs from the run before. A rotated file
that starts with the same header continues its run.

Only the last line of a run may be torn (the engine was killed mid-write): the last line of
the log, or the line just before the next run's header. It is skipped with a
`TornLineWarning`; anything else unreadable raises `LogCorruptError`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from operator import itemgetter
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel, ConfigDict, ValidationError

from stepline.events.log_format import (
    HEADER_PREFIXES,
    LogCorruptError,
    TornLineWarning,
    first_error,
    log_files,
    needs_upcast,
    parse_header_line,
    upcast,
)
from stepline.events.models import EVENT_ADAPTER, SCHEMA_VERSION, Event, LogHeader


class LogRun(BaseModel):
    """One run of the engine in a log: from its header to the next run's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int  # 1-based position among the log's runs
    header: LogHeader
    file: str  # the file its header is in
    line: int  # the header's line in that file

    @property
    def name(self) -> str:
        """'run 2 (3f9a0c1d2e4b)' for people."""
        return f"run {self.index}" + (f" ({self.header.run_id})" if self.header.run_id else "")


_Line = tuple[Path, int, bytes]  # file, 1-based line number, the line


def _header_lines(files: list[Path]) -> Iterator[tuple[_Line, _Line | None]]:
    """Each header line of the files (a file's first line, or a line that starts as a header
    does), with the line after it, found by searching each file's bytes a block at a time
    rather than reading it line by line."""
    for i, path in enumerate(files):
        with open(path, "rb") as f:
            starts = _header_starts(f)
            line_no, counted = 1, 0
            for start in starts:
                f.seek(counted)
                line_no += _count_newlines(f, start - counted)
                f.seek(start)
                line = f.readline()
                counted = start
                nxt = f.readline()
                if nxt:
                    following: _Line | None = (path, line_no + 1, nxt)
                else:
                    following = _first_line(files[i + 1 :])
                yield (path, line_no, line), following


_BLOCK = 1 << 24  # bytes searched at a time for header lines


def _header_starts(f: BinaryIO) -> list[int]:
    """Where the file's header lines start: 0, and after each newline a header follows."""
    starts = [0]
    needles = [b"\n" + prefix for prefix in HEADER_PREFIXES]
    overlap = max(map(len, needles)) - 1
    offset, tail = 0, b""
    while block := f.read(_BLOCK):
        data = tail + block
        base = offset - len(tail)
        for needle in needles:
            at = data.find(needle)
            while at >= 0:
                starts.append(base + at + 1)
                at = data.find(needle, at + 1)
        offset += len(block)
        tail = data[-overlap:]
    return sorted(set(starts))


def _count_newlines(f: BinaryIO, size: int) -> int:
    n = 0
    while size > 0 and (block := f.read(min(size, _BLOCK))):
        n += block.count(b"\n")
        size -= len(block)
    return n


def _first_line(files: list[Path]) -> _Line | None:
    for path in files:
        with open(path, "rb") as f:
            return path, 1, f.readline()
    return None


def _is_header_line(line_no: int, line: bytes) -> bool:
    return line_no == 1 or line.startswith(HEADER_PREFIXES)


def _parse_event(path: Path, line_no: int, line: bytes, version: int, upcast_it: bool) -> Event:
    try:
        if not upcast_it:
            return EVENT_ADAPTER.validate_json(line)
        raw = json.loads(line)
        if not isinstance(raw, dict):
            raise LogCorruptError(path, line_no, "not a JSON object")
        return EVENT_ADAPTER.validate_python(upcast(raw, version))
    except ValidationError as exc:
        raise LogCorruptError(path, line_no, first_error(exc)) from None
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
        stacklevel=4,
    )


def _starts_new_run(following: _Line | None, current: LogHeader | None) -> bool:
    """Whether the line after a bad one ends the run the bad line was in."""
    if following is None:
        return True  # the end of the log
    path, line_no, line = following
    if not _is_header_line(line_no, line):
        return False
    if line_no > 1:
        return True  # a header in the middle of a file: a restart appended a run
    try:
        header, _ = parse_header_line(path, line, line_no)
    except LogCorruptError:
        return False
    return header != current  # a rotated file of the same run, or the next run


def read_run_events(
    path: str | Path,
    *,
    strict: bool = False,
    run: int | None = None,
    model: str | None = None,
) -> Iterator[tuple[LogRun, Event]]:
    """Yield (its run, event) for every event of the log set at `path`, in order, streaming.

    With `run`, only the events of that run (its 1-based index). With `model`, only the
    events of that model (an event that names none belongs to its run's one model:
    `LogHeader.model_of`); in a log several models share, each model's events read as a run
    of one model. A torn last line of a run is skipped with a TornLineWarning (with `strict`,
    it raises LogCorruptError instead). Raises FileNotFoundError if `path` does not exist,
    LogCorruptError (with path and line number) for a bad line anywhere else,
    UnsupportedSchemaError for a schema version this stepline cannot read.
    """
    return run_events(path, strict=strict, run=run, model=model)


def run_events(
    path: str | Path,
    *,
    strict: bool = False,
    run: int | None = None,
    model: str | None = None,
    decode: Callable[[bytes], Any] | None = None,
    errors: tuple[type[Exception], ...] = (),
) -> Iterator[tuple[LogRun, Any]]:
    """`read_run_events`, with `decode` turning a good line of the current schema into its
    event (by default the validated `Event`; events/scan.py's light structs for bulk reads).
    A line `decode` refuses (pydantic's ValidationError, or one of `errors`) is validated,
    which says what is wrong with it (or reads an event `decode` does not know). Lines of an
    older schema are always validated (their upcasters work on dicts)."""
    events = _run_events(Path(path), strict, run, decode or EVENT_ADAPTER.validate_json, errors)
    if model is None:
        yield from events
        return
    for item in events:
        log_run, event = item
        if log_run.header.model_of(event) == model:
            yield item


def _run_events(
    path: Path,
    strict: bool,
    run: int | None,
    validate: Callable[[bytes], Any],
    errors: tuple[type[Exception], ...],
) -> Iterator[tuple[LogRun, Any]]:
    refused: tuple[type[Exception], ...] = (ValidationError, *errors)
    files = log_files(path)
    if not files:
        raise FileNotFoundError(f"no event log at {path}")
    current: LogRun | None = None
    version, upcast_it = SCHEMA_VERSION, False
    blocks = _blocks(files)
    block = next(blocks, None)
    while block is not None:  # a block of lines ahead: is a bad line the last of its run?
        ahead = next(blocks, None)
        file_path, first_no, lines = block
        block = ahead
        for i, line in enumerate(lines):
            # The usual line, quickly: an event of the current run, in the current schema.
            if (
                line.startswith(_EVENT_PREFIX)
                and not upcast_it
                and current is not None
                and (run is None or current.index == run)
            ):
                try:
                    event = validate(line)
                except refused:
                    pass  # the way below says what is wrong, and where
                else:
                    yield current, event
                    continue
            line_no = first_no + i
            if i + 1 < len(lines):
                following: _Line | None = (file_path, line_no + 1, lines[i + 1])
            else:
                following = (ahead[0], ahead[1], ahead[2][0]) if ahead is not None else None
            if line_no == 1 or line.startswith(HEADER_PREFIXES):
                header_now = current.header if current is not None else None
                try:
                    if not line.strip():
                        raise LogCorruptError(file_path, line_no, "the file is empty (no header)")
                    header, version = parse_header_line(file_path, line, line_no)
                    upcast_it = needs_upcast(version)
                except LogCorruptError as exc:
                    if not _starts_new_run(following, header_now):
                        raise
                    _torn(file_path, line_no, line, strict, exc)  # a crash mid-header
                    continue
                if line_no == 1 and header == header_now:
                    continue  # the next file of a rotated run
                index = current.index + 1 if current is not None else 1
                if run is not None and index > run:
                    return
                current = LogRun(index=index, header=header, file=str(file_path), line=line_no)
                continue
            assert current is not None  # line 1 of every file is a header
            if run is not None and current.index != run:
                continue
            try:
                if upcast_it:
                    event = _parse_event(file_path, line_no, line, version, upcast_it)
                else:
                    try:
                        event = validate(line)
                    except refused:  # say what is wrong, with the line's place
                        event = _parse_event(file_path, line_no, line, version, upcast_it)
            except LogCorruptError as exc:
                if not _starts_new_run(following, current.header):
                    raise
                _torn(file_path, line_no, line, strict, exc)
                continue
            yield current, event


# How the writer starts an event's line (`seq` first; a header starts with `type`)
_EVENT_PREFIX = b'{"seq":'
_LINES_AHEAD = 1 << 20  # bytes of lines read at a time


def _blocks(files: list[Path]) -> Iterator[tuple[Path, int, list[bytes]]]:
    """The files' lines a block at a time: (file, the first line's number, lines); an empty
    file is one empty line."""
    for path in files:
        with open(path, "rb") as f:
            line_no = 1
            while lines := f.readlines(_LINES_AHEAD):
                yield path, line_no, lines
                line_no += len(lines)
            if line_no == 1:
                yield path, 1, [b""]


def read_events(
    path: str | Path,
    *,
    strict: bool = False,
    run: int | None = None,
    model: str | None = None,
) -> Iterator[Event]:
    """Yield every event of the log set that starts at `path` (of one run, with `run`; of one
    model, with `model`).

    The events of every run, one run after the other (sequence numbers start again at 1 in
    each run): use `read_run_events` to tell them apart. Raises what `read_run_events` raises.
    """
    return map(itemgetter(1), read_run_events(path, strict=strict, run=run, model=model))


def read_runs(path: str | Path) -> list[LogRun]:
    """The runs of the log at `path`, in order, reading only its header lines.

    Raises FileNotFoundError, LogCorruptError, UnsupportedSchemaError.
    """
    path = Path(path)
    files = log_files(path)
    if not files:
        raise FileNotFoundError(f"no event log at {path}")
    # The same files, unchanged since the last call (replay asks more than once per view)
    signature = tuple((str(f), *_stamp(f)) for f in files)
    runs = _RUNS_SEEN.get(signature)
    if runs is None:
        runs = _read_runs(files)
        _RUNS_SEEN.clear()  # one log at a time: bounded
        _RUNS_SEEN[signature] = runs
    return list(runs)


_RUNS_SEEN: dict[tuple, list[LogRun]] = {}


def _stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def _read_runs(files: list[Path]) -> list[LogRun]:
    runs: list[LogRun] = []
    for (file_path, line_no, line), following in _header_lines(files):
        current = runs[-1].header if runs else None
        try:
            if not line.strip():
                raise LogCorruptError(file_path, line_no, "the file is empty (no header)")
            header, _ = parse_header_line(file_path, line, line_no)
        except LogCorruptError:
            if _starts_new_run(following, current):
                continue  # torn; read_events warns about it
            raise
        if line_no == 1 and header == current:
            continue
        runs.append(LogRun(index=len(runs) + 1, header=header, file=str(file_path), line=line_no))
    return runs


def read_models(path: str | Path, *, run: int | None = None) -> tuple[str, ...]:
    """The names of the models the log at `path` serves (in `run`, or in any of its runs), in
    the order their headers list them: a run's `models`, else its one `model`
    (`LogHeader.model_names`). Raises what `read_runs` raises."""
    runs = read_runs(path)
    chosen = runs if run is None else [r for r in runs if r.index == run]
    return tuple(dict.fromkeys(name for r in chosen for name in r.header.model_names))


def read_header(path: str | Path) -> LogHeader:
    """The header of the log file at `path` (its first line; the first run's header for the
    first file of a set). Its `schema_version` is the version it was written in.

    Raises FileNotFoundError, LogCorruptError, UnsupportedSchemaError.
    """
    path = Path(path)
    with open(path, "rb") as f:
        first = f.readline()
    if not first.strip():
        raise LogCorruptError(path, 1, "the file is empty (no header)")
    return parse_header_line(path, first)[0]
