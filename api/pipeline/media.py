"""What a request's images (`images.py`) and audio clips (`audio.py`) share on their way from
a door to decoded data: their placeholders in the neutral messages (found in order, then
replaced by what they resolved to) and their base64 data (sized before it is decoded, then
decoded). Errors are the medium's own (`engine.media.MediaKind`). No MLX.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator, Sequence
from typing import Any

from stepline.engine.media import MediaKind

_NO_SPACE = str.maketrans("", "", " \t\r\n")


def placeholders(messages: Sequence[dict[str, Any]], kind: MediaKind, source: type) -> list[Any]:
    """The sources (of type `source`) of the medium's placeholders, `{"type": kind.name,
    "source": ...}`, in the messages' content parts, in order."""
    return [
        part["source"]
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if _is_placeholder(part, kind, source)
    ]


def resolved(
    message: dict[str, Any], kind: MediaKind, source: type, media: Iterator[Any]
) -> dict[str, Any]:
    """`message` with each of its placeholders (as `placeholders` found them) replaced by
    `{"type": kind.name, kind.name: the next of media}`; a message with none as it is."""
    content = message.get("content")
    if not isinstance(content, list) or not any(_is_placeholder(p, kind, source) for p in content):
        return message
    parts = [
        {"type": kind.name, kind.name: next(media)} if _is_placeholder(p, kind, source) else p
        for p in content
    ]
    return {**message, "content": parts}


def _is_placeholder(part: Any, kind: MediaKind, source: type) -> bool:
    return (
        isinstance(part, dict)
        and part.get("type") == kind.name
        and isinstance(part.get("source"), source)
    )


def check_encoded_size(kind: MediaKind, text: str, where: str, max_bytes: int) -> None:
    """Raises the medium's error (`{option}_too_large`) where base64 `text` is past
    `max_bytes` whatever it decodes to."""
    if len(text) // 4 * 3 > max_bytes + 3:
        raise kind.too_large(where, max_bytes)


def base64_bytes(text: str) -> bytes | None:
    """`text` decoded, line breaks (`base64` wraps its output) left out; None for anything
    else that is not base64."""
    for attempt in (text, text.translate(_NO_SPACE)):
        try:
            return base64.b64decode(attempt, validate=True)
        except (binascii.Error, ValueError):
            pass
    return None


def decoded_base64(kind: MediaKind, text: str, where: str) -> bytes:
    """`text` decoded (`base64_bytes`). Raises the medium's error for text that is not
    base64."""
    data = base64_bytes(text)
    if data is None:
        raise kind.error(
            f"{where} is not valid base64: send the {kind.one}'s bytes base64-encoded",
            param=where,
        )
    return data
