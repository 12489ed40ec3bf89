"""Images in requests: what each door accepts, and the one path under the doors that fetches,
checks and decodes them (`api/pipeline/images.py`).

`resolve_images` is tested on its own, with a server setting that reads images; image URLs
are fetched from a small HTTP server on 127.0.0.1. The doors are driven over real HTTP with
the official clients, on the text demo model: there, every image is refused, before anything
is fetched or decoded."""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.server
import io
import struct
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import anthropic
import anyio
import httpx
import ollama
import openai
import pytest
import pytest_asyncio
from helpers import Served, hold_open, open_served
from PIL import Image

from stepline.api.anthropic import schema as anthropic_schema
from stepline.api.cli.flags import options
from stepline.api.cli.serve import add_serve_parser
from stepline.api.config import ServerConfig
from stepline.api.ollama.schema import ChatRequest, GenerateRequest
from stepline.api.openai.schema import ChatCompletionRequest
from stepline.api.params import SamplingParams as engine_params
from stepline.api.pipeline.errors import known_error
from stepline.api.pipeline.images import ImageOptions, resolve_images
from stepline.api.responses.schema import ResponsesRequest
from stepline.engine.images import ImageData, ImageError, ImageLimits

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "stepline-demo"
READS_IMAGES = ImageOptions(accepts_images=True)
FETCHES = ImageOptions(accepts_images=True, allow_urls=True)


def png(width: int = 3, height: int = 2) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 10)).save(buf, "PNG")
    return buf.getvalue()


PNG = png()
# A picture the vision demo cuts into tiles (random pixels: 150 x 100).
_pixels = Image.frombytes("RGB", (150, 100), bytes((i * 7919) % 251 for i in range(150 * 100 * 3)))
_buf = io.BytesIO()
_pixels.save(_buf, "PNG")
PICTURE = _buf.getvalue()
PNG_B64 = base64.b64encode(PNG).decode()


def _ico_holding(inner_png: bytes) -> bytes:
    """An ICO whose one entry is `inner_png`: its header says 256 x 256, whatever the PNG is."""
    entry = struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(inner_png), 6 + 16)
    return struct.pack("<HHH", 0, 1, 1) + entry + inner_png


_big = io.BytesIO()
Image.new("L", (4000, 4000)).save(_big, "PNG")
ICO_BOMB = _ico_holding(_big.getvalue())  # 16 Mpixels in ~16 KB
DATA_URL = f"data:image/png;base64,{PNG_B64}"


def user(*parts: dict) -> list[dict]:
    """One user message with content `parts` (OpenAI's shape)."""
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": list(parts)}]}
    ).engine_messages()


def image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


async def refused(messages: list[dict], opts: ImageOptions = READS_IMAGES) -> ImageError:
    with pytest.raises(ImageError) as caught:
        await resolve_images(messages, opts)
    return caught.value


# -- a local image host ---------------------------------------------------------------------


@dataclass
class ImageHost:
    """An HTTP server on 127.0.0.1 serving images, and misbehaving on request."""

    url: str
    hits: list[str] = field(default_factory=list)  # paths requested, in order


