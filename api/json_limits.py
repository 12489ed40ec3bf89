"""What every request body must respect before any door reads it: JSON as RFC 8259 says
(no NaN or Infinity), nested at most `MAX_JSON_DEPTH` deep, no lone UTF-16 surrogate in any
string or key, and at most `MAX_TOOLS` tools, `MAX_STOP_STRINGS` stop strings (of at most
`MAX_STOP_CHARS` characters) and `MAX_MESSAGES` messages. No MLX, no engine: pure functions
that raise `InputLimitError`.

Why here, once: a 900-deep list rendered by a chat template raised RecursionError (a 500 whose
traceback froze the server for minutes); a lone surrogate cannot be encoded as UTF-8, so the
tokenizer, the log and every JSON writer failed on it (500s, a Response that could never be
deleted); 60,000 tools or stop strings made every later step slow for everyone. Each check is
linear in the body and runs where the body is parsed, off the event loop.
"""

from __future__ import annotations

import json
from typing import Any

from stepline.api.request_error import RequestError

# Deeper than any real tool schema or template argument (JSON Schema nests ~10-20 levels),
# far below what Python's recursion (a chat template, json.dumps) survives.
MAX_JSON_DEPTH = 64
MAX_TOOLS = 128  # OpenAI's limit on `tools`
MAX_STOP_STRINGS = 64  # `stop` / `stop_sequences`: each is matched against every new token
MAX_STOP_CHARS = 1000  # per stop string: a partial match is held back and rescanned per token
MAX_MESSAGES = 10_000  # `messages` / `input` items: more than a 1M-token context holds

# Top-level list fields, by name in any door's body, and their caps.
_LIST_CAPS: dict[str, tuple[int, str]] = {
    "tools": (MAX_TOOLS, "tools"),
    "functions": (MAX_TOOLS, "functions"),
    "stop": (MAX_STOP_STRINGS, "stop strings"),
    "stop_sequences": (MAX_STOP_STRINGS, "stop sequences"),
    "messages": (MAX_MESSAGES, "messages"),
    "input": (MAX_MESSAGES, "input items"),
}


class InputLimitError(RequestError):
    """A body that breaks one of the limits above (the caller's to change); `param` names
    the field (None: the whole body), `code` is the OpenAI-style error code."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message, param=param)
        self.message = message
        self.param = param
        self.code = code


class NotJSONError(InputLimitError):
    """Text that was meant to hold JSON and does not."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def parse_body(body: bytes | str) -> Any:
    """The JSON document `body`, checked by `check_value` and `check_caps`. Raises
    InputLimitError (code `invalid_json` for text that is not JSON)."""
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except RecursionError:  # deeper than the parser's own stack allows
        raise _too_deep(None) from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise InputLimitError(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    check_value(value)
    check_caps(value)
    return value


def parse_nested(text: str, param: str) -> Any:
    """JSON sent as a string inside a body (a tool call's `arguments`), held to the same
    depth and text rules. Raises NotJSONError for text that is no JSON, InputLimitError
    naming `param` for JSON past the limits."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise _too_deep(param) from None
    except ValueError:
        raise NotJSONError(f"{param} is not JSON", param=param) from None
    check_value(value, param)
    return value


def check_value(value: Any, param: str | None = None) -> None:
    """Raise InputLimitError if `value` (parsed JSON) nests deeper than MAX_JSON_DEPTH or
    holds a string or key that is not valid Unicode text (a lone surrogate). Iterative, so
    that no depth can exhaust the stack; `param` prefixes the path it reports."""
    # (value, depth, path); the path is built only for what is reported.
    pending: list[tuple[Any, int, tuple[str | int, ...]]] = [(value, 1, ())]
    while pending:
        item, depth, path = pending.pop()
        if isinstance(item, str):
            _check_text(item, param, path)
        elif isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep(_join(param, path))
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key, param, path)
                    if isinstance(child, str | dict | list):
                        pending.append((child, depth + 1, (*path, key)))
            else:
                for i, child in enumerate(item):
                    if isinstance(child, str | dict | list):
                        pending.append((child, depth + 1, (*path, i)))


def check_caps(value: Any) -> None:
    """Raise InputLimitError if a top-level list field (tools, stop strings, messages) of
    the body `value` is longer than its cap, or a stop string longer than MAX_STOP_CHARS."""
    if not isinstance(value, dict):
        return
    for name, (cap, what) in _LIST_CAPS.items():
        field = value.get(name)
        if isinstance(field, list) and len(field) > cap:
            raise InputLimitError(
                f"{name}: at most {cap} {what} per request, got {len(field)}",
                param=name,
                code="array_above_max_length",
            )
    for name in ("stop", "stop_sequences"):
        field = value.get(name)
        for i, stop in enumerate(field if isinstance(field, list) else [field]):
            if isinstance(stop, str) and len(stop) > MAX_STOP_CHARS:
                param = f"{name}.{i}" if isinstance(field, list) else name
                raise InputLimitError(
                    f"{param}: a stop string has at most {MAX_STOP_CHARS} characters, "
                    f"got {len(stop)}",
                    param=param,
                    code="string_above_max_length",
                )


def check_text(text: str, param: str) -> None:
    """Raise InputLimitError if `text` holds a lone surrogate (not encodable as UTF-8)."""
    _check_text(text, param, ())


def _check_text(text: str, param: str | None, path: tuple[str | int, ...]) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = _join(param, path)
        raise InputLimitError(
            f"{where or 'the body'}: the text holds a lone UTF-16 surrogate "
            f"(U+{ord(text[exc.start]):04X}), which is not valid Unicode: send text, "
            "or a complete surrogate pair",
            param=where,
            code="invalid_text",
        ) from None


def _too_deep(param: str | None) -> InputLimitError:
    return InputLimitError(
        f"{param or 'the body'}: JSON nested more than {MAX_JSON_DEPTH} levels deep "
        f"(this server's limit is {MAX_JSON_DEPTH})",
        param=param,
        code="nesting_too_deep",
    )


def _join(param: str | None, path: tuple[str | int, ...]) -> str | None:
    parts = [param] if param else []
    parts.extend(str(p) for p in path)
    return ".".join(parts) or None
