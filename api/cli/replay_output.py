"""What `stepline replay` answers with, besides its text: the exit codes, a progress line
on a terminal, a view taken run by run, and the report written as JSON or text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel

from stepline.events.log import log_files, read_runs

# 0 fine; 1 violations found (verify), or tokens diverged or nothing could be compared
# (reexecute); 2 the log or the arguments cannot be used (message on stderr)
EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE = 0, 1, 2


class Progress:
    """Progress of a long replay on a terminal: one line on stderr, rewritten in place, and
    cleared when done. Silent when the stream is not a terminal (a pipe, a file, a test)."""

    def __init__(self, stream: TextIO, log: Path) -> None:
        self.stream = stream if stream.isatty() else None
        self.log = log
        self.shown = False
        self._estimate: int | None = None

    def events(self, num_events: int) -> None:
        """`num_events` read so far; the total is estimated from the log's size."""
        if self.stream is None:
            return
        if self._estimate is None:
            self._estimate = _estimated_events(self.log)
        share = min(99, 100 * num_events // max(self._estimate, 1))
        self._show(f"reading {self.log.name}: {num_events:,} events (~{share}%)")

    def requests(self, done: int, total: int) -> None:
        """`done` of `total` requests re-executed."""
        if self.stream is not None:
            self._show(f"re-executed {done} of {total} requests")

    def _show(self, line: str) -> None:
        assert self.stream is not None
        self.stream.write(f"\r\x1b[K{line}")
        self.stream.flush()
        self.shown = True

    def done(self) -> None:
        if self.stream is not None and self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def _estimated_events(log: Path) -> int:
    """About how many events the log set holds: its bytes over the mean line of its start."""
    files = log_files(log)
    total = sum(f.stat().st_size for f in files)
    with open(files[0], "rb") as f:
        sample = f.read(1 << 16)
    lines = max(1, sample.count(b"\n"))
    return max(1, total * lines // max(1, len(sample)))


class RunReports(BaseModel):
    """One view, run by run, for a log of several runs."""

    runs: tuple[BaseModel, ...]


def per_run(path: Path, run: int | None, view: Callable[[int], BaseModel]) -> BaseModel:
    """The view of `run`; of the only run; or, for a log of several, of each run apart."""
    if run is not None:
        return view(run)
    runs = read_runs(path)
    if len(runs) == 1:
        return view(1)
    return RunReports(runs=tuple(view(r.index) for r in runs))


def emit(report: BaseModel, as_json: bool, out: TextIO, text: Callable[[Any], list[str]]) -> None:
    """Write `report` to `out`: as JSON, or as the lines `text` makes of it."""
    if as_json:
        out.write(report.model_dump_json(indent=2) + "\n")
    else:
        out.write("\n".join(text(report)) + "\n")