@pytest.fixture(scope="module")
def host() -> Iterator[ImageHost]:
    release = threading.Event()  # set at the end: stalled answers return
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            hits.append(self.path)
            try:
                self.answer()
            except OSError:
                pass  # the fetcher gave up and hung up (a stall, a body past the limit)

        def send(self, status: int, body: bytes = b"", **headers: str) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name.replace("_", "-"), value)
            self.end_headers()
            self.wfile.write(body)

        def answer(self) -> None:
            path = self.path
            if path == "/cat.png":
                self.send(200, PNG, Content_Length=str(len(PNG)), Content_Type="image/png")
            elif path == "/picture.png":
                self.send(200, PICTURE, Content_Length=str(len(PICTURE)), Content_Type="image/png")
            elif path == "/icon.ico":
                self.send(200, ICO_BOMB, Content_Length=str(len(ICO_BOMB)))
            elif path == "/redirect":
                self.send(302, Location="/cat.png", Content_Length="0")
            elif path == "/loop":
                self.send(302, Location="/loop", Content_Length="0")
            elif path == "/to-file":
                self.send(302, Location="file:///etc/passwd", Content_Length="0")
            elif path == "/missing":
                self.send(404, b"no", Content_Length="2")
            elif path == "/says-large":
                self.send(200, Content_Length=str(10**9))
            elif path == "/unsized":  # no length: the body ends when the connection closes
                self.send(200)
                for _ in range(64):
                    self.wfile.write(b"x" * 1024)
            elif path == "/stall":  # the head, then nothing
                self.send(200, Content_Length="100")
                self.wfile.flush()
                release.wait()
            elif path == "/trickle":  # a byte now and then, never done
                self.send(200, Content_Length="100000")
                while not release.wait(0.02):
                    self.wfile.write(b"x")
                    self.wfile.flush()
            else:
                self.send(404, Content_Length="0")

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield ImageHost(f"http://127.0.0.1:{server.server_address[1]}", hits)
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join()


# -- the neutral messages -------------------------------------------------------------------


async def test_a_message_without_images_keeps_its_content_as_a_string():
    messages = user({"type": "text", "text": "a"}, {"type": "text", "text": "b"})
    assert messages == [{"role": "user", "content": "a\nb"}]
    assert await resolve_images(messages, READS_IMAGES) is messages


async def test_a_data_url_becomes_decoded_image_data_among_the_text_in_order():
    messages = user({"type": "text", "text": "what is"}, image_url(DATA_URL))
    [message] = await resolve_images(messages, READS_IMAGES)
    text, image = message["content"]
    assert text == {"type": "text", "text": "what is"}
    assert image["type"] == "image"
    data = image["image"]
    assert isinstance(data, ImageData)
    assert data.digest == hashlib.sha256(PNG).hexdigest()
    assert (data.width, data.height, data.media_type) == (3, 2, "image/png")
    assert data.pixels.mode == "RGB"


def neutral(messages: list[dict]) -> list[tuple[str, list[str] | str]]:
    """(role, the content's part types, or its text) of each message."""
    return [
        (m["role"], [p["type"] for p in m["content"]])
        if isinstance(m["content"], list)
        else (m["role"], m["content"])
        for m in messages
    ]


async def test_every_door_puts_its_image_parts_where_they_were_sent():
    openai_messages = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, image_url(DATA_URL)]},
                {"role": "user", "content": [{"type": "image_url", "image_url": DATA_URL}]},
            ]
        }
    ).engine_messages()  # consecutive user turns merge: their parts in order
    b64 = {"type": "base64", "media_type": "image/png", "data": PNG_B64}
    anthropic_messages = anthropic_schema.engine_messages(
        anthropic_schema.MessagesRequest.model_validate(
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f"}],
                    },
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [{"type": "image", "source": b64}],
                            },
                            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                            {"type": "text", "text": "and this?"},
                        ],
                    },
                ],
            }
        )
    )
    responses_messages = ResponsesRequest.model_validate(
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": DATA_URL, "detail": "auto"},
                        {"type": "input_text", "text": "a"},
                    ],
                }
            ]
        }
    ).messages()
    ollama_messages = ChatRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "a", "images": [PNG_B64]}]}
    ).engine_messages()
    _, generate_messages = GenerateRequest.model_validate(
        {"model": MODEL, "prompt": "a", "images": [PNG_B64]}
    ).engine_input()

    assert neutral(openai_messages) == [("user", ["text", "image", "image"])]
    assert neutral(anthropic_messages) == [
        ("assistant", ""),
        ("tool", ["image"]),
        ("user", ["image", "text"]),
    ]
    assert neutral(responses_messages) == [("user", ["image", "text"])]
    assert neutral(ollama_messages) == neutral(generate_messages) == [("user", ["image", "text"])]
    resolved = await resolve_images(ollama_messages, READS_IMAGES)
    assert resolved[0]["content"][0]["image"].digest == hashlib.sha256(PNG).hexdigest()


