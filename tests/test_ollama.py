"""Ollama's API over real HTTP with the official `ollama` client: a uvicorn on 127.0.0.1 over
an engine on the demo model. The same engine answers the OpenAI door, so the two doors are
compared on the same requests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import jsonschema
import ollama
import openai
import pytest
import pytest_asyncio
from helpers import WEATHER_ARGS, wait_finished

from stepline.api.defaults import resolve
from stepline.api.ollama.facts import ModelFacts

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "stepline-demo"
HI = [{"role": "user", "content": "Tell me about rye bread."}]
GREEDY = {"temperature": 0, "num_predict": 12}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest_asyncio.fixture(loop_scope="module")
async def c(served) -> AsyncIterator[ollama.AsyncClient]:
    async with ollama.AsyncClient(host=served.url) as value:
        yield value


async def test_the_served_model_is_listed_running_and_shown(served, c):
    [listed] = (await c.list()).models
    [running] = (await c.ps()).models
    shown = await c.show(MODEL)
    assert listed.model == running.model == f"{MODEL}:latest"  # as Ollama lists its models
    assert listed.size > 0 and listed.details.family == "llama"
    assert running.context_length == served.engine.max_context
    assert shown.modelinfo["llama.context_length"] == served.engine.max_context
    assert shown.modelinfo["general.parameter_count"] > 0
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    assert listed.details.format == "safetensors"  # a directory, not a GGUF file
    assert shown.modelinfo["stepline.weights"] == served.engine.loaded.weights  # as served
    async with httpx.AsyncClient(base_url=served.url) as http:
        version = (await http.get("/api/version")).json()["version"]
        tags = (await http.get("/api/tags")).json()
    assert version.count(".") == 2
    assert tags["models"][0]["name"] == f"{MODEL}:latest"  # Open WebUI reads `name`


async def test_a_greedy_chat_says_what_the_openai_door_says(served, c):
    answer = await c.chat(model=MODEL, messages=HI, options=GREEDY)
    async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x") as oai:
        same = await oai.chat.completions.create(
            model=MODEL, messages=HI, temperature=0, max_tokens=12
        )
    assert answer.message.role == "assistant"
    assert answer.message.content == same.choices[0].message.content
    assert answer.done and answer.done_reason == "length"
    assert answer.eval_count == 12
    assert answer.prompt_eval_count == same.usage.prompt_tokens
    assert answer.total_duration >= answer.prompt_eval_duration > 0
    assert answer.eval_duration > 0  # clients show eval_count / eval_duration as tokens/s


async def test_a_streamed_chat_adds_up_to_the_whole_answer(c):
    whole = await c.chat(model=f"{MODEL}:latest", messages=HI, options=GREEDY)
    parts = [p async for p in await c.chat(model=MODEL, messages=HI, options=GREEDY, stream=True)]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == 12 and parts[-1].done_reason == "length"


async def test_generate_applies_the_template_unless_raw(c):
    templated = await c.generate(model=MODEL, prompt="Hello", options=GREEDY)
    raw = await c.generate(model=MODEL, prompt="Hello", raw=True, options=GREEDY)
    streamed = [
        p async for p in await c.generate(model=MODEL, prompt="Hello", options=GREEDY, stream=True)
    ]
    assert templated.prompt_eval_count > raw.prompt_eval_count  # the chat markup
    assert "".join(p.response for p in streamed) == templated.response
    assert templated.eval_count == raw.eval_count == 12


async def test_format_constrains_the_answer_to_json(c):
    shaped = await c.chat(model=MODEL, messages=HI, format=PERSON, options={"temperature": 0})
    any_json = await c.generate(model=MODEL, prompt="Hi", format="json", options=GREEDY)
    jsonschema.validate(json.loads(shaped.message.content), PERSON)
    assert shaped.done_reason == "stop"
    assert any_json.response.startswith("{")  # a random model may stop inside the object


async def test_a_conversation_with_tool_calls_and_results_is_accepted(c):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_ARGS}}]
    history = [
        *HI,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    answer = await c.chat(model=MODEL, messages=history, tools=tools, options=GREEDY)
    assert answer.done and answer.prompt_eval_count > 0


@pytest.mark.parametrize(
    ("body", "status", "match"),
    [
        ({"model": "llama3.2", "messages": HI}, 404, "'llama3.2' does not exist"),
        ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400, "images"),
        ({"messages": HI, "options": {"mirostat": 2}}, 400, "options.mirostat"),
        ({"messages": HI, "options": {"temperature": "hot"}}, 400, "temperature"),
        ({"messages": HI, "format": "yaml"}, 400, "format"),
    ],
)
async def test_what_cannot_be_served_is_an_ollama_error(served, body, status, match):
    # Sent as raw JSON: the client itself refuses some of these before sending them.
    async with httpx.AsyncClient(base_url=served.url) as http:
        r = await http.post("/api/chat", json={"model": MODEL, "stream": False, **body})
    assert r.status_code == status
    assert list(r.json()) == ["error"]
    with pytest.raises(ollama.ResponseError, match=match):
        raise ollama.ResponseError(r.text, r.status_code)  # how the client reads it


async def test_ollamas_documented_curl_calls_work_and_pages_cannot_post_cross_site(served):
    body = json.dumps({"model": MODEL, "prompt": "Hi", "options": GREEDY})  # stream by default
    form = {"content-type": "application/x-www-form-urlencoded"}  # what `curl -d` sends
    async with httpx.AsyncClient(base_url=served.url) as http:
        curl = await http.post("/api/generate", content=body, headers=form)
        page = await http.post(
            "/api/generate", content=body, headers={**form, "origin": "https://evil.example"}
        )
        loaded = await http.post("/api/chat", json={"model": MODEL, "messages": []})
    lines = [json.loads(line) for line in curl.text.splitlines()]
    assert curl.headers["content-type"] == "application/x-ndjson"
    assert lines[-1]["done"] is True and not any(line["done"] for line in lines[:-1])
    assert page.status_code == 415 and "error" in page.json()
    assert loaded.json()["done_reason"] == "load"


async def test_a_stream_whose_client_leaves_is_cancelled(served):
    body = {"model": MODEL, "messages": HI, "options": {"num_predict": 2000}}
    async with httpx.AsyncClient(base_url=served.url) as http:
        async with http.stream("POST", "/api/chat", json=body) as r:
            rid = r.headers["x-request-id"]
            async for _ in r.aiter_lines():
                break
    state = await wait_finished(served.engine.step_loop, rid)
    assert state.finish_reason == "cancelled"


async def test_a_gguf_models_listing_says_its_file_type_and_counts_its_parameters(smollm2):
    facts = ModelFacts.read(Path(smollm2.path))  # SmolLM2-135M, from a Q4_1 GGUF file
    assert (facts.parameter_size, facts.quantization_level) == ("135M", "Q4_1")
    assert facts.format == "gguf" and facts.size > 90_000_000  # the file's size
    # A GGUF file ships no generation_config.json; the default model's converted directory
    # gets its authors' recommendation (the model card's temperature 0.2, top-p 0.9) with
    # stepline's repetition penalty and cap, so an answer that sets none ends by itself.
    defaults = resolve(Path(smollm2.path))
    assert defaults.sampling.values() == {
        "temperature": 0.2,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
    }
    assert defaults.max_tokens == 1024
    assert defaults.source == "generation_config.json"


async def _params(served, body: dict):
    """The request `body` ran as (its first line read, then it is stopped: an answer to the
    whole context takes the demo model a while)."""
    async with httpx.AsyncClient(base_url=served.url) as http:
        async with http.stream("POST", "/api/chat", json={"model": MODEL, **body}) as r:
            assert r.status_code == 200
            async for _ in r.aiter_lines():
                break
    return await wait_finished(served.engine.step_loop, r.headers["x-request-id"])


async def test_a_request_with_no_options_gets_ollamas_default_options(served, c):
    state = await _params(served, {"messages": HI})
    params = state.params
    # Ollama's DefaultOptions (api/types.go): the demo model's directory sets none of its own.
    assert (params.temperature, params.top_k, params.top_p) == (0.8, 40, 0.9)
    assert params.repetition_penalty == 1.0 and params.min_p == 0.0
    assert params.repeat_last_n == 64  # the penalties look at the last 64 tokens
    room = served.engine.max_context - state.num_prompt_tokens
    assert params.max_tokens == min(4096, room)  # the default cap, cut to the room
    assert params.loop_guard  # no num_predict: an answer that loops ends
    shown = await c.show(MODEL)
    assert "temperature                    0.8" in shown.parameters
    assert "repeat_penalty                 1" in shown.parameters
    assert "repeat_last_n                  64" in shown.parameters


@pytest.mark.parametrize(("n", "window"), [(8, 8), (0, 0), (-1, None)])
async def test_repeat_last_n_is_the_penalties_window(served, n, window):
    options = {"repeat_last_n": n, "repeat_penalty": 1.2, "num_predict": 2}
    state = await _params(served, {"messages": HI, "options": options})
    assert state.params.repeat_last_n == window  # -1: all of num_ctx, the whole context
    assert state.params.loop_guard  # num_predict set: a cap is no ask for a loop


async def test_num_predict_minus_one_asks_for_the_whole_context(served):
    state = await _params(served, {"messages": HI, "options": {"num_predict": -1}})
    assert state.params.max_tokens == served.engine.max_context - state.num_prompt_tokens
    assert state.params.loop_guard  # the whole context, not a loop through it


async def test_num_ctx_bounds_the_request_and_past_the_model_s_context_is_refused(served, c):
    state = await _params(served, {"messages": HI, "options": {"num_ctx": 64}})
    assert state.num_prompt_tokens + state.params.max_tokens == 64
    too_big = served.engine.max_context + 1
    with pytest.raises(ollama.ResponseError, match=f"num_ctx is {too_big}.*at most") as err:
        await c.chat(model=MODEL, messages=HI, options={"num_ctx": too_big})
    assert err.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match="maximum context length is 4 tokens"):
        await c.chat(model=MODEL, messages=HI, options={"num_ctx": 4})


async def test_pull_and_delete_answer_that_models_come_from_the_command_line(c):
    assert (await c.pull(MODEL)).status == "success"  # served already: nothing to fetch
    assert [p.status async for p in await c.pull(f"{MODEL}:latest", stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError, match="--model") as missing:
        await c.pull("llama3.2")
    assert missing.value.status_code == 404
    with pytest.raises(ollama.ResponseError, match="--model") as refused:
        await c.delete(MODEL)
    assert refused.value.status_code == 400
