"""The neutral chat messages every door translates its conversation into: OpenAI's shape,
which chat templates render (`role`, `content`, an assistant's `tool_calls`, a tool's
`tool_call_id`). What the server returns, it accepts back: a tool call cut off by the token
limit is answered with `arguments` that are not JSON, and an agent sends it back in its next
request's history; that text is rendered as it was. No MLX."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stepline.api.json_limits import InputLimitError, NotJSONError, parse_nested
from stepline.api.pipeline.errors import APIError


def template_call(call_id: str | None, name: str, arguments: Any) -> dict[str, Any]:
    """A call the assistant made, as chat templates render it (in its `tool_calls`)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def call_arguments(arguments: Any, param: str) -> Any:
    """A call's arguments as sent back in a conversation: JSON text is parsed (templates
    render objects); text that is not JSON (a call cut off by the token limit) stays the text
    it was. Raises APIError for JSON past the body's depth and text limits (templates recurse
    into it)."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return parse_nested(arguments or "{}", param)
    except NotJSONError:
        return arguments
    except InputLimitError as exc:
        raise APIError(400, exc.message, param=exc.param, code=exc.code) from None


def joined_text(parts: Sequence[Any], where: str) -> str:
    """The text of `parts` (each with a `type` and a `text`), joined by newlines, where only
    text is served (a system prompt). Raises APIError naming the first part that is not
    text (`where.j`)."""
    texts = []
    for j, part in enumerate(parts):
        if part.type != "text" or part.text is None:
            raise unsupported_part(f"{where}.{j}", part.type, "'text' (with a 'text')")
        texts.append(part.text)
    return "\n".join(texts)


def unsupported_part(where: str, kind: Any, served: str) -> APIError:
    """The error of content part `where` of type `kind`, which is not among the `served`
    ones."""
    return APIError(
        400,
        f"{where} has type {kind!r}: only parts of type {served} are served here",
        param=where,
        code="unsupported_content_type",
    )