async def test_an_image_sent_as_a_file_is_refused_naming_the_part():
    request = ResponsesRequest.model_validate(
        {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}
    )
    with pytest.raises(Exception, match="keeps no files") as caught:
        request.messages()
    assert caught.value.param == "input.0.content.0.file_id"


# -- what resolve_images refuses ------------------------------------------------------------


async def test_an_image_to_a_text_only_model_is_refused_before_it_is_fetched(host):
    messages = user({"type": "text", "text": "a"}, image_url(f"{host.url}/cat.png"))
    before = len(host.hits)
    err = await refused(messages, ImageOptions(accepts_images=False, allow_urls=True))
    assert err.code == "unsupported_content_type"
    assert err.param == "messages.0.content.1"
    assert "reads text only" in err.message
    assert len(host.hits) == before


async def test_corrupt_bytes_are_an_invalid_image_naming_the_part():
    corrupt = base64.b64encode(b"\x89PNG\r\n\x1a\n not really").decode()
    err = await refused(user(image_url(f"data:image/png;base64,{corrupt}")))
    assert (err.code, err.param) == ("invalid_image", "messages.0.content.0")
    truncated = base64.b64encode(PNG[: len(PNG) // 2]).decode()
    assert (await refused(user(image_url(f"data:image/png;base64,{truncated}")))).code == (
        "invalid_image"
    )


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,not base64!",
        "data:text/plain;base64,aGVsbG8=",
        "data:image/png,rawbytes",
        "data:image/png;base64",
    ],
)
async def test_a_malformed_data_url_is_refused_naming_the_part(url):
    err = await refused(user({"type": "text", "text": "a"}, image_url(url)))
    assert err.param == "messages.0.content.1"
    assert err.code == "invalid_image"


async def test_base64_wrapped_over_lines_is_read():
    wrapped = "\n".join(PNG_B64[i : i + 76] for i in range(0, len(PNG_B64), 76))
    [message] = await resolve_images(
        user(image_url(f"data:image/png;base64,{wrapped}")), READS_IMAGES
    )
    assert message["content"][0]["image"].digest == hashlib.sha256(PNG).hexdigest()


async def test_more_images_than_the_limit_are_refused_before_any_is_decoded():
    corrupt = image_url("data:image/png;base64,AAAA")  # decoded, it would be invalid_image
    opts = ImageOptions(accepts_images=True, limits=ImageLimits(max_images=2))
    err = await refused(user(corrupt, corrupt, corrupt), opts)
    assert err.code == "too_many_images"
    assert "3 images" in err.message and "at most 2" in err.message
    assert err.param == "messages.0.content.2"


async def test_an_image_past_the_byte_limit_is_refused():
    opts = ImageOptions(accepts_images=True, limits=ImageLimits(max_bytes=len(PNG) - 1))
    err = await refused(user(image_url(DATA_URL)), opts)
    assert err.code == "image_too_large"
    assert "max_image_bytes" in err.message
    big = ImageOptions(accepts_images=True, limits=ImageLimits(max_bytes=100))
    huge = "data:image/png;base64," + "A" * 10_000  # refused by its length, never decoded
    assert (await refused(user(image_url(huge)), big)).code == "image_too_large"


async def test_an_image_past_the_pixel_limit_is_refused():
    wide = base64.b64encode(png(40, 30)).decode()
    opts = ImageOptions(accepts_images=True, limits=ImageLimits(max_pixels=40 * 30 - 1))
    err = await refused(user(image_url(f"data:image/png;base64,{wide}")), opts)
    assert err.code == "image_too_large"
    assert "40x30" in err.message and "max_image_pixels" in err.message


