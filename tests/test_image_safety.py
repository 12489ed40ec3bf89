"""Hostile images cost the server nothing past its limits: only PNG, JPEG, WebP and GIF are
read (an ICO holding a huge PNG is refused from its first bytes, never decoded), a pixel count
is checked from the header before any pixel is decoded, a decompression bomb is
`image_too_large`, Pillow's own words never reach the client, a named media type must be the
bytes' own, and the decoded pixels the whole server holds are bounded (`PixelBudget`) and
dropped once the encoder's inputs are made."""

from __future__ import annotations

import base64
import io
import struct

import anyio
import pytest
from PIL import Image, ImageFile

from stepline.api.anthropic import schema as anthropic_schema
from stepline.api.config import ServerConfig
from stepline.api.openai.schema import ChatCompletionRequest
from stepline.api.pipeline.errors import known_error
from stepline.api.pipeline.images import (
    ImageOptions,
    ImagesBusyError,
    PixelBudget,
    resolve_images,
)
from stepline.engine.images import ImageError, ImageLimits, decode_image, read_header
from stepline.engine.media import place


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    return buf.getvalue()


def ico_holding(inner_png: bytes) -> bytes:
    """An ICO whose one entry is `inner_png` (its header says 256x256, whatever the PNG is)."""
    entry = struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(inner_png), 6 + 16)
    return struct.pack("<HHH", 0, 1, 1) + entry + inner_png


SMALL = Image.new("RGB", (6, 4), (10, 200, 30))
PNG = encoded(SMALL, "PNG")


def user_with(data: bytes, media: str = "image/png") -> list[dict]:
    url = f"data:{media};base64,{base64.b64encode(data).decode()}"
    part = {"type": "image_url", "image_url": {"url": url}}
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [part]}]}
    ).engine_messages()


def anthropic_with(data: bytes, media_type: str) -> list[dict]:
    source = {"type": "base64", "media_type": media_type, "data": base64.b64encode(data).decode()}
    block = {"type": "image", "source": source}
    return anthropic_schema.engine_messages(
        anthropic_schema.MessagesRequest.model_validate(
            {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [block]}]}
        )
    )


async def refused(messages: list[dict], opts: ImageOptions | None = None) -> ImageError:
    with pytest.raises(ImageError) as caught:
        await resolve_images(messages, opts or ImageOptions(accepts_images=True))
    return caught.value


