"""Logging for the `stepline serve` process: structlog, configured once, and the standard
library's loggers (uvicorn's access and error logs) sent through the same processors, so every
line has one format: JSON lines (`json`) or human-readable (`console`).

A request's lines carry its `request_id`: the HTTP handlers bind it in structlog's context
variables, which the access log line of that request (written from the same task) shares.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

LOG_FORMATS = ("console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(log_format: str = "console", level: str = "info") -> None:
    """Configure structlog and the root logger for this process. Raises ValueError for an
    unknown format or level."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    # Run for structlog's own lines and, as `foreign_pre_chain`, for the standard library's.
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    renderer: Any
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
        final = [structlog.processors.dict_tracebacks, renderer]
    else:
        final = [structlog.dev.ConsoleRenderer()]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uv = logging.getLogger(name)
        uv.handlers.clear()  # through the root handler, formatted like every other line
        uv.propagate = True
