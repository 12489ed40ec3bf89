"""What the caller got wrong in one request, as an explicit type.

`RequestError` is a ValueError (an `except ValueError` around `Engine.submit` or `prepare`
still catches it) raised for an argument, a prompt or messages the caller must change. The
HTTP doors answer it with a 400 (`api/pipeline/errors.py`, `known_error`); any other
exception that reaches them, a plain ValueError included, is a bug: a 500.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request that cannot be served as it was asked; the message says what to change.
    `param` names the request field it concerns (None: the door's prompt field)."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param