@pytest.fixture
def no_pixel_decoded(monkeypatch):
    """Fails the test if Pillow decodes any pixel."""

    def load(self):
        raise AssertionError(f"a {self.format} image was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)


# -- formats ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_the_four_formats_the_docs_list_are_read(fmt):
    image = decode_image(encoded(SMALL, fmt), where="x")
    assert (image.width, image.height) == (6, 4) and image.pixels.mode == "RGB"
    assert image.media_type == f"image/{fmt.lower()}"


def test_an_ico_holding_a_huge_png_is_refused_before_any_pixel_is_decoded(no_pixel_decoded):
    bomb = ico_holding(encoded(Image.new("L", (3000, 3000)), "PNG"))
    with pytest.raises(ImageError):  # Pillow imports its plugins at its first refusal
        read_header(b"junk", where="warm")
    with pytest.raises(ImageError) as err:  # no_pixel_decoded: the header's bytes only
        decode_image(bomb, where="messages.0.content.0")
    assert err.value.code == "unsupported_image_format"
    assert "ICO" in err.value.message and "PNG, JPEG, WebP or GIF" in err.value.message


@pytest.mark.parametrize("fmt", ["TIFF", "BMP", "ICO", "PCX", "SGI", "PPM", "TGA"])
def test_formats_the_docs_do_not_list_are_refused_undecoded(fmt, no_pixel_decoded):
    with pytest.raises(ImageError) as err:
        decode_image(encoded(SMALL, fmt), where="x")
    assert err.value.code in ("unsupported_image_format", "invalid_image")
    if fmt in ("TIFF", "BMP", "ICO"):
        assert err.value.code == "unsupported_image_format" and fmt in err.value.message


def test_a_decompression_bomb_is_too_large_not_invalid(no_pixel_decoded):
    bomb = encoded(Image.new("1", (20000, 20000)), "PNG")  # 400 Mpixels in ~50 KB
    assert len(bomb) < 100_000
    with pytest.raises(ImageError) as err:
        decode_image(bomb, where="x", limits=ImageLimits(max_pixels=10**12))
    assert err.value.code == "image_too_large" and "max_image_pixels" in err.value.message
    with pytest.raises(ImageError) as err:
        read_header(bomb, where="x")
    assert err.value.code == "image_too_large"


def test_the_pixel_count_is_read_from_the_header_before_decoding(no_pixel_decoded):
    big = encoded(Image.new("L", (300, 200)), "PNG")
    header = read_header(big, where="x")
    assert (header.width, header.height, header.media_type) == (300, 200, "image/png")
    with pytest.raises(ImageError) as err:
        decode_image(big, where="x", limits=ImageLimits(max_pixels=300 * 200 - 1))
    assert err.value.code == "image_too_large" and "300x200" in err.value.message


@pytest.mark.parametrize(
    "data",
    [PNG[: len(PNG) // 2], b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, b"GIF89a junk", b"\xff\xd8\xff"],
    ids=["truncated-png", "bad-png-header", "bad-gif", "bare-jpeg-marker"],
)
async def test_pillow_s_own_words_never_reach_the_client(data):
    err = await refused(user_with(data))
    assert err.code == "invalid_image"
    for leak in ("0x", "BytesIO", "PIL", "Error:", "cannot identify"):
        assert leak not in err.message


# -- a media type named by the client (Anthropic) ---------------------------------------------


async def test_an_anthropic_media_type_must_be_the_bytes_own():
    jpeg = encoded(SMALL, "JPEG")
    err = await refused(anthropic_with(jpeg, "image/png"))
    assert err.code == "invalid_image" and "image/jpeg" in err.message
    assert err.param is not None
    [message] = await resolve_images(anthropic_with(jpeg, "image/jpeg"), ImageOptions(True))
    assert message["content"][0]["image"].media_type == "image/jpeg"


async def test_an_anthropic_media_type_outside_the_four_is_refused(no_pixel_decoded):
    err = await refused(anthropic_with(encoded(SMALL, "TIFF"), "image/tiff"))
    assert err.code == "invalid_image" and "image/tiff" in err.message


# -- the server's budget of decoded pixels ----------------------------------------------------


async def test_the_budget_lets_images_in_while_they_fit_first_come_first_served():
    budget = PixelBudget(100, wait_s=10)
    order: list[str] = []
    release = anyio.Event()

    async def image(name: str, n: int) -> None:
        async with budget.hold(n, name):
            order.append(name)
            await release.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(image, "a", 60)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(image, "big", 80)  # waits for a
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(image, "small", 10)  # would fit, but does not pass the big one
        await anyio.wait_all_tasks_blocked()
        assert order == ["a"] and budget.num_waiting == 2 and budget.in_use == 60
        release.set()
    assert order == ["a", "big", "small"] and budget.in_use == 0


async def test_an_image_that_waits_too_long_is_a_429_to_retry():
    budget = PixelBudget(100, wait_s=0.05)
    async with budget.hold(100, "first"):
        with pytest.raises(ImagesBusyError) as busy:
            async with budget.hold(1, "messages.0.content.0"):
                pass
    assert budget.in_use == 0 and budget.num_waiting == 0
    err = known_error(busy.value)
    assert err is not None and err.status_code == 429 and err.code == "images_busy"
    assert err.param == "messages.0.content.0" and "retry-after" in err.headers
    assert "max_image_pixels_in_flight" in err.message


async def test_a_cancelled_wait_gives_its_place_back():
    budget = PixelBudget(10, wait_s=10)
    async with budget.hold(10, "first"):
        with anyio.move_on_after(0.05):
            async with budget.hold(5, "second"):
                pass
        assert budget.num_waiting == 0 and budget.in_use == 10
    assert budget.in_use == 0


async def test_an_image_larger_than_the_budget_takes_the_whole_budget():
    budget = PixelBudget(10, wait_s=10)
    async with budget.hold(50, "x"):
        assert budget.in_use == 10


async def test_resolved_images_are_counted_while_decoded_and_dropped_once_expanded():
    budget = PixelBudget(6 * 4, wait_s=10)
    seen: list[int] = []

    def expand(image):
        seen.append(budget.in_use)
        assert image.pixels is not None
        return ("inputs of", image.digest)

    opts = ImageOptions(accepts_images=True, expand=expand, budget=budget)
    [message] = await resolve_images(user_with(PNG), opts)
    image = message["content"][0]["image"]
    assert seen == [24] and budget.in_use == 0  # held while decoded, given back after
    assert image.pixels is None and image.expanded == ("inputs of", image.digest)


def test_a_placed_image_keeps_its_bytes_not_its_pixels():
    class Expanded:
        text, inputs, units, whole = "<img>", {"pixel_values": None}, 1, True

    class Tokenizer:
        def encode(self, text, add_special_tokens=False):
            return [7, 7]

    image = decode_image(PNG, where="x")
    ids, placed = place(Expanded(), image, Tokenizer(), 3)
    assert ids == [7, 7] and (placed.start, placed.end) == (3, 5)
    assert placed.image.pixels is None and placed.image.data == PNG
    assert placed.digest == image.digest


def test_the_budget_must_hold_the_largest_image():
    assert ServerConfig().max_image_pixels_in_flight >= ServerConfig().max_image_pixels
    with pytest.raises(ValueError, match="max_image_pixels_in_flight"):
        ServerConfig(max_image_pixels=1000, max_image_pixels_in_flight=999)
