"""One writer per event log: an advisory lock (`flock`) on `<log>.lock`, held while a writer
has the log open, with who holds it written inside so that a refused writer can name it.

Two `stepline serve` (or a server and an `Engine.open`) writing the same `--event-log` would
interleave their runs into one corrupt file. The lock is the kernel's: it goes
with the process that held it, however that process ends, so a crashed server never blocks
its own restart. The lock file is removed when the writer closes (a crash leaves it, for the
next writer to take); a writer that locked a file just removed tries again.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO

import structlog

log = structlog.get_logger(__name__)

_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP)  # flock not supported there


def _same_file(file: IO[str], path: Path) -> bool:
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(file.fileno())
    return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)


class LogInUseError(RuntimeError):
    """Another live writer holds the event log; the message names it."""


def lock_path(path: str | Path) -> Path:
    """The lock file of the log set that starts at `path`."""
    path = Path(path)
    return path.with_name(path.name + ".lock")


class LogLock:
    """The held lock of one log; `release()` (or the process's end) lets it go."""

    def __init__(self, path: str | Path) -> None:
        """Take the lock of the log at `path`. Raises LogInUseError naming the holder if
        another writer has it, OSError if the lock file cannot be opened."""
        self.path = lock_path(path)
        while True:
            file: IO[str] = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held open
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.seek(0)
                holder = _describe(file.read(4096))
                file.close()
                raise LogInUseError(
                    f"event log {Path(path)} is being written by another process ({holder}): "
                    "stop it first, or choose another event log"
                ) from None
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    file.close()
                    raise
                # A file system without locks (some network mounts): written unguarded.
                log.warning("event_log_not_locked", path=str(self.path), error=repr(exc))
                break
            except BaseException:
                file.close()
                raise
            if _same_file(file, self.path):
                break
            file.close()  # its holder removed it as we opened it: take the new one
        self._file: IO[str] | None = file
        self._say_who_holds_it(file)

    def release(self) -> None:
        """Remove the lock file and let the lock go (idempotent). A lock file that cannot be
        removed (its folder became read-only) is left, and said: the next writer takes it."""
        if self._file is not None:
            if _same_file(self._file, self.path):
                try:
                    self.path.unlink(missing_ok=True)  # while still held: see __init__
                except OSError as exc:
                    log.warning(
                        "event_log_lock_left",
                        path=str(self.path),
                        error=exc.strerror or repr(exc),
                        effect="harmless: the next writer takes the lock file over",
                    )
            self._file.close()  # closing the descriptor releases the flock
            self._file = None

    @staticmethod
    def _say_who_holds_it(file: IO[str]) -> None:
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(sys.argv)[:300],
        }
        try:
            file.seek(0)
            file.truncate()
            file.write(json.dumps(holder) + "\n")
            file.flush()
        except OSError:  # a full disk: the lock holds all the same, unnamed
            pass


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return (
            f"pid {holder['pid']} on {holder['host']}, since {holder['since']}: {holder['command']}"
        )
    except (ValueError, KeyError, TypeError):
        return "a process that did not say who it is"
