"""The OpenAI Responses API over real HTTP with the official `openai` client: create
(streaming and not), background responses retrieved, streamed again after the fact and resumed
with `starting_after`, cancel, `previous_response_id`, and privacy between API keys."""

from __future__ import annotations

import json
import time

import anyio
import jsonschema
import openai
import pytest
from helpers import WEATHER_ARGS, ZONE_ARGS, wait_finished

from stepline.api.pipeline.errors import OPENAI, APIError
from stepline.api.pipeline.resume import StreamRecord
from stepline.api.responses.output import failed_response
from stepline.api.responses.serving import ResponseStore, StoredResponse

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "stepline-demo"
TERMINAL = {"completed", "incomplete", "failed", "cancelled"}


LONG = {"ignore_eos": True}  # generate max_output_tokens whatever the model says


async def test_create_returns_a_response_with_text_and_usage(served):
    async with served.client() as client:
        response = await client.responses.create(
            model=MODEL,
            input="Tell me about rye.",
            instructions="Answer briefly.",
            max_output_tokens=12,
            temperature=0,
            extra_body=LONG,
        )
    assert response.id.startswith("resp_")
    assert response.status == "incomplete"  # it ran into max_output_tokens
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.output_text == response.output[0].content[0].text != ""
    assert response.usage.output_tokens == 12
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    assert response.instructions == "Answer briefly."


async def test_a_stream_has_the_spec_events_in_order_with_sequence_numbers(served):
    async with served.client() as client:
        stream = await client.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": "Tell me about spelt."}],
            max_output_tokens=8,
            temperature=0,
            stream=True,
        )
        events = [e async for e in stream]
        whole = await client.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": "Tell me about spelt."}],
            max_output_tokens=8,
            temperature=0,
        )
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    end = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-4:-1] == end
    assert types[-1] in ("response.completed", "response.incomplete")
    assert set(types[4:-4]) <= {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == whole.output_text


async def test_a_background_response_is_retrieved_done_then_streamed_from_the_start(served):
    async with served.client() as client:
        started = await client.responses.create(
            model=MODEL, input="Tell me about barley.", max_output_tokens=40, background=True
        )
        assert started.status in ("queued", "in_progress")
        assert started.background is True
        with anyio.fail_after(30):
            live = await client.responses.retrieve(started.id, stream=True)
            async for _ in live:  # followed to its end: the response has ended
                pass
        done = await client.responses.retrieve(started.id)
        replay = await client.responses.retrieve(started.id, stream=True)
        events = [e async for e in replay]
    assert done.status in ("completed", "incomplete")
    assert events[0].type == "response.created"
    assert events[-1].response.output_text == done.output_text
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == done.output_text


async def test_a_live_background_response_resumes_after_a_sequence_number(served):
    async with served.client() as client:
        started = await client.responses.create(
            model=MODEL,
            input="Tell me about oats.",
            max_output_tokens=300,
            background=True,
            extra_body=LONG,
        )
        first = await client.responses.retrieve(started.id, stream=True)
        head = []
        async for event in first:
            head.append(event)
            if len(head) == 7:
                break  # the connection drops mid-stream
        await first.close()
        rest = await client.responses.retrieve(started.id, stream=True, starting_after=6)
        tail = [e async for e in rest]
        done = await client.responses.retrieve(started.id)
    assert tail[0].sequence_number == 7
    events = head + tail
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert done.status == "incomplete" and text == done.output_text
    assert done.usage.output_tokens == 300


async def test_cancelling_a_background_response_stops_it(served):
    engine = served.engine
    async with served.client() as client:
        started = await client.responses.create(
            model=MODEL,
            input="Tell me about millet.",
            max_output_tokens=engine.max_context - 64,
            background=True,
            extra_body=LONG,
        )
        cancelled = await client.responses.cancel(started.id)
        again = await client.responses.retrieve(started.id)
        stream = await client.responses.retrieve(started.id, stream=True)
        events = [e async for e in stream]
    assert cancelled.status == again.status == "cancelled"
    assert events[-1].type == "response.cancelled"
    state = await wait_finished(engine.step_loop, started.id)  # the response id is the request id
    assert state.finish_reason == "cancelled"


async def test_previous_response_id_continues_the_conversation(served):
    async with served.client() as client:
        first = await client.responses.create(
            model=MODEL, input="My name is Ada.", max_output_tokens=6, temperature=0
        )
        second = await client.responses.create(
            model=MODEL,
            input="What is my name?",
            previous_response_id=first.id,
            max_output_tokens=6,
            temperature=0,
        )
        # The same conversation sent whole: the same prompt, so the same greedy answer.
        whole = await client.responses.create(
            model=MODEL,
            input=[
                {"role": "user", "content": "My name is Ada."},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "What is my name?"},
            ],
            max_output_tokens=6,
            temperature=0,
        )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == whole.output_text
    # The earlier turns came from the prefix cache.
    assert second.usage.input_tokens_details.cached_tokens > 0