async def test_an_image_error_is_a_400_that_keeps_its_param_and_code():
    err = known_error(ImageError("bad", param="messages.0.content.1", code="invalid_image"))
    assert err is not None
    assert (err.status_code, err.param, err.code) == (400, "messages.0.content.1", "invalid_image")


# -- image URLs -----------------------------------------------------------------------------


async def test_an_image_url_is_refused_when_the_server_does_not_fetch(host):
    before = len(host.hits)
    err = await refused(user(image_url(f"{host.url}/cat.png")))
    assert err.code == "image_url_not_allowed"
    assert "data URL" in err.message and "--allow-image-urls" in err.message
    assert len(host.hits) == before


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "cat.png"])
async def test_urls_of_other_schemes_are_refused_even_when_fetching(url):
    err = await refused(user(image_url(url)), FETCHES)
    assert (err.code, err.param) == ("invalid_image_url", "messages.0.content.0")


async def test_an_image_url_is_fetched_when_allowed_redirects_followed(host):
    messages = user(image_url(f"{host.url}/cat.png"), image_url(f"{host.url}/redirect"))
    [message] = await resolve_images(messages, FETCHES)
    digests = {part["image"].digest for part in message["content"]}
    assert digests == {hashlib.sha256(PNG).hexdigest()}


@pytest.mark.parametrize(
    ("path", "code", "says"),
    [
        ("/missing", "image_fetch_failed", "404"),
        ("/loop", "image_fetch_failed", "redirected more than"),
        ("/to-file", "image_fetch_failed", "not http(s)"),
        ("/says-large", "image_too_large", "max_image_bytes"),
        ("/unsized", "image_too_large", "max_image_bytes"),  # counted as it arrives
    ],
)
async def test_a_fetch_that_fails_or_is_too_large_is_refused(host, path, code, says):
    opts = ImageOptions(accepts_images=True, allow_urls=True, limits=ImageLimits(max_bytes=4096))
    err = await refused(user(image_url(f"{host.url}{path}")), opts)
    assert (err.code, err.param) == (code, "messages.0.content.0")
    assert says in err.message


@pytest.mark.parametrize("path", ["/stall", "/trickle"])
async def test_a_fetch_that_takes_too_long_is_refused_at_the_time_limit(host, path):
    opts = ImageOptions(accepts_images=True, allow_urls=True, fetch_timeout_s=0.3)
    with anyio.fail_after(10):  # the limit cuts it, not the test
        err = await refused(user(image_url(f"{host.url}{path}")), opts)
    assert err.code == "image_fetch_timeout"
    assert "0.3 s" in err.message and "image_fetch_timeout_s" in err.message


# -- the options ----------------------------------------------------------------------------


async def test_the_image_options_are_flags_of_stepline_serve():
    sub = argparse.ArgumentParser().add_subparsers()
    args = add_serve_parser(sub).parse_args(
        ["--allow-image-urls", "--image-fetch-timeout-s", "2.5", "--max-image-bytes", "1000"]
        + ["--max-image-pixels", "4096", "--max-images-per-request", "3"]
    )
    config = ServerConfig(**options(args, ServerConfig))
    assert config.allow_image_urls and config.image_fetch_timeout_s == 2.5
    assert (config.max_image_bytes, config.max_image_pixels) == (1000, 4096)
    assert config.max_images_per_request == 3
    assert not ServerConfig().allow_image_urls  # off unless asked for


# -- the doors, on a text-only model --------------------------------------------------------


@pytest.fixture(scope="module")
def served_options() -> dict:
    # Fetching on: a text model still fetches nothing.
    return dict(allow_image_urls=True)


async def test_the_openai_door_refuses_images_to_a_text_model_before_fetching(served, host):
    before = len(host.hits)
    async with served.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=MODEL,
                max_tokens=4,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is in this picture?"},
                            {"type": "image_url", "image_url": {"url": f"{host.url}/cat.png"}},
                        ],
                    }
                ],
            )
    assert caught.value.code == "unsupported_content_type"
    assert caught.value.param == "messages.0.content.1"
    assert "reads text only" in caught.value.message
    assert len(host.hits) == before


