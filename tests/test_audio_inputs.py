"""Audio in requests, over real HTTP with the official clients: OpenAI chat's and Responses'
`input_audio` parts answer what the Python API answers for the same clip; the Anthropic door,
whose API has no audio block, says so; a text model refuses audio before decoding it; the
limits (seconds, bytes, sample rate, clips per request) and bad bytes are 400s naming the
limit and the part. Real WAV bytes, written with the standard library (`test_audio.wav`), and
real FLAC and MP3 bytes, written with soundfile (libsndfile, in the test extra)."""

from __future__ import annotations

import argparse
import base64
from collections.abc import AsyncIterator

import anthropic
import openai
import pytest
import pytest_asyncio
from helpers import Served, hold_open, open_served
from test_audio import wav

from stepline.api.cli.flags import options
from stepline.api.cli.serve import add_serve_parser
from stepline.api.config import ServerConfig
from stepline.api.params import SamplingParams
from stepline.engine.models import AUDIO_DEMO

pytest.importorskip("mlx_vlm")
pytestmark = pytest.mark.asyncio(loop_scope="module")

QUESTION = "What is this sound?"
CLIP = wav(2.0)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def chat_parts(clip: bytes = CLIP, fmt: str = "wav", n: int = 1) -> list[dict]:
    audio = {"type": "input_audio", "input_audio": {"data": b64(clip), "format": fmt}}
    return [{"type": "text", "text": QUESTION}, *([audio] * n)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hearing() -> AsyncIterator[Served]:
    value, close = await hold_open(
        open_served(
            AUDIO_DEMO,
            max_audio_seconds=4.0,
            max_audios_per_request=2,
            max_audio_sample_rate=48_000,
        )
    )
    try:
        yield value
    finally:
        await close()


@pytest.fixture(scope="module")
def served_options() -> dict:
    return {}


async def test_openai_chat_and_responses_answer_a_clip_as_the_python_api_does(hearing):
    engine = hearing.engine
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": QUESTION}, {"type": "audio", "audio": CLIP}],
        }
    ]
    prepared = engine.prepare(messages=messages)
    want = ""
    async for out in engine.generate(
        messages=messages, params=SamplingParams(max_tokens=8, temperature=0.0)
    ):
        want += out.text
    assert want
    async with hearing.client() as client:
        answer = await client.chat.completions.create(
            model=AUDIO_DEMO,
            max_tokens=8,
            temperature=0.0,
            messages=[{"role": "user", "content": chat_parts()}],
        )
        assert answer.choices[0].message.content == want
        assert answer.usage is not None and answer.usage.prompt_tokens == len(prepared.ids)
        response = await client.responses.create(
            model=AUDIO_DEMO,
            max_output_tokens=8,
            temperature=0.0,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": QUESTION},
                        {
                            "type": "input_audio",
                            "input_audio": {"data": b64(CLIP), "format": "wav"},
                        },
                    ],
                }
            ],
        )
        assert response.output_text == want


async def test_an_audio_url_data_url_is_heard_as_input_audio_is_and_a_web_url_is_refused(
    hearing,
):
    url_part = {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{b64(CLIP)}"}}
    async with hearing.client() as client:
        answers = [
            await client.chat.completions.create(
                model=AUDIO_DEMO,
                max_tokens=6,
                temperature=0.0,
                messages=[{"role": "user", "content": parts}],
            )
            for parts in (chat_parts(), [chat_parts()[0], url_part])
        ]
        assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
        web = {"type": "audio_url", "audio_url": {"url": "https://example.com/clip.wav"}}
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=AUDIO_DEMO,
                max_tokens=4,
                messages=[{"role": "user", "content": [chat_parts()[0], web]}],
            )
    assert caught.value.code == "audio_url_not_allowed"
    assert caught.value.param == "messages.0.content.1"


@pytest.mark.parametrize("fmt", ["flac", "mp3"])
async def test_flac_and_mp3_clips_are_heard_through_the_chat_door(hearing, fmt):
    import io

    import numpy as np
    import soundfile

    t = np.arange(16_000) / 16_000
    out = io.BytesIO()
    soundfile.write(out, 0.3 * np.sin(2 * np.pi * 440 * t), 16_000, format=fmt.upper())
    async with hearing.client() as client:
        answer = await client.chat.completions.create(
            model=AUDIO_DEMO,
            max_tokens=4,
            temperature=0.0,
            messages=[{"role": "user", "content": chat_parts(out.getvalue(), fmt)}],
        )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.prompt_tokens > 12  # the clip's span


@pytest.mark.parametrize(
    ("parts", "code", "says"),
    [
        (chat_parts(wav(5.0)), "audio_too_long", "max_audio_seconds"),
        (chat_parts(n=3), "too_many_audios", "max_audios_per_request"),
        (chat_parts(wav(0.5, rate=96_000)), "audio_sample_rate_too_high", "max_audio_sample_rate"),
        (chat_parts(b"\x00" * 400), "invalid_audio", "WAV, MP3 or FLAC"),
        (chat_parts(CLIP[:30]), "invalid_audio", "cannot be read"),
        (chat_parts(fmt="ogg"), "unsupported_audio_format", "wav, mp3 or flac"),
        (chat_parts(fmt="mp3"), "invalid_audio", "its bytes are wav"),
        (
            [chat_parts()[0], {"type": "input_audio", "input_audio": {"data": "%%%"}}],
            "invalid_audio",
            "not valid base64",
        ),
    ],
)
async def test_limits_and_bad_audio_are_400s_naming_the_limit_and_the_part(
    hearing, parts, code, says
):
    async with hearing.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=AUDIO_DEMO, max_tokens=4, messages=[{"role": "user", "content": parts}]
            )
    assert caught.value.code == code, caught.value.message
    assert says in caught.value.message
    at = 3 if code == "too_many_audios" else 1
    assert caught.value.param == f"messages.0.content.{at}"


async def test_the_anthropic_door_says_its_api_has_no_audio_block(hearing):
    async with anthropic.AsyncAnthropic(
        base_url=hearing.url, api_key="sk-one", max_retries=0
    ) as client:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(
                model=AUDIO_DEMO,
                max_tokens=4,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": QUESTION},
                            {"type": "input_audio", "input_audio": {"data": b64(CLIP)}},  # type: ignore[list-item,misc]
                        ],
                    }
                ],
            )
    assert "no audio content block" in str(caught.value)
    assert "/v1/chat/completions" in str(caught.value)


async def test_audio_to_a_model_without_an_audio_encoder_is_refused_before_decoding(served):
    # not base64, not audio: decoding it would say so; the refusal comes first
    parts = [{"type": "text", "text": QUESTION}]
    parts.append({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}})
    async with served.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="stepline-demo", max_tokens=4, messages=[{"role": "user", "content": parts}]
            )
    assert caught.value.code == "unsupported_content_type"
    assert caught.value.param == "messages.0.content.1"
    assert "no audio encoder" in caught.value.message


async def test_the_audio_limits_are_flags_of_stepline_serve():
    sub = argparse.ArgumentParser().add_subparsers()
    args = add_serve_parser(sub).parse_args(
        ["--max-audio-seconds", "12.5", "--max-audio-bytes", "1000"]
        + ["--max-audio-sample-rate", "16000", "--max-audios-per-request", "3"]
    )
    config = ServerConfig(**options(args, ServerConfig))
    assert (config.max_audio_seconds, config.max_audio_bytes) == (12.5, 1000)
    assert (config.max_audio_sample_rate, config.max_audios_per_request) == (16000, 3)