async def test_a_response_is_private_to_the_key_that_created_it(served):
    async with served.client("sk-one") as mine, served.client("sk-two") as theirs:
        response = await mine.responses.create(model=MODEL, input="Hi.", max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.create(
                model=MODEL, input="Hi.", max_output_tokens=4, previous_response_id=response.id
            )
        assert (await mine.responses.retrieve(response.id)).id == response.id


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


async def test_text_format_json_schema_gives_output_that_validates(served):
    async with served.client() as client:
        response = await client.responses.create(
            model=MODEL,
            input="Describe a person.",
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
            temperature=0.7,
            extra_body={"seed": 1},
        )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"


TOOLS = [  # the Responses API's flat function tools
    {
        "type": "function",
        "name": "get_weather",
        "description": "The forecast for a city",
        "parameters": WEATHER_ARGS,
    },
    {"type": "function", "name": "get_time", "parameters": ZONE_ARGS},
]
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": ZONE_ARGS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def calling(name: str, **create: object) -> dict:
    """`responses.create` arguments that ask about the weather and force a call of `name`."""
    tool_choice = {"type": "function", "name": name}
    return {"model": MODEL, "input": ASK, "tools": TOOLS, "tool_choice": tool_choice, **create}


async def test_a_required_tool_choice_returns_function_calls_that_fit_their_schemas(served):
    async with served.client() as client:
        response = await client.responses.create(
            model=MODEL, input=ASK, tools=TOOLS, tool_choice="required", temperature=0
        )
    assert response.status == "completed"
    assert response.output and all(item.type == "function_call" for item in response.output)
    assert response.output_text == ""
    for call in response.output:
        assert call.status == "completed" and call.call_id and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert [t.name for t in response.tools] == ["get_weather", "get_time"]
    assert response.tool_choice == "required"


async def test_a_streamed_function_call_arrives_as_argument_deltas(served):
    async with served.client() as client:
        stream = await client.responses.create(
            **calling(
                "get_weather",
                parallel_tool_calls=False,
                temperature=0.9,
                extra_body={"seed": 3},
                stream=True,
            )
        )
        events = [e async for e in stream]
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "function_call" and events[2].item.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 3  # the arguments stream as they are written
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == "".join(deltas) and done.item_id == events[2].item.id
    assert types[-2:] == ["response.output_item.done", "response.completed"]
    assert events[-2].item.status == "completed"
    [call] = events[-1].response.output
    assert call.arguments == done.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER_ARGS)
    assert "response.output_text.delta" not in types  # no message: the answer is the call
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_a_function_call_output_continues_the_conversation_either_way(served):
    async with served.client() as client:
        first = await client.responses.create(**calling("get_time", temperature=0))
        [call] = first.output
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "12:00 UTC"}
        # The server keeps the conversation ...
        kept = await client.responses.create(
            model=MODEL,
            input=[result],
            previous_response_id=first.id,
            tools=TOOLS,
            max_output_tokens=6,
            temperature=0,
        )
        # ... or the client sends it whole, the model's call included.
        sent = await client.responses.create(
            model=MODEL,
            input=[*ASK, call.model_dump(exclude_none=True), result],
            tools=TOOLS,
            max_output_tokens=6,
            temperature=0,
        )
    for response in (kept, sent):
        assert response.status in ("completed", "incomplete")
        assert response.output[0].type == "message"
    # The call and its result went into the prompt, through the chat template, the same way.
    assert kept.usage.input_tokens == sent.usage.input_tokens > first.usage.input_tokens + 5
    assert kept.output_text == sent.output_text


async def test_a_call_cut_off_by_max_output_tokens_is_incomplete(served):
    async with served.client() as client:
        stream = await client.responses.create(
            **calling("get_weather", max_output_tokens=6, temperature=0, stream=True)
        )
        events = [e async for e in stream]
    final = events[-1]
    assert final.type == "response.incomplete"
    assert final.response.incomplete_details.reason == "max_output_tokens"
    assert final.response.output  # what was written is there, marked incomplete
    assert all(item.status == "incomplete" for item in final.response.output)
    assert "response.function_call_arguments.done" not in [e.type for e in events]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (
            {"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
            "function tools only",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "not one of"),
        ({"tool_choice": "required"}, "no tools are given"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "a message, a function_call"),
        ({"input": []}, "input: .*empty conversation"),
    ],
)
async def test_what_the_server_cannot_run_is_refused_with_a_clear_400(served, body, match):
    async with served.client() as client:
        with pytest.raises(openai.BadRequestError, match=match):
            await client.responses.create(**{"model": MODEL, "input": "Hi.", **body})


async def test_a_foreground_stream_is_cancelled_when_its_client_goes_away(served):
    engine = served.engine
    async with served.client() as client:
        stream = await client.responses.create(
            model=MODEL,
            input="Tell me about teff.",
            max_output_tokens=engine.max_context - 64,
            stream=True,
            extra_body=LONG,
        )
        rid = None
        async for event in stream:
            rid = event.response.id if event.type == "response.created" else rid
            if event.type == "response.output_text.delta":
                break
        await stream.close()
        state = await wait_finished(engine.step_loop, rid)
        stored = await client.responses.retrieve(rid)
    assert state.finish_reason == "cancelled"
    assert stored.status == "cancelled"


async def test_stored_responses_expire_after_the_ttl_and_are_bounded():
    store = ResponseStore(ttl_s=60, max_count=2)

    def ended(rid: str, ago_s: float) -> StoredResponse:
        response = failed_response(rid, MODEL, time.time(), "server_error", "gone")
        record = StreamRecord(rid, "key", None, OPENAI)
        record.finish()
        record.ended_at = time.monotonic() - ago_s
        return StoredResponse(response, record, [])

    for rid, ago_s in [("resp_old", 61), ("resp_a", 3), ("resp_b", 2), ("resp_c", 1)]:
        store.put("key", ended(rid, ago_s))
    with pytest.raises(APIError, match="No response with id 'resp_old'"):
        store.get("resp_old", "key")  # past its TTL
    with pytest.raises(APIError):
        store.get("resp_a", "key")  # the oldest past the count
    assert store.get("resp_c", "key").response.id == "resp_c"
