"""What a server returns, it accepts back: a tool call cut off by the token limit (its
arguments unterminated JSON, as documented) goes back into the next request's history, as
every agent loop sends it, and is answered on every door, its arguments rendered to the chat
template as the text they were. Real clients against a real server on the demo model."""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import openai
import pytest
from helpers import WEATHER_ARGS, Served

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "stepline-demo"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_ARGS}}]
CUT = 30  # tokens: the demo model's forced call is cut inside its arguments
FLAT_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER_ARGS}]


@pytest.fixture(scope="module")
def served_options() -> dict:
    return dict(api_key="sk-k")


def prompt_of(served: Served, rid: str) -> list[int]:
    state = served.engine.step_loop.state_of(rid)
    assert state is not None
    return list(state.prompt_token_ids)


def rendered(served: Served, messages: list[dict], tools: list[dict]) -> list[int]:
    """The prompt the chat template makes of `messages` with `tools`."""
    return served.engine.encode(messages=messages, template_kwargs={"tools": tools})


def is_cut(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return True
    return False


async def test_chat_takes_back_a_call_it_cut_off(served):
    async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="sk-k") as client:
        first = await client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=CHAT_TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=CUT,
            temperature=0,
        )
        [call] = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "length" and is_cut(call.function.arguments)
        history = [
            *ASK,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "cut off: try again"},
        ]
        again = await client.chat.completions.create(
            model=MODEL, messages=history, tools=CHAT_TOOLS, max_tokens=4, temperature=0
        )
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    expected = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.function.arguments},
                }
            ],
        },
        history[-1],
    ]
    # Rendered by the template with the arguments as the text they were.
    assert prompt_of(served, again.id) == rendered(served, expected, tools=CHAT_TOOLS)
    assert call.function.arguments in served.engine.tokenizer.decode(prompt_of(served, again.id))


async def test_responses_takes_back_a_call_it_cut_off(served):
    async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="sk-k") as client:
        first = await client.responses.create(
            model=MODEL,
            input=ASK,
            tools=FLAT_TOOLS,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=CUT,
            temperature=0,
        )
        [call] = first.output
        assert first.status == "incomplete" and is_cut(call.arguments)
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "cut off"}
        sent = await client.responses.create(
            model=MODEL,
            input=[*ASK, call.model_dump(exclude_none=True), result],
            tools=FLAT_TOOLS,
            max_output_tokens=4,
            temperature=0,
        )
        kept = await client.responses.create(
            model=MODEL,
            input=[result],
            previous_response_id=first.id,
            tools=FLAT_TOOLS,
            max_output_tokens=4,
            temperature=0,
        )
    assert sent.status in ("completed", "incomplete") and kept.status == sent.status
    assert call.arguments in served.engine.tokenizer.decode(prompt_of(served, sent.id))
    # The server's own copy of the conversation holds the cut call as the client's does.
    assert prompt_of(served, kept.id) == prompt_of(served, sent.id)


async def test_anthropic_takes_back_a_call_it_cut_off(served):
    tools = [{"name": "get_weather", "input_schema": WEATHER_ARGS}]
    async with anthropic.AsyncAnthropic(base_url=served.url, api_key="sk-k") as client:
        first = await client.messages.create(
            model=MODEL,
            max_tokens=CUT,
            messages=ASK,
            tools=tools,
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body={"temperature": 0},
        )
        assert first.stop_reason == "max_tokens"
        [use] = [b for b in first.content if b.type == "tool_use"]
        again = await client.messages.create(
            model=MODEL,
            max_tokens=4,
            tools=tools,
            messages=[
                *ASK,
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "cut"}],
                },
            ],
        )
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")


async def test_ollama_takes_back_a_call_with_arguments_that_are_no_object(served):
    # Ollama's calls carry objects; a client that kept the cut text sends it as a string.
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Pa'}}],
        },
        {"role": "tool", "content": "cut off", "tool_name": "get_weather"},
    ]
    body = {"model": MODEL, "messages": history, "tools": CHAT_TOOLS, "stream": False}
    async with httpx.AsyncClient(base_url=served.url, headers={"x-api-key": "sk-k"}) as http:
        r = await http.post("/api/chat", json={**body, "options": {"num_predict": 4}})
    answer = ollama.ChatResponse(**r.json())  # as the official client reads it
    assert answer.done and answer.eval_count >= 1
