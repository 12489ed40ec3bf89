"""Image and audio spans in a prompt, as the scheduler sees them: the tokens an image (or a
clip: `medium`) stands for,
[start, end), the encoder work it needs first (`units`), whether its tokens go in one chunk
(`whole`), and the content digest that keys it in the prefix cache.

What an image is (its bytes, decoded and checked: `engine/images.py`) and what a vision model
makes of it (`engine/vision/`) are not the scheduler's business: a span carries them
through, unread.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stepline.events.fold import RequestState
from stepline.events.models import ImageRef


class ImageContent(Protocol):
    """What a span knows of its image (`engine.images.ImageData` is one)."""

    @property
    def data(self) -> bytes: ...  # the bytes as sent
    @property
    def digest(self) -> str: ...  # their SHA-256
    @property
    def width(self) -> int: ...
    @property
    def height(self) -> int: ...
    @property
    def num_bytes(self) -> int: ...


@dataclass(frozen=True)
class PromptImage:
    """An image in a prompt: the tokens it stands for, [start, end), and what the model's
    vision encoder reads for it (`inputs`: numpy arrays, the family's own names)."""

    start: int
    end: int
    image: ImageContent
    inputs: Mapping[str, Any] = field(repr=False, compare=False)
    units: int = 1  # the encoder's work in units steps run some of (`engine/vision/`)
    whole: bool = True  # the span's tokens go in one chunk (else chunked once encoded)
    # "audio": a clip (`engine.audio.AudioData`), heard by the model's audio encoder
    medium: str = "image"

    @property
    def digest(self) -> str:
        return self.image.digest

    def ref(self) -> ImageRef:
        """As the event log records it."""
        return ImageRef(
            digest=self.image.digest,
            start=self.start,
            end=self.end,
            num_bytes=self.image.num_bytes,
            width=self.image.width,
            height=self.image.height,
            units=self.units,
            whole=self.whole,
            **(
                {
                    "medium": "audio",
                    "seconds": self.image.seconds,  # type: ignore[attr-defined]
                    "num_samples": self.image.num_samples,  # type: ignore[attr-defined]
                }
                if self.medium == "audio"
                else {}
            ),
        )


def check_spans(images: Sequence[Any], num_tokens: int) -> None:
    """Raise ValueError unless `images`' spans are non-empty, in order, apart, and inside a
    prompt of `num_tokens` tokens."""
    at = 0
    for i, image in enumerate(images):
        if not at <= image.start < image.end <= num_tokens:
            raise ValueError(
                f"image {i}'s token span [{image.start}, {image.end}) is not inside the prompt "
                f"of {num_tokens} tokens, after the previous image's"
            )
        at = image.end


def inside_image(images: Sequence[Any], offset: int) -> Any:
    """The image whose span holds `offset` strictly inside (a chunk may not end there)."""
    for image in images:
        if image.start < offset < image.end:
            return image
    return None


@functools.lru_cache(maxsize=256)
def _span_key(digest: str, length: int) -> tuple[int, ...]:
    """The prefix-cache key of an image's token span: a value for each position made from
    the image's digest and the position (negative, so never a token id; within int32)."""
    out = []
    for i in range(length):
        h = hashlib.blake2b(f"{digest}:{i}".encode(), digest_size=4).digest()
        out.append(-1 - (int.from_bytes(h, "little") & 0x7FFFFFFF))
    return tuple(out)


def prompt_key(
    ids: Sequence[int], images: Sequence[Any], adapter: str | None = None
) -> tuple[int, ...]:
    """The tokens the prefix cache knows prompt `ids` by: its ids, with each image's span
    (`images`: anything with `digest`, `start` and `end`) replaced by a key made from the
    image's content. Placeholder tokens are the same for every image: two prompts with the
    same text and different images must not share a cache entry, and the same image in the
    next turn must. A request for a LoRA `adapter` has keys of that adapter's own
    (`adapter_key`): its cache is not the base model's, nor another adapter's."""
    if not images:
        return adapter_key(ids, adapter)
    out = list(ids)
    for image in images:
        out[image.start : image.end] = _span_key(image.digest, image.end - image.start)
    return adapter_key(out, adapter)


def adapter_key(keys: Sequence[int], adapter: str | None) -> tuple[int, ...]:
    """`keys` (token ids, image keys) as adapter `adapter`'s (None: the base model's, as
    they are): each moved by a multiple of 2**32 made from the adapter's name, away from
    zero, so that no key of one adapter is a token id, an image key or another adapter's
    key (token ids and image keys are within int32). Same length: a key's positions are
    still the prompt's."""
    if adapter is None:
        return tuple(keys)
    return tuple(
        k + _adapter_offset(adapter) if k >= 0 else k - _adapter_offset(adapter) for k in keys
    )


@functools.lru_cache(maxsize=256)
def _adapter_offset(adapter: str) -> int:
    h = hashlib.blake2b(adapter.encode(), digest_size=3).digest()
    return (1 + int.from_bytes(h, "little")) << 32


# -- a request's spans, as the policy chunks its prompt around them ------------------------


def pending_image(state: RequestState, start: int) -> int | None:
    """The first of the request's images, from prompt position `start` on, whose encoder
    work is not all done (its index), or None."""
    for i, image in enumerate(state.images):
        if image.end > start and state.encoded[i] < image.units:
            return i
    return None


def next_encode(state: RequestState, start: int) -> int | None:
    """The image whose encoder units are the request's next work, its prompt's next chunk
    starting at `start` (its index); None: its next work is prompt tokens."""
    i = pending_image(state, start) if state.images else None
    return i if i is not None and state.images[i].start <= start else None


def cut_at_images(state: RequestState, start: int, n: int) -> int:
    """A chunk of at most `n` tokens at `start`, cut so that it stops before any image span
    not yet encoded, and never ends inside a span that goes whole; 0: the span at `start`
    goes whole and does not fit."""
    end = start + n
    for i, image in enumerate(state.images):
        if image.start >= end or image.end <= start:
            continue
        if state.encoded[i] < image.units or (image.whole and end < image.end):
            end = max(image.start, start)
            break
    return end - start


def whole_image_at(state: RequestState, start: int) -> int:
    """Tokens of the span of a whole image starting at `start` (0: none does). The first
    prompt of a step whose whole span fits no step's room runs it alone, past the budget or
    the time target, rather than never (the log's `chunk-prefilled` says so)."""
    for image in state.images:
        if image.whole and image.start == start:
            return image.end - image.start
    return 0
