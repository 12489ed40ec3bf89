"""Images in prompts, before any model sees them: the bytes a client sent, checked against
the limits and decoded once, named by their content digest. MLX-free; Pillow (the `vision`
extra) is imported only when an image is decoded.

What a vision model makes of an image (its token span, its pixel values) is the model's
business (`engine/vision.py`), and where its span sits in a prompt is the scheduler's
(`actors/scheduler/spans.py`); here an image is only validated data.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from typing import Any

from stepline.actors.scheduler.spans import PromptImage

# Defaults of the limits (ServerConfig's max_image_bytes, max_image_pixels,
# max_images_per_request): a 4K screenshot as PNG is 2-8 MB and 8.3 Mpixels.
MAX_IMAGE_BYTES = 20 * 2**20
MAX_IMAGE_PIXELS = 5000 * 5000
MAX_IMAGES_PER_REQUEST = 8


class VisionUnavailableError(RuntimeError):
    """A vision model was asked for and cannot be served here (no mlx-vlm, or a family whose
    text model stepline cannot batch); the message says what to do."""


class ImageError(ValueError):
    """An image the server will not take: corrupt, too large, or too many. `param` names
    where it came from in the request (`messages.0.content.1`), `code` says what is wrong."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_image"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    max_images: int = MAX_IMAGES_PER_REQUEST


@dataclass(frozen=True)
class ImageData:
    """One image of a prompt, decoded and checked: its bytes as sent, their SHA-256 (what
    the prefix cache and the event log know it by), its size in pixels, and its pixels as
    RGB (Pillow's image, decoded once)."""

    data: bytes = field(repr=False)
    digest: str
    width: int
    height: int
    media_type: str  # image/png, image/jpeg, ... as the bytes say (not as the client claimed)
    pixels: Any = field(repr=False, compare=False)  # PIL.Image.Image, mode RGB

    @property
    def num_bytes(self) -> int:
        return len(self.data)


def text_only(where: str | None = None) -> ImageError:
    """The error for an image sent to a model that reads text only (`where`: the part)."""
    what = f"{where} is an image, but this" if where else "the prompt has images, but this"
    return ImageError(
        f"{what} server's model reads text only: serve a vision-language model to send images",
        param=where,
        code="unsupported_content_type",
    )


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_image(data: bytes, *, where: str, limits: ImageLimits = ImageLimits()) -> ImageData:
    """`data` (an image file's bytes) decoded to RGB pixels. Raises ImageError naming `where`
    for bytes past `limits.max_bytes`, pixels past `limits.max_pixels` (checked from the
    header, before the pixels are decoded) and for anything Pillow cannot read whole."""
    if len(data) > limits.max_bytes:
        raise ImageError(
            f"{where} is {len(data):,} bytes: images of at most {limits.max_bytes:,} bytes "
            "are served (max_image_bytes)",
            param=where,
            code="image_too_large",
        )
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - the vision extra brings Pillow
        raise ImageError(
            "images need Pillow: pip install 'stepline[vision]'", param=where
        ) from None
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > limits.max_pixels:
                raise ImageError(
                    f"{where} is {width}x{height} pixels: images of at most "
                    f"{limits.max_pixels:,} pixels are served (max_image_pixels)",
                    param=where,
                    code="image_too_large",
                )
            media_type = Image.MIME.get(img.format or "", "application/octet-stream")
            rgb = img.convert("RGB")  # decodes every pixel: a truncated file fails here
    except ImageError:
        raise
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for a corrupt file
        raise ImageError(
            f"{where} is not an image this server can read ({type(exc).__name__}: {exc}); "
            "send PNG, JPEG, WebP or GIF",
            param=where,
        ) from None
    return ImageData(
        data=data,
        digest=digest_of(data),
        width=width,
        height=height,
        media_type=media_type,
        pixels=rgb,
    )


def place_image(
    expanded: Any, image: ImageData, tokenizer: Any, start: int
) -> tuple[list[int], PromptImage]:
    """`image` in a prompt at token position `start`, as its vision model's family expanded
    it (`expanded`: `engine.vision.Expanded`, the span's text and the encoder's inputs): the
    span's token ids and the `PromptImage` of [start, start + len(ids))."""
    ids = list(tokenizer.encode(expanded.text, add_special_tokens=False))
    placed = PromptImage(
        start,
        start + len(ids),
        image,
        expanded.inputs,
        units=expanded.units,
        whole=expanded.whole,
    )
    return ids, placed