async def test_the_responses_door_refuses_images_to_a_text_model_before_fetching(served, host):
    before = len(host.hits)
    async with served.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(
                model=MODEL,
                max_output_tokens=4,
                input=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is in this picture?"},
                            {
                                "type": "input_image",
                                "image_url": f"{host.url}/cat.png",
                                "detail": "auto",
                            },
                        ],
                    }
                ],
            )
    assert caught.value.code == "unsupported_content_type"
    assert caught.value.param == "input.0.content.1"
    assert len(host.hits) == before


async def test_the_anthropic_door_refuses_images_to_a_text_model_before_fetching(served, host):
    before = len(host.hits)
    content = [
        {"type": "image", "source": {"type": "url", "url": f"{host.url}/cat.png"}},
        {"type": "text", "text": "What is in this picture?"},
    ]
    messages = [{"role": "user", "content": content}]
    async with anthropic.AsyncAnthropic(base_url=served.url, api_key="k", max_retries=0) as c:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await c.messages.create(model=MODEL, max_tokens=4, messages=messages)
        with pytest.raises(anthropic.BadRequestError) as counted:
            await c.messages.count_tokens(model=MODEL, messages=messages)
    for err in (caught.value, counted.value):
        assert err.body["error"]["type"] == "invalid_request_error"
        assert "messages.0.content.0" in err.message and "reads text only" in err.message
    assert len(host.hits) == before


async def test_the_ollama_door_refuses_images_to_a_text_model_before_decoding(served):
    # Bytes that are no image: refused as images a text model cannot read, never decoded.
    junk = base64.b64encode(b"not an image").decode()
    async with ollama.AsyncClient(host=served.url) as c:
        with pytest.raises(ollama.ResponseError) as caught:
            await c.chat(
                model=MODEL, messages=[{"role": "user", "content": "hi", "images": [junk]}]
            )
        with pytest.raises(ollama.ResponseError) as generated:
            await c.generate(model=MODEL, prompt="hi", images=[junk])
    for err in (caught.value, generated.value):
        assert err.status_code == 400 and "reads text only" in err.error


async def test_a_text_request_is_served_as_before(served):
    async with served.client() as client:
        answer = await client.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        )
    assert answer.choices[0].finish_reason in ("stop", "length")


# -- the doors, on a model that reads images ------------------------------------------------

VISION = "stepline-demo-vision"
PICTURE_URL = "data:image/png;base64," + base64.b64encode(PICTURE).decode()
QUESTION = "What is in this picture?"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vision() -> AsyncIterator[Served]:
    value, close = await hold_open(open_served(VISION, allow_image_urls=True))
    try:
        yield value
    finally:
        await close()


async def test_every_door_answers_an_image_as_the_python_api_does(vision, host):
    engine = vision.engine
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": QUESTION}, {"type": "image", "image": PICTURE}],
        }
    ]
    prepared = engine.prepare(messages=messages)
    assert prepared.images and prepared.images[0].end - prepared.images[0].start > 64
    want = ""
    async for out in engine.generate(
        messages=messages, params=engine_params(max_tokens=8, temperature=0.0)
    ):
        want += out.text
    openai_parts = [{"type": "text", "text": QUESTION}, image_url(PICTURE_URL)]
    fetched = [{"type": "text", "text": QUESTION}, image_url(f"{host.url}/picture.png")]
    async with vision.client() as client:
        for parts in (openai_parts, fetched):
            answer = await client.chat.completions.create(
                model=VISION,
                max_tokens=8,
                temperature=0.0,
                messages=[{"role": "user", "content": parts}],
            )
            assert answer.choices[0].message.content == want
            assert answer.usage is not None
            assert answer.usage.prompt_tokens == len(prepared.ids)
        response = await client.responses.create(
            model=VISION,
            max_output_tokens=8,
            temperature=0.0,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": QUESTION},
                        {"type": "input_image", "image_url": PICTURE_URL, "detail": "auto"},
                    ],
                }
            ],
        )
        assert response.output_text == want
    async with anthropic.AsyncAnthropic(
        base_url=vision.url, api_key="sk-one", max_retries=0
    ) as client:
        message = await client.messages.create(
            model=VISION,
            max_tokens=8,
            extra_body={"temperature": 0.0},
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": QUESTION},
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": base64.b64encode(PICTURE).decode(),
                            },
                        },
                    ],
                }
            ],
        )
        usage = message.usage  # the earlier doors' requests left the prompt in the cache
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == len(prepared.ids)
        assert "".join(b.text for b in message.content if b.type == "text") == want


