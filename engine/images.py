"""Images in prompts, before any model sees them: the bytes a client sent, checked against
the limits and decoded once, named by their content digest. MLX-free; Pillow (the `vision`
extra) is imported only when an image is decoded.

What a vision model makes of an image (its token span, its pixel values) is the model's
business (`engine/vision/`), and where its span sits in a prompt is the scheduler's
(`actors/scheduler/spans.py`); here an image is only validated data.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import structlog

from stepline.engine.media import Decoded, MediaError, MediaKind, digest_of

log = structlog.get_logger(__name__)

# Defaults of the limits (ServerConfig's max_image_bytes, max_image_pixels,
# max_images_per_request): a 4K screenshot as PNG is 2-8 MB and 8.3 Mpixels.
MAX_IMAGE_BYTES = 20 * 2**20
MAX_IMAGE_PIXELS = 5000 * 5000
MAX_IMAGES_PER_REQUEST = 8
# Default of ServerConfig's max_image_pixels_in_flight: two of the largest images at once. A
# pixel costs ~3 bytes decoded (RGB), up to ~14 while the vision processor makes its inputs
# (4999 x 4999 on the vision demo: +190 MB decoded, +341 MB at the processor's peak).
MAX_PIXELS_IN_FLIGHT = 2 * MAX_IMAGE_PIXELS


class VisionUnavailableError(RuntimeError):
    """A vision model was asked for and cannot be served here (no mlx-vlm, or a family whose
    text model stepline cannot batch); the message says what to do."""


class ImageError(MediaError):
    """An image the server will not take: corrupt, too large, or too many. `param` names
    where it came from in the request (`messages.0.content.1`), `code` says what is wrong."""

    default_code = "invalid_image"


IMAGE = MediaKind("image", ImageError, many="images", one="image", option="image")


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    max_images: int = MAX_IMAGES_PER_REQUEST


@dataclass(frozen=True)
class ImageData(Decoded):
    """One image of a prompt, decoded and checked: its bytes as sent, their SHA-256 (what
    the prefix cache and the event log know it by), its size in pixels, and its pixels as
    RGB (Pillow's image, decoded once) until the vision encoder's inputs are made from them."""

    kind: ClassVar[MediaKind] = IMAGE
    decoded_field: ClassVar[str] = "pixels"

    data: bytes = field(repr=False)
    digest: str
    width: int
    height: int
    media_type: str  # image/png, image/jpeg, ... as the bytes say (not as the client claimed)
    # PIL.Image.Image, mode RGB; None once the vision encoder's inputs are made from it
    pixels: Any = field(repr=False, compare=False)
    # those inputs (`engine.vision.parts.Expanded`), where a door made them as it decoded the image
    expanded: Any = field(default=None, repr=False, compare=False)


def text_only(where: str | None = None) -> ImageError:
    """The error for an image sent to a model that reads text only (`where`: the part)."""
    what = f"{where} is an image, but this" if where else "the prompt has images, but this"
    return ImageError(
        f"{what} server's model reads text only: serve a vision-language model to send images",
        param=where,
        code="unsupported_content_type",
    )


# The formats served (docs/images.md): Pillow is asked to read these only, so an ICO, TIFF,
# BMP, ... is refused from its first bytes, never decoded (an ICO's embedded PNG is decoded
# whole before Pillow knows its size).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_MEDIA_TYPES = {
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "MPO": "image/jpeg",  # a JPEG with more pictures after the first (phone cameras)
    "WEBP": "image/webp",
    "GIF": "image/gif",
}
# What a file is when it is none of FORMATS, for the error (its first bytes).
_OTHER_FORMATS = (
    (b"\x00\x00\x01\x00", "an ICO"),
    (b"\x00\x00\x02\x00", "a CUR"),
    (b"II*\x00", "a TIFF"),
    (b"MM\x00*", "a TIFF"),
    (b"BM", "a BMP"),
    (b"8BPS", "a PSD"),
    (b"%PDF", "a PDF"),
    (b"\x00\x00\x00\x0cjP", "a JPEG 2000"),
    (b"\xff\x4f\xff\x51", "a JPEG 2000"),
    (b"qoif", "a QOI"),
    (b"DDS ", "a DDS"),
    (b"\x01\xda", "an SGI"),
)


@dataclass(frozen=True)
class ImageHeader:
    """What an image file's header says, before any pixel is decoded."""

    width: int
    height: int
    media_type: str  # of the bytes: image/png, image/jpeg, image/webp, image/gif

    @property
    def num_pixels(self) -> int:
        return self.width * self.height


def read_header(data: bytes, *, where: str, limits: ImageLimits = ImageLimits()) -> ImageHeader:
    """The size and format of `data` (an image file's bytes) from its header, no pixel
    decoded. Raises ImageError naming `where` for bytes past `limits.max_bytes`, a format
    other than PNG, JPEG, WebP and GIF, and pixels past `limits.max_pixels`
    (`image_too_large`, a decompression bomb's included)."""
    with _opened(data, where, limits) as img:
        return ImageHeader(img.width, img.height, _MEDIA_TYPES[img.format])


def decode_image(data: bytes, *, where: str, limits: ImageLimits = ImageLimits()) -> ImageData:
    """`data` (an image file's bytes) decoded to RGB pixels. Raises ImageError naming `where`
    for what `read_header` refuses (checked before the pixels are decoded), and for a file
    Pillow cannot decode whole (`invalid_image`, in our words: Pillow's own text is logged,
    never shown to the client)."""
    img = _opened(data, where, limits)
    try:
        img.load()  # decodes every pixel: a truncated file fails here
        if img.width * img.height > limits.max_pixels:  # a size learned only while decoding
            raise _too_many_pixels(where, img.width, img.height, limits)
        # An RGB image is kept as decoded: a copy would hold its pixels twice.
        rgb = img if img.mode == "RGB" else img.convert("RGB")
    except ImageError:
        img.close()
        raise
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for a corrupt file
        img.close()
        log.info("image_undecodable", where=where, error=f"{type(exc).__name__}: {exc}")
        raise ImageError(
            f"{where} is a {img.format} file whose pixels cannot be decoded (corrupt or "
            "cut short): send the whole image",
            param=where,
        ) from None
    if rgb is not img:
        img.close()  # its pixels freed now, not when it is collected
    return ImageData(
        data=data,
        digest=digest_of(data),
        width=rgb.width,
        height=rgb.height,
        media_type=_MEDIA_TYPES[img.format],
        pixels=rgb,
    )


_PILLOW_INIT = threading.Lock()
_pillow_ready = False


def _pillow() -> Any:
    """Pillow's Image module, its format plugins registered once, under a lock: `Image.open`
    with `formats` registers them lazily, and two threads doing it at once (the warm-up's
    image on the executor, a request's in a worker thread) once left one of them an image
    whose pixels would not decode."""
    global _pillow_ready
    from PIL import Image

    if not _pillow_ready:
        with _PILLOW_INIT:
            if not _pillow_ready:
                Image.init()
                _pillow_ready = True
    return Image


def _opened(data: bytes, where: str, limits: ImageLimits) -> Any:
    """`data` opened by Pillow (lazily: the header read, no pixel decoded) as one of
    FORMATS, its bytes and its size checked against `limits`: a `PIL.Image.Image` to close.
    Raises ImageError."""
    if len(data) > limits.max_bytes:
        raise ImageError(
            f"{where} is {len(data):,} bytes: images of at most {limits.max_bytes:,} bytes "
            "are served (max_image_bytes)",
            param=where,
            code="image_too_large",
        )
    try:
        Image = _pillow()
    except ImportError:  # pragma: no cover - the vision extra brings Pillow
        raise ImageError(
            "images need Pillow: pip install 'stepline[vision]'", param=where
        ) from None
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(
            f"{where} has more pixels than Pillow decodes (a decompression bomb): images of "
            f"at most {limits.max_pixels:,} pixels are served (max_image_pixels)",
            param=where,
            code="image_too_large",
        ) from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for a corrupt header
        log.info("image_unreadable", where=where, error=f"{type(exc).__name__}: {exc}")
        what, code = _what(data)
        raise ImageError(
            f"{where} is {what}: send a PNG, JPEG, WebP or GIF image", param=where, code=code
        ) from None
    if img.format not in _MEDIA_TYPES or img.width * img.height > limits.max_pixels:
        img.close()
        if img.format not in _MEDIA_TYPES:  # pragma: no cover - FORMATS' plugins only
            raise ImageError(f"{where} is a {img.format} file: send PNG, JPEG, WebP or GIF")
        raise _too_many_pixels(where, img.width, img.height, limits)
    return img


def _too_many_pixels(where: str, width: int, height: int, limits: ImageLimits) -> ImageError:
    return ImageError(
        f"{where} is {width}x{height} pixels: images of at most "
        f"{limits.max_pixels:,} pixels are served (max_image_pixels)",
        param=where,
        code="image_too_large",
    )


def _what(data: bytes) -> tuple[str, str]:
    """What `data` is, and the error's code, for a file none of FORMATS' readers took."""
    for magic, name in _OTHER_FORMATS:
        if data.startswith(magic):
            return f"{name} file, a format this server does not read", "unsupported_image_format"
    return "not an image this server can read (corrupt, or a format it does not read)", (
        "invalid_image"
    )
