"""The requests that the agents people run (Claude Code, Codex, the OpenAI Agents SDK,
LangChain) send, through their official SDKs against a real server on 127.0.0.1 serving the
random demo model: each of these failed before, and each answers 2xx now."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
import pytest_asyncio
from helpers import WEATHER_ARGS, hold_open
from pydantic import BaseModel, Field

from stepline.api import Engine
from stepline.api.http.app import create_app
from stepline.api.http.serve import serve_in_process
from stepline.api.pipeline.served import OneModel

pytestmark = pytest.mark.asyncio(loop_scope="module")
MODEL = "stepline-demo"
KEY = "sk-agents"
# DeepSeek-R1 style: the generation prompt opens the think block, the model closes it (the
# random demo model never does by itself: only a budget ends its thinking).
R1_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}"
)


@dataclass(frozen=True)
class Servers:
    engine: Engine
    url: str  # the demo model's own template (tools, think tags), with an API key
    r1_url: str  # the R1 template: every answer starts inside a think block


@asynccontextmanager
async def serve() -> AsyncIterator[Servers]:
    # Two engines: a chat template is the tokenizer's, which the engine's servers share.
    async with (
        Engine.open(MODEL, max_step_tokens=256) as engine,
        Engine.open(MODEL, max_step_tokens=256) as r1_engine,
    ):
        app = create_app(OneModel(engine), api_key=KEY)
        r1 = create_app(OneModel(r1_engine), chat_template=R1_TEMPLATE)
        async with serve_in_process(app) as url, serve_in_process(r1) as r1_url:
            yield Servers(engine, url, r1_url)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(demo) -> AsyncIterator[Servers]:
    value, close = await hold_open(serve())
    yield value
    await close()


@pytest_asyncio.fixture(loop_scope="module")
async def claude(servers) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=servers.url, api_key=KEY, max_retries=0) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
async def oai(servers) -> AsyncIterator[openai.AsyncOpenAI]:
    url = f"{servers.url}/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0) as c:
        yield c


BASH = {
    "name": "Bash",
    "description": "Executes a bash command and returns its output.",
    # As Claude Code sends it: no additionalProperties.
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string", "maxLength": 20}},
        "required": ["command"],
    },
}


# -- Claude Code ----------------------------------------------------------------------------


async def test_claude_codes_first_request_streams_with_usage_and_a_clamped_max_tokens(
    claude, servers
):
    # The shape of Claude Code 2.1's first POST /v1/messages?beta=true (trimmed).
    async with claude.beta.messages.stream(
        model=MODEL,
        max_tokens=32000,
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
            {"type": "text", "text": "You are a CLI.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "say hi"}]},
            {"role": "assistant", "content": "Hello."},
            {"role": "system", "content": "The user is in /tmp."},  # mid-conversation
            {"role": "user", "content": "say hi again"},
        ],
        tools=[BASH],
        thinking={"type": "adaptive"},
        metadata={"user_id": '{"device_id":"x"}'},
        betas=["interleaved-thinking-2025-05-14", "mid-conversation-system-2026-04-07"],
        extra_body={
            "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
            "output_config": {"effort": "high"},
        },
        extra_query={"beta": "true"},
    ) as stream:
        events = [e async for e in stream]
        headers = stream.response.headers
    [delta] = [e for e in events if e.type == "message_delta"]
    start = next(e for e in events if e.type == "message_start")
    # LangChain and Claude Code read streamed usage from message_delta
    assert delta.usage.input_tokens == start.message.usage.input_tokens > 30
    assert delta.usage.cache_read_input_tokens is not None and delta.usage.output_tokens > 0
    effective = int(headers["x-stepline-max-tokens"])
    assert 0 < effective < 2048 and delta.usage.output_tokens <= effective
    assert events[-1].type == "message_stop"


async def test_a_mid_conversation_system_message_is_rendered_as_a_system_turn(claude):
    base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}]
    system = {"role": "system", "content": "Answer in French."}
    without = await claude.messages.count_tokens(
        model=MODEL, messages=[*base, {"role": "user", "content": "and?"}]
    )
    with_it = await claude.messages.count_tokens(
        model=MODEL,
        messages=[*base, system, {"role": "user", "content": "and?"}],
    )
    # "<|im_start|>system\nAnswer in French.<|im_end|>\n": the turn, not merged text
    assert with_it.input_tokens > without.input_tokens + 6


async def test_head_slash_answers_200_without_the_key(servers):
    async with httpx.AsyncClient(base_url=servers.url) as http:
        r = await http.head("/")
    assert r.status_code == 200


async def test_a_thinking_budget_is_enforced_by_ending_the_think_block(servers):
    async with anthropic.AsyncAnthropic(base_url=servers.r1_url, api_key="x", max_retries=0) as c:
        budgeted = await c.messages.create(
            model=MODEL,
            max_tokens=40,
            thinking={"type": "enabled", "budget_tokens": 6},
            messages=[{"role": "user", "content": "Why is the sky blue?"}],
            extra_body={"temperature": 0},
        )
        unbounded = await c.messages.create(
            model=MODEL,
            max_tokens=40,
            thinking={"type": "adaptive"},
            messages=[{"role": "user", "content": "Why is the sky blue?"}],
            extra_body={"temperature": 0},
        )
    kinds = [b.type for b in budgeted.content]
    assert kinds == ["thinking", "text"], kinds  # the thinking stopped at its budget
    thought = budgeted.content[0].thinking
    assert thought and len(thought) < len(unbounded.content[0].thinking)
    assert budgeted.content[1].text
    # the random model never ends its thinking by itself
    assert [b.type for b in unbounded.content] == ["thinking"]


async def test_langchain_chat_anthropic_with_thinking_streams_usage(servers):
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(
        model_name=MODEL,
        base_url=servers.r1_url,
        api_key="x",
        max_tokens=30,
        thinking={"type": "enabled", "budget_tokens": 5},
        max_retries=0,
        timeout=60,
        stop=None,
    )
    try:
        chunks = [c async for c in llm.astream("Why is the sky blue?")]
    finally:
        await llm._async_client.close()  # its own (cached) httpx client
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    usage = total.usage_metadata
    assert usage is not None and usage["input_tokens"] > 5 and usage["output_tokens"] > 5
    kinds = {b["type"] for b in total.content if isinstance(b, dict)}
    assert {"thinking", "text"} <= kinds


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


async def test_anthropic_structured_outputs_follow_the_schema(claude):
    # pydantic's schema: no additionalProperties, read as false
    schema = Person.model_json_schema()
    r = await claude.messages.create(
        model=MODEL,
        max_tokens=80,
        messages=[{"role": "user", "content": "A person, please."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"temperature": 1.0},
    )
    person = json.loads(r.content[0].text)
    assert set(person) == {"name", "age"}
    Person.model_validate(person)


async def test_anthropic_clients_get_anthropic_errors_for_bugs_and_unknown_routes(
    claude, servers, monkeypatch
):
    from stepline.api.anthropic.serving import AnthropicDoor

    def broken(*args, **kwargs):
        raise RuntimeError("a bug with <secret detail>")

    monkeypatch.setattr(AnthropicDoor, "stop_reason", broken)
    ask = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(anthropic.InternalServerError) as err:
        await claude.messages.create(**ask)
    assert err.value.body["type"] == "error"
    assert "internal error (request id msg_" in err.value.body["error"]["message"]
    headers = {"x-api-key": KEY}
    async with httpx.AsyncClient(base_url=servers.url, headers=headers) as http:
        streamed = await http.post("/v1/messages", json={**ask, "stream": True})
        unknown = await http.post("/v1/messages/batches", json={})
    assert b"event: error" in streamed.content and b"secret" not in streamed.content
    assert b"[DONE]" not in streamed.content
    assert unknown.status_code == 404
    assert unknown.json()["type"] == "error"
    assert unknown.json()["error"]["type"] == "not_found_error"


async def test_an_anthropic_stream_cut_by_shutdown_ends_with_an_anthropic_error(servers):
    app = create_app(OneModel(servers.engine))
    body = {
        "model": MODEL,
        "max_tokens": 1500,
        "stream": True,
        "messages": [{"role": "user", "content": "Tell me everything."}],
    }
    raw = b""
    async with httpx.AsyncClient(timeout=30) as http:
        async with serve_in_process(app, graceful_shutdown_s=0.1) as url:
            request = http.build_request("POST", f"{url}/v1/messages", json=body)
            response = await http.send(request, stream=True)
            chunks = response.aiter_raw()
            async for chunk in chunks:
                raw += chunk
                if b"content_block_delta" in raw:
                    break
        async for chunk in chunks:  # the rest, sent as the server stopped
            raw += chunk
        await response.aclose()
    assert raw.endswith(b"\n\n") and b"event: error" in raw.rsplit(b"\n\n", 2)[-2]
    assert b"[DONE]" not in raw and b'"object"' not in raw


# -- OpenAI: unknown routes, whitespace, cut calls ------------------------------------------


async def test_an_unknown_route_answers_a_json_error_with_a_code(oai):
    with pytest.raises(openai.NotFoundError) as err:  # (/v1/embeddings is served: issue 55)
        await oai.moderations.create(model=MODEL, input="hi")
    assert err.value.code == "not_found"
    assert "/v1/moderations" in err.value.message


TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": WEATHER_ARGS},
}


async def test_parallel_calls_leave_no_whitespace_content_on_any_api(oai, claude):
    found_two = False
    for seed in range(6):
        r = await oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Paris and Oslo?"}],
            tools=[TOOL],
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        message = r.choices[0].message
        found_two |= len(message.tool_calls or []) > 1
        assert message.content is None, (seed, message)
        anth = await claude.messages.create(
            model=MODEL,
            max_tokens=120,
            tools=[{"name": "get_weather", "input_schema": WEATHER_ARGS}],
            tool_choice={"type": "any"},
            messages=[{"role": "user", "content": "Weather in Paris and Oslo?"}],
            extra_body={"temperature": 1.0, "seed": seed},
        )
        assert {b.type for b in anth.content} == {"tool_use"}, anth.content
        resp = await oai.responses.create(
            model=MODEL,
            input="Weather in Paris and Oslo?",
            tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER_ARGS}],
            tool_choice="required",
            temperature=1.0,
            max_output_tokens=120,
            extra_body={"seed": seed},
        )
        assert {item.type for item in resp.output} == {"function_call"}, resp.output
    assert found_two  # some of those answers made parallel calls


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_cut_by_max_tokens_is_a_tool_call_with_finish_reason_length(oai, stream):
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [TOOL],
        "tool_choice": "required",
        "max_tokens": 30,  # the call's head takes 23 tokens, its arguments ~19
        "temperature": 0,
    }
    if stream:
        chunks = [c async for c in await oai.chat.completions.create(**ask, stream=True)]
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        names = [
            d.function.name for c in chunks for d in c.choices[0].delta.tool_calls or [] if d.id
        ]
    else:
        r = await oai.chat.completions.create(**ask)
        finish, content = r.choices[0].finish_reason, r.choices[0].message.content or ""
        names = [c.function.name for c in r.choices[0].message.tool_calls or []]
    assert (finish, content, names) == ("length", "", ["get_weather"])


async def test_a_cut_call_is_a_call_on_the_anthropic_and_responses_apis_too(oai, claude):
    # Anthropic: a tool_use block (its input cut: empty), stop_reason max_tokens, no text.
    r = await claude.messages.create(
        model=MODEL,
        max_tokens=30,
        tools=[{"name": "get_weather", "input_schema": WEATHER_ARGS}],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather?"}],
        extra_body={"temperature": 0},
    )
    assert r.stop_reason == "max_tokens"
    assert [(b.type, b.name) for b in r.content] == [("tool_use", "get_weather")]
    # Responses: an incomplete function_call item, response.incomplete, no message.
    stream = await oai.responses.create(
        model=MODEL,
        input="Weather?",
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER_ARGS}],
        tool_choice="required",
        max_output_tokens=30,
        temperature=0,
        stream=True,
    )
    events = [e async for e in stream]
    final = events[-1].response
    assert events[-1].type == "response.incomplete"
    assert [(i.type, i.name, i.status) for i in final.output] == [
        ("function_call", "get_weather", "incomplete")
    ]


async def test_forced_calls_with_schemas_lacking_additional_properties_end_in_a_valid_call(oai):
    # What pydantic's model_json_schema() (instructor, LangChain, the Agents SDK) sends.
    class Lookup(BaseModel):
        city: str = Field(max_length=10)
        days: int = Field(ge=1, le=7)

    schema = Lookup.model_json_schema()
    assert "additionalProperties" not in schema
    closed = {**schema, "additionalProperties": False}
    for seed in range(4):
        r = await oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Look it up."}],
            tools=[{"type": "function", "function": {"name": "lookup", "parameters": schema}}],
            tool_choice={"type": "function", "function": {"name": "lookup"}},
            temperature=1.5,
            seed=seed,
            max_tokens=60,
        )
        assert r.choices[0].finish_reason == "tool_calls"
        [call] = r.choices[0].message.tool_calls or []
        jsonschema.validate(json.loads(call.function.arguments), closed)


async def test_langchain_tools_and_anthropic_input_schemas_without_additional_properties_hold(
    oai, claude
):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def shout(word: str, times: int) -> str:
        """Shout a word."""
        return word * times

    async with httpx.AsyncClient() as http:  # our own, so that it is closed
        llm = ChatOpenAI(
            model=MODEL,
            base_url=str(oai.base_url),
            api_key=KEY,
            temperature=1.5,
            max_retries=0,
            http_async_client=http,
            seed=2,
        )
        called = await llm.bind_tools([shout], tool_choice="required").ainvoke("Shout!")
    assert called.tool_calls
    assert all(set(c["args"]) == {"word", "times"} for c in called.tool_calls)
    for seed in range(3):
        r = await claude.messages.create(
            model=MODEL,
            max_tokens=60,
            tools=[BASH],  # Claude Code's input_schema: no additionalProperties
            tool_choice={"type": "tool", "name": "Bash"},
            messages=[{"role": "user", "content": "List the files."}],
            extra_body={"temperature": 1.0, "seed": seed},
        )
        [use] = r.content
        assert use.type == "tool_use" and set(use.input) == {"command"}


# -- Codex ----------------------------------------------------------------------------------

CODEX_TOOLS = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Runs a command.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string", "maxLength": 12}},
            "required": ["cmd"],
        },
    },
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Tools for spawning and managing sub-agents.",
        "tools": [
            {
                "type": "function",
                "name": "close_agent",
                "description": "Close an agent.",
                "parameters": {
                    "type": "object",
                    "properties": {"id": {"enum": ["a1", "a2"]}},
                    "required": ["id"],
                },
            }
        ],
    },
    {"type": "web_search", "external_web_access": False},
]


async def test_codex_namespace_and_hosted_tools_are_served(oai):
    raw = await oai.responses.with_raw_response.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "You are Codex."},
            {"role": "user", "content": "Go"},
        ],
        tools=CODEX_TOOLS,
        tool_choice={"type": "function", "name": "close_agent", "namespace": "multi_agent_v1"},
        parallel_tool_calls=True,
        reasoning={"summary": "auto"},
        store=False,
        include=["reasoning.encrypted_content"],
        extra_body={"prompt_cache_key": "k", "client_metadata": {"x": "y"}},
    )
    assert raw.headers["x-stepline-dropped-tools"] == "web_search"
    [call] = raw.parse().output
    assert call.type == "function_call"
    assert (call.name, call.namespace) == ("close_agent", "multi_agent_v1")
    # sent back, with its result, the conversation goes on
    follow = await oai.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Go"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "namespace": call.namespace,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "closed"},
        ],
        tools=CODEX_TOOLS,
        max_output_tokens=5,
        stream=True,
    )
    kinds = [e.type async for e in follow]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    with pytest.raises(openai.BadRequestError, match="hosted tools"):
        await oai.responses.create(
            model=MODEL,
            input="Go",
            tools=CODEX_TOOLS,
            tool_choice={"type": "web_search"},
        )


async def test_a_responses_stream_resumes_at_the_common_stream_route(oai, servers):
    stream = await oai.responses.create(
        model=MODEL, input="Tell me about bread.", max_output_tokens=6, stream=True
    )
    events = [e async for e in stream]
    rid = events[0].response.id
    async with httpx.AsyncClient(base_url=servers.url, timeout=30) as http:
        again = await http.get(
            f"/v1/requests/{rid}/stream",
            headers={"authorization": f"Bearer {KEY}", "last-event-id": "1"},
        )
    numbers = [
        json.loads(line[6:])["sequence_number"]
        for line in again.text.splitlines()
        if line.startswith("data: ")
    ]
    assert numbers == [e.sequence_number for e in events][2:]


# -- the OpenAI Agents SDK ------------------------------------------------------------------


class Forecast(BaseModel):
    city: str = Field(max_length=8)
    sunny: bool


async def test_the_agents_sdk_calls_its_tools_with_an_output_type(oai):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    agent = Agent(
        name="forecaster",
        instructions="Use the tool, then answer.",
        model=OpenAIResponsesModel(model=MODEL, openai_client=oai),
        tools=[get_weather],
        output_type=Forecast,
        # Required on the first turn (the SDK resets it to auto after a call); then the answer
        # is a call or the JSON document: the random model picks either, by its seed.
        model_settings=ModelSettings(
            tool_choice="required", temperature=1.0, max_tokens=80, extra_body={"seed": 1}
        ),
    )
    result = await Runner.run(agent, "Weather in Paris?", max_turns=10)
    assert calls  # tools called, with an output_type
    assert isinstance(result.final_output, Forecast)


async def test_while_the_model_loads_anthropic_clients_get_an_anthropic_503():
    from stepline.api.http.loading import loading_app

    transport = httpx.ASGITransport(app=loading_app("m"))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        anthropic_path = await http.post("/v1/messages", json={})
        openai_path = await http.post("/v1/chat/completions", json={})
    assert anthropic_path.status_code == openai_path.status_code == 503
    assert anthropic_path.json()["error"]["type"] == "overloaded_error"
    assert anthropic_path.headers["retry-after"] == "1"
    assert openai_path.json()["error"]["code"] == "model_loading"