async def test_a_corrupt_image_is_a_400_at_every_door_and_the_engine_serves_on(vision):
    broken = "data:image/png;base64," + base64.b64encode(PICTURE[: len(PICTURE) // 2]).decode()
    async with vision.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=VISION,
                max_tokens=4,
                messages=[{"role": "user", "content": [image_url(broken)]}],
            )
        assert caught.value.code == "invalid_image"
        assert caught.value.param == "messages.0.content.0"
    async with anthropic.AsyncAnthropic(
        base_url=vision.url, api_key="sk-one", max_retries=0
    ) as client:
        with pytest.raises(anthropic.BadRequestError) as refused_here:
            await client.messages.create(
                model=VISION,
                max_tokens=4,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": broken.split(",", 1)[1],
                                },
                            }
                        ],
                    }
                ],
            )
        assert refused_here.value.status_code == 400
    async with vision.client() as client:
        answer = await client.chat.completions.create(
            model=VISION, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert vision.engine.healthy


async def test_an_ico_bomb_is_refused_undecoded_at_every_door_count_tokens_and_url(
    vision, host, monkeypatch
):
    from PIL import ImageFile

    def load(self):
        raise AssertionError(f"a {self.format} image was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    b64 = base64.b64encode(ICO_BOMB).decode()
    data_url = f"data:image/png;base64,{b64}"
    anthropic_image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": b64},
    }
    requests = {
        "chat": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [image_url(data_url)]}]},
        ),
        "url": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [image_url(f"{host.url}/icon.ico")]}]},
        ),
        "responses": (
            "/v1/responses",
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": data_url}]}
                ]
            },
        ),
        "anthropic": (
            "/v1/messages",
            {"messages": [{"role": "user", "content": [anthropic_image]}]},
        ),
        "count_tokens": (
            "/v1/messages/count_tokens",
            {"messages": [{"role": "user", "content": [anthropic_image]}]},
        ),
        "ollama": (
            "/api/chat",
            {"messages": [{"role": "user", "content": "hi", "images": [b64]}], "stream": False},
        ),
    }
    async with httpx.AsyncClient(base_url=vision.url, timeout=60) as http:
        for door, (path, body) in requests.items():
            r = await http.post(path, json={"model": VISION, "max_tokens": 4, **body})
            assert r.status_code == 400, (door, r.text)
            assert "an ICO file" in r.text and "PNG, JPEG, WebP or GIF" in r.text, door
            if path.startswith("/v1/chat") or path == "/v1/responses":
                assert r.json()["error"]["code"] == "unsupported_image_format", door


async def test_ollamas_clients_see_a_vision_model_and_send_it_images(vision):
    async with ollama.AsyncClient(host=vision.url) as client:
        shown = await client.show(VISION)
        answer = await client.chat(
            model=VISION,
            messages=[{"role": "user", "content": QUESTION, "images": [PICTURE]}],
            options={"num_predict": 4, "temperature": 0},
        )
    assert "vision" in (shown.capabilities or [])
    assert answer.done_reason == "length" and answer.message.content
    assert answer.prompt_eval_count > 64  # the image's span is in the prompt
