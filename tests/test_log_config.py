"""The server's log configuration: a traceback never shows local variables and is never
formatted on the caller's thread (the event loop), and a line from the standard library
still carries the request id bound where it was logged."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator

import pytest
import structlog

from stepline.api.http.log_config import configure_logging, flush_logging


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    flush_logging()
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    root.handlers[:] = handlers
    root.setLevel(level)


class Formatted(Exception):
    """Remembers the threads its text was asked for on (a traceback asks for it)."""

    threads: list[str] = []

    def __str__(self) -> str:
        Formatted.threads.append(threading.current_thread().name)
        return "it broke"


def fail(depth: int) -> None:
    secret_local = "hunter2-in-a-local"  # noqa: F841 - what a locals dump would show
    if depth:
        fail(depth - 1)
    raise Formatted()


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_a_traceback_has_no_locals_and_is_formatted_off_the_callers_thread(
    log_format, capsys, restore_logging
):
    configure_logging(log_format, "info")
    Formatted.threads.clear()
    structlog.contextvars.bind_contextvars(request_id="chatcmpl-1")
    try:
        fail(3)
    except Formatted:
        structlog.get_logger("test").exception("request_failed")
    logging.getLogger("stdlib.access").info('"%s" %d', "POST /v1/completions", 200)
    flush_logging()
    err = capsys.readouterr().err
    assert "request_failed" in err and "it broke" in err and "fail" in err  # the traceback
    assert "hunter2" not in err and "secret_local" not in err
    assert Formatted.threads and threading.current_thread().name not in Formatted.threads
    access = next(line for line in err.splitlines() if "POST /v1/completions" in line)
    assert "chatcmpl-1" in access  # bound on the caller's thread, written on the log thread
    if log_format == "json":
        assert json.loads(access)["request_id"] == "chatcmpl-1"
