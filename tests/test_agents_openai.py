"""Agents through the official `openai` client against a real server on 127.0.0.1: tool calls
(forced, streamed, round trip) and structured output, on the random demo model, whose output
still parses and validates because the grammar forces it."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio
import jsonschema
import openai
import pytest
import pytest_asyncio
from helpers import (
    COUNTED,
    FAILS_LATER,
    UNFOLLOWABLE,
    WEATHER_ARGS,
    ZONE_ARGS,
    hold_open,
)
from pydantic import BaseModel, Field

from stepline.api import Engine
from stepline.api.http.app import create_app
from stepline.api.http.serve import serve_in_process
from stepline.api.pipeline.served import OneModel

pytestmark = pytest.mark.asyncio(loop_scope="module")
T = TypeVar("T")


@asynccontextmanager
async def serve_demo() -> AsyncIterator[str]:
    async with Engine.open("stepline-demo", max_step_tokens=256) as engine:
        async with serve_in_process(create_app(OneModel(engine))) as url:
            yield url


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The forecast for a city",
            "parameters": WEATHER_ARGS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": ZONE_ARGS,
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(demo) -> AsyncIterator[openai.AsyncOpenAI]:
    url, close = await hold_open(serve_demo())
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        yield c
    await close()


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


async def test_tool_choice_required_returns_a_call_whose_arguments_fit_the_schema(client):
    r = await client.chat.completions.create(
        model="stepline-demo", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))


async def test_a_named_tool_choice_calls_exactly_that_tool(client):
    r = await client.chat.completions.create(
        model="stepline-demo",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0.9,
        seed=4,
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schema_of("get_time"))


class Point(BaseModel):
    x: int = Field(ge=0, le=9)
    y: int = Field(ge=0, le=9)


class Segment(BaseModel):
    start: Point
    end: Point


async def test_a_tool_whose_parameters_use_defs_is_called_with_valid_arguments(client):
    # pydantic writes nested models under $defs, referred to as #/$defs/Point: inside the
    # grammar's call wrapper those pointers must still find them.
    schema = Segment.model_json_schema()
    assert "$defs" in schema
    tools = [{"type": "function", "function": {"name": "draw", "parameters": schema}}, *TOOLS]
    r = await client.chat.completions.create(
        model="stepline-demo",
        messages=[{"role": "user", "content": "Draw a line."}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "draw"}},
        temperature=0,
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "draw"
    Segment.model_validate_json(call.function.arguments)
    jsonschema.validate(json.loads(call.function.arguments), schema)


async def test_streamed_tool_calls_arrive_as_openai_deltas_and_validate(client):
    stream = await client.chat.completions.create(
        model="stepline-demo",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    num_argument_deltas = 0
    async for chunk in stream:
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            num_argument_deltas += bool(d.function.arguments)
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["id"].startswith("call_")
    assert num_argument_deltas > 3  # the arguments stream as they are written
    jsonschema.validate(json.loads(calls[0]["arguments"]), schema_of(calls[0]["name"]))


async def test_a_tool_round_trip_sends_the_result_back_and_gets_an_answer(client):
    first = await client.chat.completions.create(
        model="stepline-demo", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    second = await client.chat.completions.create(
        model="stepline-demo", messages=history, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    assert isinstance(second.choices[0].message.content, str)
    # the call and its result went into the prompt, through the chat template
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10


async def test_response_format_json_schema_output_validates(client):
    r = await client.chat.completions.create(
        model="stepline-demo",
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
        temperature=0.7,
        seed=1,
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


async def test_streamed_json_object_mode_gives_one_json_object(client):
    stream = await client.chat.completions.create(
        model="stepline-demo",
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text.startswith("{")
    if text.endswith("}"):  # a random model may run out of tokens inside an object
        assert isinstance(json.loads(text), dict)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


async def test_the_sdk_parse_helper_returns_a_typed_object(client):
    r = await client.chat.completions.parse(
        model="stepline-demo",
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format=Person,
        temperature=0,
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


async def test_completions_take_a_json_schema_too(client):
    r = await client.completions.create(
        model="stepline-demo",
        prompt="A person:",
        max_tokens=60,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON},
            }
        },
    )
    person = json.loads(r.choices[0].text)
    jsonschema.validate(person, PERSON)  # raises if the text breaks the schema
    assert set(PERSON["required"]) <= set(person)


async def test_chat_template_kwargs_reach_the_template(client):
    ask = [{"role": "user", "content": "hi"}]
    on = await client.chat.completions.create(model="stepline-demo", messages=ask, max_tokens=1)
    off = await client.chat.completions.create(
        model="stepline-demo",
        messages=ask,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    # thinking off: the template closes an empty think block after the generation prompt
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


# DeepSeek-R1 style: the generation prompt opens the think block, the model closes it.
R1_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}"
)


@asynccontextmanager
async def serve_reasoning() -> AsyncIterator[str]:
    async with Engine.open("stepline-demo", max_step_tokens=256) as engine:
        app = create_app(
            OneModel(engine), reasoning_parser="deepseek_r1", chat_template=R1_TEMPLATE
        )
        async with serve_in_process(app) as url:
            yield url


async def test_the_reasoning_parser_puts_an_open_think_block_in_reasoning_content(demo):
    url, close = await hold_open(serve_reasoning())
    try:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as c:
            ask = [{"role": "user", "content": "Why is the sky blue?"}]
            r = await c.chat.completions.create(
                model="stepline-demo", messages=ask, max_tokens=8, temperature=0
            )
            stream = await c.chat.completions.create(
                model="stepline-demo", messages=ask, max_tokens=8, temperature=0, stream=True
            )
            streamed = [
                (getattr(ch.choices[0].delta, "reasoning_content", None) or "")
                async for ch in stream
                if ch.choices
            ]
    finally:
        await close()
    # the random model never closes the block: all it wrote is reasoning
    reasoning = r.choices[0].message.reasoning_content
    assert reasoning and r.choices[0].message.content == ""
    assert "".join(streamed) == reasoning


async def test_langchain_bind_tools_and_with_structured_output_work(client):
    import httpx
    from langchain_openai import ChatOpenAI

    async with httpx.AsyncClient() as http:  # our own, so that it is closed
        llm = ChatOpenAI(
            model="stepline-demo",
            base_url=str(client.base_url),
            api_key="unused",  # type: ignore[arg-type]
            temperature=0,
            max_retries=0,
            http_async_client=http,
        )
        tool = {"type": "function", "function": TOOLS[0]["function"]}
        called = await llm.bind_tools([tool], tool_choice="required").ainvoke("Weather in Paris?")
        structured = llm.with_structured_output(Person, method="json_schema")
        person = await structured.ainvoke("A person?")
    [call] = called.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER_ARGS)
    assert isinstance(person, Person)


async def test_a_schema_that_does_not_compile_is_a_400_naming_response_format(client):
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model="stepline-demo",
            messages=[{"role": "user", "content": "hi"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        )
    assert err.value.body["param"] == "response_format"
    assert "nonsense" in err.value.body["message"]


@pytest.mark.parametrize("name", list(UNFOLLOWABLE))
async def test_a_schema_the_grammar_cannot_follow_is_a_400_naming_response_format(client, name):
    schema, why = UNFOLLOWABLE[name]
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model="stepline-demo",
            messages=[{"role": "user", "content": "hi"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": True},
            },
        )
    body = err.value.body
    assert (body["param"], body["code"]) == ("response_format", "invalid_schema")
    assert "cannot be followed" in body["message"] and why in body["message"]


async def test_a_tool_whose_parameters_the_grammar_cannot_follow_is_a_400_naming_tools(client):
    counted = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": COUNTED}},
        "required": ["s"],
    }
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model="stepline-demo",
            messages=ASK,
            tools=[{"type": "function", "function": {"name": "f", "parameters": counted}}],
            tool_choice="required",
        )
    assert err.value.body["param"] == "tools"
    assert "too complex" in err.value.body["message"]


async def test_a_grammar_that_fails_mid_generation_is_an_error_never_a_stop(client):
    ask = {
        "model": "stepline-demo",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": FAILS_LATER},
        },
        "temperature": 0,
        "max_tokens": 40,
    }
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(**ask)
    assert err.value.body["code"] == "grammar_failed"
    assert "failed mid-generation" in err.value.body["message"]

    stream = await client.chat.completions.create(**ask, stream=True)
    reasons = []
    with pytest.raises(openai.APIError, match="failed mid-generation"):
        async for chunk in stream:
            reasons += [c.finish_reason for c in chunk.choices]
    assert "stop" not in reasons  # the stream ends with the error frame, not a "stop"


async def test_counted_pattern_schemas_are_refused_while_another_stream_keeps_its_pace(client):
    # Issue 36: three such requests once froze every stream for 1.3 s on this model (their
    # masks were computed inside steps). Now they are refused at submission, compiled off
    # the step loop; a bystander's stream keeps going meanwhile.
    hostile = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": UNFOLLOWABLE["a counted pattern"][0]},
    }
    streaming, refused = anyio.Event(), anyio.Event()
    arrivals: list[float] = []
    outcomes: list[str] = []

    async def bystander() -> None:
        stream = await client.chat.completions.create(
            model="stepline-demo",
            messages=ASK,
            max_tokens=1900,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        after = 0
        async for _chunk in stream:
            arrivals.append(time.perf_counter())
            streaming.set()
            after += refused.is_set()
            if after >= 30:
                break
        await stream.close()

    async def attack() -> None:
        try:
            await client.chat.completions.create(
                model="stepline-demo", messages=ASK, response_format=hostile, max_tokens=20
            )
            outcomes.append("served")
        except openai.BadRequestError as exc:
            outcomes.append(exc.body["code"])

    async with anyio.create_task_group() as tg:
        tg.start_soon(bystander)
        await streaming.wait()
        async with anyio.create_task_group() as attackers:
            for _ in range(3):
                attackers.start_soon(attack)
        refused.set()
    assert outcomes == ["invalid_schema"] * 3
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    # Steps of this model take milliseconds; compiling runs on worker threads (without the
    # GIL) and may slow them on a busy 2-core machine, never stop them for a second.
    assert len(gaps) >= 30 and max(gaps) < 1.0
