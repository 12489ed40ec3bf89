"""Logging for the `stepline serve` process: structlog, configured once, and the standard
library's loggers (uvicorn's access and error logs) sent through the same processors, so every
line has one format: JSON lines (`json`) or human-readable (`console`).

A request's lines carry its `request_id`: the HTTP handlers bind it in structlog's context
variables, which the access log line of that request (written from the same task) shares.

Lines are rendered and written on a thread of their own (`logging.handlers.QueueListener`),
never on the event loop: a traceback takes milliseconds to format (a RecursionError's,
seconds), and a slow stderr would block every client. Tracebacks never show local
variables: with them, one 2 KB body that raised RecursionError wrote 1.6 GB of log and froze
the server for minutes (structlog's console renderer shows locals by default when `rich` is
installed).
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import queue
import sys
from typing import Any

import structlog
from structlog.typing import EventDict

LOG_FORMATS = ("console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")


_listener: logging.handlers.QueueListener | None = None


def configure_logging(log_format: str = "console", level: str = "info") -> None:
    """Configure structlog and the root logger for this process. Raises ValueError for an
    unknown format or level."""
    global _listener
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    # Run for structlog's own lines on the caller's thread (so the contextvars are the
    # caller's), and, as `foreign_pre_chain`, for the standard library's on the log thread.
    shared: list[Any] = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            *shared,
            structlog.processors.StackInfoRenderer(),
            _capture_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    final: list[Any]
    if log_format == "json":
        no_locals = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        final = [
            structlog.processors.ExceptionRenderer(no_locals),
            structlog.processors.JSONRenderer(),
        ]
    else:
        final = [structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[_merge_record_context, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    if _listener is not None:
        _listener.stop()  # writes out what the last configuration queued
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    _listener = logging.handlers.QueueListener(records, handler)
    _listener.start()
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(_Enqueue(records))
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uv = logging.getLogger(name)
        uv.handlers.clear()  # through the root handler, formatted like every other line
        uv.propagate = True


def flush_logging() -> None:
    """Write out every queued line and stop the log thread (at exit; logging afterwards
    goes nowhere until `configure_logging` runs again)."""
    global _listener
    if _listener is not None:
        _listener.stop()
        _listener = None


atexit.register(flush_logging)


class _Enqueue(logging.handlers.QueueHandler):
    """Puts records on the log thread's queue as they are: the standard QueueHandler formats
    them here first (a traceback included), on the caller's thread. A record from the
    standard library takes the caller's structlog context with it."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        if not isinstance(record.msg, dict):  # not structlog's: bound ids still to merge
            record.stepline_context = structlog.contextvars.get_contextvars()
        return record


def _capture_exc_info(logger: Any, name: str, event_dict: EventDict) -> EventDict:
    # `log.exception` says exc_info=True, meaning "the exception being handled on this
    # thread": resolved here, since the traceback is formatted on the log thread.
    if event_dict.get("exc_info") is True:
        event_dict["exc_info"] = sys.exc_info()
    return event_dict


def _merge_record_context(logger: Any, name: str, event_dict: EventDict) -> EventDict:
    context = getattr(event_dict.get("_record"), "stepline_context", None)
    return {**context, **event_dict} if context else event_dict
