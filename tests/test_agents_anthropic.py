"""The Anthropic Messages API through the official `anthropic` client against a real server on
127.0.0.1: text, multi-turn with tool_use / tool_result, forced tool use, streaming events in
Anthropic's order, count_tokens, errors and x-api-key auth."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

import anthropic
import httpx
import jsonschema
import pytest
import pytest_asyncio
from helpers import hold_open

from stepline.api import Engine
from stepline.api.http.app import create_app
from stepline.api.http.serve import serve_in_process
from stepline.api.pipeline.served import OneModel

pytestmark = pytest.mark.asyncio(loop_scope="module")
T = TypeVar("T")
API_KEY = "sk-ant-test"
MODEL = "stepline-demo"
WEATHER = {
    "name": "get_weather",
    "description": "The forecast for a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


@asynccontextmanager
async def serve_demo() -> AsyncIterator[str]:
    async with Engine.open(MODEL, max_step_tokens=256) as engine:
        async with serve_in_process(create_app(OneModel(engine), api_key=API_KEY)) as url:
            yield url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def url(demo) -> AsyncIterator[str]:
    value, close = await hold_open(serve_demo())
    yield value
    await close()


@pytest_asyncio.fixture(loop_scope="module")
async def client(url) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=url, api_key=API_KEY, max_retries=0) as c:
        yield c


async def test_messages_create_answers_with_a_text_block_and_usage(client):
    r = await client.messages.create(
        model=MODEL,
        max_tokens=12,
        system="You are terse.",
        messages=[{"role": "user", "content": "Tell me about bread."}],
        # The current SDK has no sampling arguments any more; the API still takes them.
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40},
    )
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.content[0].type == "text" and r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert r.usage.input_tokens > 5 and 0 < r.usage.output_tokens <= 12


async def test_a_stop_sequence_ends_the_text_and_is_named(client):
    free = await client.messages.create(
        model=MODEL,
        max_tokens=20,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Tell me about bread."}],
    )
    text = free.content[0].text
    stop = text[len(text) // 2 :][:2]
    assert stop.strip(), text
    r = await client.messages.create(
        model=MODEL,
        max_tokens=20,
        extra_body={"temperature": 0},
        stop_sequences=[stop],
        messages=[{"role": "user", "content": "Tell me about bread."}],
    )
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert stop not in r.content[0].text and text.startswith(r.content[0].text)


async def test_a_forced_tool_use_has_input_that_fits_the_schema(client):
    r = await client.messages.create(
        model=MODEL,
        max_tokens=80,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    assert r.stop_reason == "tool_use"
    [use] = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])


async def test_a_tool_result_goes_back_and_the_conversation_continues(client):
    first = await client.messages.create(
        model=MODEL,
        max_tokens=80,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    use = next(b for b in first.content if b.type == "tool_use")
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21C"},
                {"type": "text", "text": "Thanks. Summarise."},
            ],
        },
    ]
    second = await client.messages.create(
        model=MODEL, max_tokens=6, tools=[WEATHER], messages=history
    )
    assert second.content[0].type == "text"
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    count = await client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=history)
    assert count.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens


async def test_messages_stream_sends_anthropics_event_sequence(client, url):
    async with client.messages.stream(
        model=MODEL,
        max_tokens=10,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Tell me about bread."}],
    ) as stream:
        kinds = [e.type async for e in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.content[0].type == "text" and final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
    # and on the wire, with the ping right after message_start
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        body = {
            "model": MODEL,
            "max_tokens": 4,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        r = await http.post("/v1/messages", json=body, headers={"x-api-key": API_KEY})
    events = [
        line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")
    ]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


async def test_a_streamed_forced_tool_use_sends_input_json_deltas(client):
    async with client.messages.stream(
        model=MODEL,
        max_tokens=80,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
    ) as stream:
        deltas = [
            e.delta.partial_json
            async for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        final = await stream.get_final_message()
    assert len(deltas) > 3 and final.stop_reason == "tool_use"  # input streams as written
    [use] = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(json.loads("".join(deltas)), WEATHER["input_schema"])
    assert use.input == json.loads("".join(deltas))


async def test_errors_are_anthropic_shaped_and_the_key_is_checked(url):
    async with anthropic.AsyncAnthropic(base_url=url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as auth:
            await bad.messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
    assert auth.value.body["error"]["type"] == "authentication_error"
    async with anthropic.AsyncAnthropic(base_url=url, api_key=API_KEY, max_retries=0) as good:
        with pytest.raises(anthropic.BadRequestError) as bad_req:
            await good.messages.create(
                model=MODEL,
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
                                    "data": "AAAA",
                                },
                            }
                        ],
                    }
                ],
            )
        assert bad_req.value.body == {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": bad_req.value.body["error"]["message"],
            },
        }
        with pytest.raises(anthropic.NotFoundError):
            await good.messages.create(
                model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )


async def test_a_streamed_long_prompt_starts_its_message_once(url):
    # A prompt of several chunks sends progress (pings) while it prefills; the message
    # still starts once.
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "stream": True,
        "messages": [{"role": "user", "content": "a long prompt " * 300}],
    }
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.post("/v1/messages", json=body, headers={"x-api-key": API_KEY})
    events = [
        line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")
    ]
    assert events.count("ping") >= 2  # it did prefill in several chunks
    assert events.count("message_start") == 1 and events[0] == "message_start"
    assert events[-1] == "message_stop"
