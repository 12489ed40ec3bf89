"""What image and audio intake share, before any model sees a medium: the error a client gets
for one the server will not take (`MediaError`: its `param` and `code`), how errors name each
medium (`MediaKind`), the digest media are known by, and a decoded medium's way into a prompt:
made into its encoder's inputs, its decoded content let go (`Decoded.with_inputs`), then placed
as a span of tokens (`place`). MLX-free.

What differs between them (formats, limits, decoders) is each medium's own:
`engine/images.py`, `engine/audio.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from stepline.actors.scheduler.spans import PromptImage


class MediaError(ValueError):
    """A medium the server will not take: corrupt, unsupported, too large or too many. `param`
    names where it came from in the request (`messages.0.content.1`), `code` says what is
    wrong (the medium's `default_code` unless said)."""

    default_code: ClassVar[str] = "invalid_media"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = self.default_code if code is None else code


@dataclass(frozen=True)
class MediaKind:
    """One medium as intake names it: a span's `medium`, its errors' words and type, and the
    stem of its options (`max_{option}_bytes`, `max_{option}s_per_request`)."""

    name: str  # "image", "audio": `PromptImage.medium`
    error: type[MediaError]
    many: str  # "the request has 9 {many}"
    one: str  # "the most this server takes in one {one}"
    option: str

    def too_many(self, count: int, limit: int, where: str) -> MediaError:
        """The error for a request of `count` of this medium, past `limit` (`where`: the
        first one past it)."""
        return self.error(
            f"the request has {count} {self.many}: at most {limit} are served in one request "
            f"(max_{self.option}s_per_request)",
            param=where,
            code=f"too_many_{self.option}s",
        )

    def too_large(self, where: str, max_bytes: int) -> MediaError:
        """The error for one of more than `max_bytes`, known before it is decoded."""
        return self.error(
            f"{where} is larger than {max_bytes:,} bytes, the most this server takes in one "
            f"{self.one} (max_{self.option}_bytes)",
            param=where,
            code=f"{self.option}_too_large",
        )


def digest_of(data: bytes) -> str:
    """The SHA-256 of a medium's bytes: what the prefix cache and the event log know it by."""
    return hashlib.sha256(data).hexdigest()


class Decoded:
    """What a decoded, checked medium (`ImageData`, `AudioData`: frozen dataclasses) has
    beside its own fields: `data` (the bytes as sent), `digest`, its decoded content (the
    field `decoded_field` names) until its encoder's inputs are made, and those inputs
    (`expanded`, the family's `engine.vision.parts.Expanded`)."""

    kind: ClassVar[MediaKind]
    decoded_field: ClassVar[str]
    data: bytes
    digest: str
    expanded: Any

    @property
    def num_bytes(self) -> int:
        return len(self.data)

    def with_inputs(self, expanded: Any) -> Self:
        """This with its encoder's inputs, its decoded content let go."""
        return self._replaced(expanded)

    def kept(self) -> Self:
        """What a span keeps of it: its bytes, not its decoded content nor its inputs (the
        span holds those)."""
        return self._replaced(None)

    def _replaced(self, expanded: Any) -> Self:
        changes = {self.decoded_field: None, "expanded": expanded}
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]  # a dataclass


def place(
    expanded: Any, medium: Decoded, tokenizer: Any, start: int
) -> tuple[list[int], PromptImage]:
    """`medium` (an image or a clip) in a prompt at token position `start`, as its model's
    family expanded it (`expanded`: the span's text and the encoder's inputs): the span's token
    ids and the `PromptImage` of [start, start + len(ids)), which keeps the medium's bytes but
    not its decoded content (the encoder reads `expanded.inputs`)."""
    ids = list(tokenizer.encode(expanded.text, add_special_tokens=False))
    placed = PromptImage(
        start,
        start + len(ids),
        medium.kept(),
        expanded.inputs,
        units=expanded.units,
        whole=expanded.whole,
        medium=medium.kind.name,
    )
    return ids, placed
