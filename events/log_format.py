"""The event log's on-disk format: file names, schema versions and upcasters, the header line.

Shared by the writer (events/log.py) and the reader (events/log_reader.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from stepline.events.models import SCHEMA_VERSION, LogHeader


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


def upcast(raw: dict[str, Any], version: int) -> dict[str, Any]:
    for v in range(version, SCHEMA_VERSION):
        raw = _UPCASTERS[v](raw)
    return raw


def check_readable(path: Path, version: object, line_no: int = 1) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise LogCorruptError(path, line_no, f"header has an invalid schema_version {version!r}")
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


def existing_set(path: Path) -> list[Path]:
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


def _v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    # Schema 2 only added fields whose defaults describe a version-1 log (no run id, no salt,
    # outputs logged, no Decoding.token_count since ids are there) and a new event kind.
    return raw


def _v2_to_v3(raw: dict[str, Any]) -> dict[str, Any]:
    # Schema 3 records a step's tokens as one `tokens` event; a version-2 `decoding` event is
    # one request's tokens of one step, so it becomes a `tokens` event of that request's rows.
    # A plan's members became parallel tuples.
    if raw.get("type") == "step" and "entries" in raw:
        entries = raw.pop("entries")
        return {
            **raw,
            "request_ids": [e["request_id"] for e in entries],
            "num_tokens": [e["num_tokens"] for e in entries],
            "kinds": [e["kind"] for e in entries],
        }
    if raw.get("type") != "decoding":
        return raw
    ids = raw.pop("token_ids", None)
    count = raw.pop("token_count", None)
    n = len(ids) if ids is not None else (count or 0)
    return {
        **raw,
        "type": "tokens",
        "request_id": None,
        "request_ids": [raw["request_id"]] * n,
        "token_ids": ids,
    }


def _v3_to_v4(raw: dict[str, Any]) -> dict[str, Any]:
    # Schema 4 only added `Admitted.client`, whose default (None: the anonymous client) is
    # who sent every request of a version-3 log.
    return raw


def _v4_to_v5(raw: dict[str, Any]) -> dict[str, Any]:
    # Schema 5 only added images (`Admitted.images`, `ChunkPrefilled.images`), whose defaults
    # (none) describe every request of a version-4 log.
    return raw


def _v5_to_v6(raw: dict[str, Any]) -> dict[str, Any]:
    # Schema 6 only added several models (`model` on events, `LogHeader.models`, the model
    # events), whose defaults (none: the run's one model) describe a version-5 log.
    return raw


def _v6_to_v7(raw: dict[str, Any]) -> dict[str, Any]:
    # Schema 7 calls a step's tokens `decoding` (3 to 6: `tokens`); its other additions (chunk
    # limits, held requests, warm-up and host load, refusals at a door) default to "not
    # recorded".
    if raw.get("type") == "tokens":
        return {**raw, "type": "decoding"}
    return raw


def _v7_to_v8(raw: dict[str, Any]) -> dict[str, Any]:
    # Schema 8 only added `parked` and `resumed` events: a version-7 log has none.
    return raw


_UPCASTERS[1] = _v1_to_v2
_UPCASTERS[2] = _v2_to_v3
_UPCASTERS[3] = _v3_to_v4
_UPCASTERS[4] = _v4_to_v5
_UPCASTERS[5] = _v5_to_v6
_UPCASTERS[6] = _v6_to_v7


def _v8_to_v9(raw: dict[str, Any]) -> dict[str, Any]:
    # Schema 9 only added LoRA adapters (`Admitted.adapter`, whose default, None: the base
    # model, is what every request of a version-8 log ran with; `adapter-loaded` events).
    return raw


def _v9_to_v10(raw: dict[str, Any]) -> dict[str, Any]:
    # Schema 10 only added `Admitted.origin`, whose default (a client's request) is what every
    # request of a version-9 log was.
    return raw


def _v10_to_v11(raw: dict[str, Any]) -> dict[str, Any]:
    # Schema 11 only added the loop guard's end (`terminal` reason loop), `RequestParams`'s
    # `loop_guard` and `repeat_last_n`, whose defaults (none, the whole context) are what
    # every request of a version-10 log ran with.
    return raw


_UPCASTERS[7] = _v7_to_v8
_UPCASTERS[8] = _v8_to_v9
_UPCASTERS[9] = _v9_to_v10
_UPCASTERS[10] = _v10_to_v11
# upcasters that change nothing (by version): while registered, their records parse as they are
_NO_OP_UPCASTERS = {
    1: _v1_to_v2,
    3: _v3_to_v4,
    4: _v4_to_v5,
    5: _v5_to_v6,
    7: _v7_to_v8,
    8: _v8_to_v9,
    9: _v9_to_v10,
    10: _v10_to_v11,
}


def needs_upcast(version: int) -> bool:
    """Whether records of `version` must go through upcasters (else: parse them directly)."""
    return any(
        v not in _NO_OP_UPCASTERS or _UPCASTERS.get(v) is not _NO_OP_UPCASTERS[v]
        for v in range(version, SCHEMA_VERSION)
    )


# ---------------------------------------------------------------------------------------------
# The header line.


# How a header line starts: the writer puts `type` first in a header, never in an event
# (whose first field is `seq`); the second form is json.dumps's, for hand-made logs.
HEADER_PREFIXES = (b'{"type":"header"', b'{"type": "header"')


def parse_header_line(path: Path, line: bytes, line_no: int = 1) -> tuple[LogHeader, int]:
    """The header on that line (its schema_version as written) and that version.

    Raises LogCorruptError, UnsupportedSchemaError.
    """
    try:
        raw = json.loads(line)
    except ValueError as exc:
        raise LogCorruptError(path, line_no, f"the header is not JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("type") != "header":
        raise LogCorruptError(path, line_no, "the first line is not a log header")
    version = check_readable(path, raw.get("schema_version"), line_no)
    if version < SCHEMA_VERSION:
        raw = upcast(raw, version)
        raw["schema_version"] = version
    try:
        return LogHeader.model_validate(raw), version
    except ValidationError as exc:
        raise LogCorruptError(path, line_no, f"invalid header: {first_error(exc)}") from None


def first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]
