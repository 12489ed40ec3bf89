"""The images of a request, from what a door received to checked, decoded data: the one path
under every door. No MLX.

A door's schema turns each image part into a placeholder, `{"type": "image", "source":
ImageSource}` (`image_part`), in the neutral messages' content parts; `resolve_images` then
replaces every placeholder with `{"type": "image", "image": ImageData}`, the part chat
templates of vision models render as their image placeholder. A message with no image keeps
its content as a string (`content_of`), so text models' prompts are unchanged.

Sources: data URLs (`data:image/png;base64,...`), base64 data (Anthropic's `base64` source,
Ollama's `images`), and http(s) URLs, fetched only when the server allows it
(`allow_image_urls`): a server that fetches any URL a client names reaches what the client
cannot, hosts on its own network included. Everything that can be checked without fetching
or decoding (the model reads images, how many there are, the URLs' schemes) is checked before
anything is fetched or decoded; decoding (Pillow, CPU) runs on a worker thread.

Memory: an image's header is read first (its size, no pixel decoded); its decoded pixels are
counted against the server's budget (`PixelBudget`, `--max-image-pixels-in-flight`) from
before they are decoded until the model's vision encoder has its inputs made from them
(`ImageOptions.expand`), when they are freed: a request holds one image's pixels at a time,
and the server no more than the budget (a request waits for room, 429 `images_busy` after
`PIXEL_WAIT_S`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import anyio

from stepline.api.pipeline.media import (
    check_encoded_size,
    decoded_base64,
    placeholders,
    resolved,
)
from stepline.engine.images import (
    IMAGE,
    ImageData,
    ImageError,
    ImageHeader,
    ImageLimits,
    decode_image,
    read_header,
    text_only,
)

MAX_REDIRECTS = 3  # an image URL's redirects followed
PIXEL_WAIT_S = 30.0  # most time an image waits for room in the server's pixel budget
_MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
_SHOWN_URL_CHARS = 120  # of a URL quoted in an error


@dataclass(frozen=True)
class ImageSource:
    """One image part as a door received it, not yet fetched or decoded: a `url` (`data:` or
    `http(s):`) or base64 `data`, and the request field it came from (`where`, as errors
    name it: `messages.0.content.1`)."""

    where: str
    url: str | None = field(default=None, repr=False)  # a data URL holds the whole image
    data: str | None = field(default=None, repr=False)  # base64
    media_type: str | None = None  # of `data`, as the client said (Anthropic)


@dataclass(frozen=True)
class ImageOptions:
    """How a server takes images (ServerConfig's image options, and whether its model reads
    images at all)."""

    accepts_images: bool = False  # the model reads images (`Engine.accepts_images`)
    allow_urls: bool = False  # fetch http(s) image URLs
    fetch_timeout_s: float = 10.0  # most time one image URL's fetch takes, redirects included
    limits: ImageLimits = ImageLimits()
    # the model's vision encoder inputs of a decoded image (its family's `expand`,
    # `engine/vision/`): made as soon as it is decoded, and its pixels dropped; None: the
    # pixels are kept
    expand: Callable[[ImageData], Any] | None = field(default=None, compare=False)
    budget: PixelBudget | None = field(default=None, compare=False)  # the server's, shared


class ImagesBusyError(Exception):
    """An image waited `PIXEL_WAIT_S` for room in the server's pixel budget: the server is
    decoding as many images as it may; retry after `retry_after_s`."""

    def __init__(self, where: str, num_pixels: int, capacity: int, waited_s: float):
        super().__init__(
            f"{where} ({num_pixels:,} pixels) waited {waited_s:g} s for room: the server is "
            f"decoding as many images as it may at once ({capacity:,} pixels, "
            "max_image_pixels_in_flight)"
        )
        self.param = where
        self.retry_after_s = max(1.0, waited_s / 10)


class PixelBudget:
    """The server's decoded image pixels in flight, at most `capacity`, shared by every model
    and request: an image holds its pixels from before it is decoded until its encoder inputs
    are made (`hold`). First come, first served: a large image waiting is not passed by small
    ones. An event-loop object (no thread touches it)."""

    def __init__(self, capacity: int, wait_s: float = PIXEL_WAIT_S):
        if capacity < 1:
            raise ValueError(f"the pixel budget must be at least 1 pixel, got {capacity}")
        self.capacity = capacity
        self.wait_s = wait_s
        self.in_use = 0
        self._waiting: deque[tuple[int, anyio.Event]] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @asynccontextmanager
    async def hold(self, num_pixels: int, where: str) -> AsyncIterator[None]:
        """Hold `num_pixels` of the budget (the whole budget at most) while the body runs,
        waiting for room first. Raises ImagesBusyError after `wait_s` without room."""
        n = min(num_pixels, self.capacity)
        if self._waiting or self.in_use + n > self.capacity:
            await self._wait(n, num_pixels, where)
        else:
            self.in_use += n
        try:
            yield
        finally:
            self.in_use -= n
            self._grant()

    async def _wait(self, n: int, num_pixels: int, where: str) -> None:
        granted = anyio.Event()
        entry = (n, granted)
        self._waiting.append(entry)
        try:
            with anyio.move_on_after(self.wait_s):
                await granted.wait()
        except BaseException:  # cancelled: give back what was granted meanwhile
            if granted.is_set():
                self.in_use -= n
            else:
                self._waiting.remove(entry)
            self._grant()
            raise
        if not granted.is_set():
            self._waiting.remove(entry)
            self._grant()
            raise ImagesBusyError(where, num_pixels, self.capacity, self.wait_s)

    def _grant(self) -> None:
        while self._waiting and self.in_use + self._waiting[0][0] <= self.capacity:
            n, granted = self._waiting.popleft()
            self.in_use += n
            granted.set()


def image_part(source: ImageSource) -> dict[str, Any]:
    """The placeholder of an image part in neutral content, until `resolve_images`."""
    return {"type": "image", "source": source}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def content_of(parts: Sequence[dict[str, Any]], sep: str = "\n") -> str | list[dict[str, Any]]:
    """A message's neutral content from its parts, in order (`text_part`s and `image_part`s):
    the texts joined by `sep` where it has no image or audio (what text models' templates
    render, as before images were served), else the parts."""
    if any(p["type"] in ("image", "audio") for p in parts):
        return list(parts)
    return sep.join(p["text"] for p in parts)


def joined_content(contents: Sequence[str | list[dict[str, Any]]], sep: str) -> Any:
    """Several contents as one message's (consecutive messages of a role merged): strings
    joined by `sep`; with images, the parts of all in order."""
    if all(isinstance(c, str) for c in contents):
        return sep.join(contents)  # type: ignore[arg-type]
    parts: list[dict[str, Any]] = []
    for c in contents:
        parts.extend([text_part(c)] if isinstance(c, str) else c)
    return parts


async def resolve_images(
    messages: list[dict[str, Any]], options: ImageOptions
) -> list[dict[str, Any]]:
    """`messages` with each image placeholder (`image_part`) replaced by `{"type": "image",
    "image": ImageData}`; messages without images are returned as they are (`messages` is not
    changed). Before anything is fetched or decoded: refused if the model reads text only,
    or for more images than `options.limits.max_images`, and every source is checked.

    Raises ImageError (`param`: the part's field; `code`: what is wrong) for an image the
    model cannot read (`unsupported_content_type`), too many images (`too_many_images`), a
    URL that is not fetched (`image_url_not_allowed`, `invalid_image_url`), one whose fetch
    failed or took too long (`image_fetch_failed`, `image_fetch_timeout`), bytes or pixels
    past the limits (`image_too_large`), and bytes that are no image (`invalid_image`)."""
    sources = placeholders(messages, IMAGE, ImageSource)
    if not sources:
        return messages
    if not options.accepts_images:
        raise text_only(sources[0].where)
    limit = options.limits.max_images
    if len(sources) > limit:
        raise IMAGE.too_many(len(sources), limit, sources[limit].where)
    for source in sources:
        _check(source, options)
    async with _Fetcher(options) as fetcher:
        images = iter([await _image(source, options, fetcher) for source in sources])
    return [resolved(m, IMAGE, ImageSource, images) for m in messages]


def _check(source: ImageSource, options: ImageOptions) -> None:
    """What can be said of `source` without fetching or decoding it."""
    where = source.where
    if source.url is None:
        if source.media_type is not None and source.media_type.lower() not in _MEDIA_TYPES:
            raise ImageError(
                f"{where} has media type {_shown(source.media_type)!r}: send an image as "
                "image/png, image/jpeg, image/webp or image/gif",
                param=where,
            )
        return
    scheme, colon, _ = source.url.partition(":")
    scheme = scheme.lower() if colon else ""
    if scheme == "data":
        _data_url(source.url, where)
    elif scheme in ("http", "https"):
        if not options.allow_urls:
            raise ImageError(
                f"{where} is an image URL: this server does not fetch image URLs; send the "
                "image as a data URL (data:image/png;base64,...), or start the server with "
                "--allow-image-urls",
                param=where,
                code="image_url_not_allowed",
            )
    else:
        raise ImageError(
            f"{where} is a {scheme or 'schemeless'!r} URL: send a data URL "
            "(data:image/png;base64,...) or an http(s) URL",
            param=where,
            code="invalid_image_url",
        )


def _data_url(url: str, where: str) -> str:
    """The base64 payload of data URL `url`. Raises ImageError for one that is not a
    base64-encoded image."""
    header, sep, payload = url[len("data:") :].partition(",")
    params = [p.strip().lower() for p in header.split(";")]
    if not sep or not params[0].startswith("image/") or "base64" not in params[1:]:
        what = params[0] or "no media type"
        raise ImageError(
            f"{where} is not a base64 image data URL ({what}): send "
            "data:image/png;base64,... (or image/jpeg, image/webp, image/gif)",
            param=where,
        )
    return payload


async def _image(source: ImageSource, options: ImageOptions, fetcher: _Fetcher) -> ImageData:
    """`source` fetched or decoded from base64, its header read and checked, then decoded
    within the server's pixel budget and, where the model's encoder is known, made into its
    inputs at once (the pixels dropped)."""
    where, limits = source.where, options.limits
    if source.url is not None and source.url[:5].lower() != "data:":
        data = await fetcher.fetch(source.url, where)
        header = await anyio.to_thread.run_sync(_header, data, source, limits)
    else:
        text = _data_url(source.url, where) if source.url is not None else source.data or ""
        check_encoded_size(IMAGE, text, where, limits.max_bytes)
        data, header = await anyio.to_thread.run_sync(_decoded_header, text, source, limits)
    budget = options.budget
    held = nullcontext() if budget is None else budget.hold(header.num_pixels, where)
    async with held:
        return await anyio.to_thread.run_sync(_decoded, data, where, options)


def _decoded_header(
    text: str, source: ImageSource, limits: ImageLimits
) -> tuple[bytes, ImageHeader]:
    data = decoded_base64(IMAGE, text, source.where)
    return data, _header(data, source, limits)


def _header(data: bytes, source: ImageSource, limits: ImageLimits) -> ImageHeader:
    """`data`'s header (`read_header`), its format the one the client named, if it did."""
    header = read_header(data, where=source.where, limits=limits)
    named = source.media_type
    if named is not None and named.lower() != header.media_type:
        raise ImageError(
            f"{source.where} has media type {named!r} but its bytes are {header.media_type}: "
            "name the image's own format",
            param=source.where,
        )
    return header


def _decoded(data: bytes, where: str, options: ImageOptions) -> ImageData:
    image = decode_image(data, where=where, limits=options.limits)
    return image if options.expand is None else image.with_inputs(options.expand(image))


def _shown(url: str) -> str:
    return url if len(url) <= _SHOWN_URL_CHARS else url[:_SHOWN_URL_CHARS] + "..."


class _Fetcher:
    """Fetches image URLs for one request: an HTTP client opened at the first URL."""

    def __init__(self, options: ImageOptions):
        self.options = options
        self._client: Any = None

    async def __aenter__(self) -> _Fetcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def fetch(self, url: str, where: str) -> bytes:
        """The body of `url`, within the byte and time limits. Raises ImageError."""
        import httpx  # the `openai` and `anthropic` packages bring it; only fetching needs it

        timeout = self.options.fetch_timeout_s
        if self._client is None:
            self._client = httpx.AsyncClient(
                follow_redirects=True, max_redirects=MAX_REDIRECTS, timeout=timeout
            )
        try:
            with anyio.fail_after(timeout):  # the whole fetch: a trickled body too
                return await self._download(url, where)
        except (TimeoutError, httpx.TimeoutException):
            problem = f"did not arrive within {timeout:g} s (image_fetch_timeout_s)"
            code = "image_fetch_timeout"
        except httpx.TooManyRedirects:
            problem, code = f"was redirected more than {MAX_REDIRECTS} times", "image_fetch_failed"
        except httpx.UnsupportedProtocol:
            problem, code = "was redirected to a URL that is not http(s)", "image_fetch_failed"
        except httpx.HTTPError as exc:
            problem, code = f"could not be fetched ({type(exc).__name__})", "image_fetch_failed"
        raise ImageError(f"{where}: the image at {_shown(url)} {problem}", param=where, code=code)

    async def _download(self, url: str, where: str) -> bytes:
        max_bytes = self.options.limits.max_bytes
        async with self._client.stream("GET", url) as response:
            if not response.is_success:
                raise ImageError(
                    f"{where}: fetching the image at {_shown(url)} was answered "
                    f"{response.status_code} {response.reason_phrase}".rstrip(),
                    param=where,
                    code="image_fetch_failed",
                )
            length = response.headers.get("content-length", "")
            if length.isdigit() and int(length) > max_bytes:
                raise IMAGE.too_large(where, max_bytes)
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise IMAGE.too_large(where, max_bytes)
                chunks.append(chunk)
        return b"".join(chunks)
