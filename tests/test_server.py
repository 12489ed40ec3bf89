"""The OpenAI-compatible server, driven over real HTTP: a uvicorn on 127.0.0.1 (ephemeral
port) over an engine on the demo model, with the official `openai` client and raw SSE bytes."""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import uuid
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import httpx
import openai
import pytest
import pytest_asyncio
from fastapi import FastAPI
from helpers import Served, hold_open, open_served, wait_finished
from openai.types.chat import ChatCompletionChunk
from openai.types.chat.chat_completion_chunk import Choice, ChoiceDelta
from prometheus_client.parser import text_string_to_metric_families

from stepline.api import Engine
from stepline.api.cli.serve import add_serve_parser
from stepline.api.http.serve import bind_socket, serve_in_process
from stepline.api.openai.schema import ChatCompletionRequest
from stepline.api.pipeline.errors import OPENAI, APIError
from stepline.api.pipeline.writer import PING, StreamResponse, TextFrames, sse
from stepline.events.log import TornLineWarning, read_events
from stepline.events.models import Terminal

# One event loop for the module, so that one engine and server serve every test. (Every test
# is async for that reason, even those that need no loop: the mark cannot skip sync tests.)
pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_BODY_BYTES = 64 * 1024
API_KEY = "sk-test-key"
HELLO = [{"role": "user", "content": "Tell me about bread."}]


# A small step budget (helpers.open_served), so that a 1,000-token prompt prefills over several
# steps; beside the default app, the same engine behind --api-key ("keyed").
SERVED = dict(
    max_body_bytes=MAX_BODY_BYTES, apps={"keyed": dict(api_key=API_KEY, strict_max_tokens=True)}
)


@pytest.fixture(scope="module")
def served_options() -> dict:
    return dict(SERVED, event_log=True)


# -- helpers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SSE:
    status: int
    headers: httpx.Headers
    raw: bytes

    @property
    def frames(self) -> list[bytes]:
        """Every event, without its blank-line terminator; the body must end with one."""
        assert self.raw.endswith(b"\n\n"), self.raw[-200:]
        return self.raw[:-2].split(b"\n\n")

    @property
    def data(self) -> list[dict | str]:
        """The `data:` payloads in order (JSON parsed; "[DONE]" as is); pings skipped. Every
        event carries an `id:` line, numbered from 0 without a gap."""
        out: list[dict | str] = []
        for frame in self.frames:
            if frame == PING.rstrip(b"\n"):
                continue
            id_line, _, frame = frame.partition(b"\n")
            assert id_line == b"id: %d" % len(out), id_line
            assert frame.startswith(b"data: ") and b"\n" not in frame, frame
            payload = frame[len(b"data: ") :]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
        return out


async def stream_sse(client: httpx.AsyncClient, path: str, body: dict) -> SSE:
    with anyio.fail_after(30):
        async with client.stream("POST", path, json=body) as r:
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
            return SSE(r.status_code, r.headers, raw)


def fresh(text: str) -> list[dict]:
    """Messages no earlier test sent, so that no prompt tokens come from the prefix cache."""
    return [{"role": "user", "content": f"{text} ({uuid.uuid4().hex[:8]})"}]


def chat_body(**kw) -> dict:
    return {"model": "stepline-demo", "messages": HELLO, "max_tokens": 8, **kw}


def finish_reasons(chunks: list[dict | str]) -> list[str]:
    return [
        c["choices"][0]["finish_reason"]
        for c in chunks
        if isinstance(c, dict) and c.get("choices") and c["choices"][0]["finish_reason"]
    ]


def long_prompt(num_tokens: int) -> list[int]:
    """A prompt of exactly `num_tokens` token ids (ordinary tokens of the demo vocabulary)."""
    return [3 + i % 1000 for i in range(num_tokens)]


async def wait_for_terminal(served: Served, request_id: str) -> Terminal:
    """The request's terminal event, once the step loop has ended it and the log writer has
    written it."""
    loop = served.engine.step_loop
    await wait_finished(loop, request_id)
    await anyio.to_thread.run_sync(loop.event_log.flush)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TornLineWarning)  # the writer may be mid-line, later on
        events = list(read_events(served.event_log))
    return next(e for e in events if isinstance(e, Terminal) and e.request_id == request_id)


async def decoding_request(engine: Engine) -> str:
    """The id of a request that has generated a token, as soon as one has."""
    found = anyio.Event()
    ids: list[str] = []

    def check(loop) -> None:
        ids.extend(s.request_id for s in loop.states.values() if s.status == "decoding")
        if ids:
            found.set()

    engine.step_loop.on_step = check
    try:
        with anyio.fail_after(10):
            await found.wait()
    finally:
        engine.step_loop.on_step = None
    return ids[0]


# -- the official openai client -------------------------------------------------------------


async def test_openai_client_gets_a_chat_completion_whose_id_is_the_request_id(served):
    async with served.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="stepline-demo",
            messages=fresh("Tell me about rye."),
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
    completion = raw.parse()
    assert completion.id.startswith("chatcmpl-")
    assert raw.headers["x-request-id"] == completion.id
    assert completion.choices[0].message.role == "assistant"
    assert isinstance(completion.choices[0].message.content, str)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 8
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 8
    assert (
        0 <= completion.usage.prompt_tokens_details.cached_tokens < completion.usage.prompt_tokens
    )
    terminal = await wait_for_terminal(served, completion.id)  # the id is the log's id
    assert terminal.reason == "length"


async def test_openai_client_streams_the_same_text_it_returns_whole(served):
    kw = dict(
        model="stepline-demo", messages=fresh("Tell me about spelt."), max_tokens=12, temperature=0
    )
    async with served.client() as client:
        whole = await client.chat.completions.create(**kw)
        stream = await client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The same prompt again: its prefix comes from the prefix cache, and usage says so.
    cached_first = whole.usage.prompt_tokens_details.cached_tokens
    cached_again = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached_first < cached_again < whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


async def test_openai_client_gets_completions_streaming_and_not(served):
    kw = dict(model="stepline-demo", prompt="Once upon a time", max_tokens=10, temperature=0)
    async with served.client() as client:
        whole = await client.completions.create(**kw)
        stream = await client.completions.create(**kw, stream=True)
        chunks = [c async for c in stream]
    assert whole.id.startswith("cmpl-")
    assert whole.usage.completion_tokens <= 10
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]


async def test_openai_client_lists_the_served_model(served):
    async with served.client() as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == ["stepline-demo"]
    async with served.http() as http:
        card = (await http.get("/v1/models/stepline-demo")).json()
        missing = await http.get("/v1/models/gpt-4")
    assert card["max_model_len"] == served.engine.max_context
    assert missing.status_code == 404


async def test_openai_client_raises_on_unknown_model_and_bad_key(served):
    async with served.client() as client:
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-4", messages=HELLO)
    keyed = f"{served.urls['keyed']}/v1"
    async with openai.AsyncOpenAI(base_url=keyed, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model="stepline-demo", messages=HELLO, max_tokens=4)
    async with openai.AsyncOpenAI(base_url=keyed, api_key=API_KEY, max_retries=0) as good:
        completion = await good.chat.completions.create(
            model="stepline-demo", messages=HELLO, max_tokens=4
        )
    assert completion.choices[0].finish_reason in ("stop", "length")


# -- the stream, byte by byte ---------------------------------------------------------------


async def test_chat_stream_frames_are_role_deltas_one_finish_usage_and_done(served):
    async with served.http() as http:
        sse = await stream_sse(
            http,
            "/v1/chat/completions",
            chat_body(
                messages=fresh("Tell me about barley."),
                stream=True,
                ignore_eos=True,
                stream_options={"include_usage": True},
            ),
        )
    assert sse.status == 200
    assert sse.headers["content-type"] == "text/event-stream; charset=utf-8"
    rid = sse.headers["x-request-id"]
    assert sse.raw.endswith(b"\n\nid: %d\ndata: [DONE]\n\n" % (len(sse.frames) - 1))
    data = sse.data
    assert data[-1] == "[DONE]"
    chunks = data[:-1]
    assert all(c["id"] == rid and c["object"] == "chat.completion.chunk" for c in chunks)
    first, *deltas, finish, usage = chunks
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert first["usage"] is None
    for d in deltas:
        assert list(d["choices"][0]["delta"]) == ["content"]
        assert d["choices"][0]["finish_reason"] is None
        assert d["usage"] is None
    assert finish["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    ]
    assert usage["choices"] == []
    num_prompt = usage["usage"]["prompt_tokens"]
    assert usage["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 8,
        "total_tokens": num_prompt + 8,
        "prompt_tokens_details": {
            "cached_tokens": usage["usage"]["prompt_tokens_details"]["cached_tokens"]
        },
    }
    assert 0 <= usage["usage"]["prompt_tokens_details"]["cached_tokens"] < num_prompt


async def test_chat_stream_without_include_usage_sends_no_usage_key(served):
    async with served.http() as http:
        sse = await stream_sse(http, "/v1/chat/completions", chat_body(stream=True))
    chunks = sse.data[:-1]
    assert all("usage" not in c for c in chunks)
    assert len(finish_reasons(chunks)) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_completion_stream_frames_are_text_deltas_one_finish_and_done(served):
    async with served.http() as http:
        sse = await stream_sse(
            http,
            "/v1/completions",
            {"prompt": "The oven", "max_tokens": 6, "stream": True, "ignore_eos": True},
        )
    rid = sse.headers["x-request-id"]
    assert rid.startswith("cmpl-")
    *chunks, done = sse.data
    assert done == "[DONE]"
    assert all(c["object"] == "text_completion" and c["id"] == rid for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "length"
    ]
    assert chunks[-1]["choices"][0]["text"] == ""


@pytest.mark.parametrize(
    "text", ["plain", 'quote " and \\ slash', "line\nbreak\t", "\x01\x7f", "é 🍞"]
)
async def test_text_frames_from_the_template_equal_the_model_dump(text):
    def chunk(content: str) -> ChatCompletionChunk:
        choice = Choice(index=0, delta=ChoiceDelta(content=content), finish_reason=None)
        return ChatCompletionChunk(
            id="chatcmpl-x", object="chat.completion.chunk", created=1, model="m", choices=[choice]
        )

    frames = TextFrames(chunk(TextFrames.SENTINEL), exclude_unset=True)
    assert frames(text) == sse(chunk(text), exclude_unset=True)


async def test_a_long_prompt_gets_ping_comments_while_it_prefills(served):
    body = {"prompt": long_prompt(1000), "max_tokens": 2, "stream": True}
    async with served.http() as http:
        sse = await stream_sse(http, "/v1/completions", body)
    frames = sse.frames
    first_data = next(i for i, f in enumerate(frames) if f.startswith(b"id: 0\ndata: "))
    assert first_data >= 2  # 1,000 tokens at 128 a step: several chunks before the first token
    assert all(f == b": ping" for f in frames[:first_data])
    assert sse.data[-1] == "[DONE]"


async def test_the_heartbeat_pings_a_stream_that_sends_nothing_for_a_while():
    pinged = anyio.Event()

    async def slow(emit):
        await pinged.wait()  # silent until the client has seen two heartbeats
        await emit(b"data: late\n\n")

    async def nothing():
        pass

    app = FastAPI()
    app.add_api_route(
        "/slow",
        lambda: StreamResponse(slow, wire=OPENAI, headers={}, heartbeat_s=0.1, on_close=nothing),
    )
    content = b""
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as http:
        with anyio.fail_after(10):
            async with http.stream("GET", "/slow") as r:
                async for chunk in r.aiter_raw():
                    content += chunk
                    if content.startswith(PING * 2):
                        pinged.set()
    assert content.endswith(b"data: late\n\n")
    assert content.startswith(PING * 2)


async def test_a_stream_cut_by_server_shutdown_still_ends_with_an_error_and_done():
    async def forever(emit):
        await emit(b"data: {}\n\n")
        await anyio.sleep_forever()

    async def nothing():
        pass

    app = FastAPI()
    app.add_api_route(
        "/forever",
        lambda: StreamResponse(forever, wire=OPENAI, headers={}, heartbeat_s=60, on_close=nothing),
    )
    started = anyio.Event()

    async def read(url: str) -> bytes:
        async with httpx.AsyncClient(base_url=url) as http, http.stream("GET", "/forever") as r:
            raw = b""
            async for chunk in r.aiter_raw():
                raw += chunk
                started.set()
            return raw

    with anyio.fail_after(10):
        async with serve_in_process(app, graceful_shutdown_s=0.1) as url:
            reader = asyncio.ensure_future(read(url))
            await started.wait()
        raw = await reader
    assert raw.startswith(b"data: {}\n\n")
    assert b'"code":"shutting_down"' in raw
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")


async def test_stream_logprobs_give_one_entry_per_token_with_top_alternatives(served):
    async with served.http() as http:
        sse = await stream_sse(
            http,
            "/v1/chat/completions",
            chat_body(stream=True, ignore_eos=True, logprobs=True, top_logprobs=3),
        )
        whole = (
            await http.post(
                "/v1/completions",
                json={"prompt": "Bread", "max_tokens": 5, "ignore_eos": True, "logprobs": 2},
            )
        ).json()
    entries = [
        e
        for c in sse.data[1:-2]
        for e in (c["choices"][0]["logprobs"] or {"content": []})["content"]
    ]
    assert len(entries) == 8
    assert all(len(e["top_logprobs"]) == 3 and e["logprob"] <= 0 for e in entries)
    lp = whole["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert lp["text_offset"][0] == 0


# -- sampling -------------------------------------------------------------------------------


async def test_the_same_seed_gives_the_same_text_twice(served):
    body = chat_body(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    async with served.http() as http:
        a, b = [(await http.post("/v1/chat/completions", json=body)).json() for _ in range(2)]
    assert a["id"] != b["id"]
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


async def test_a_stop_string_ends_the_text_before_it(served):
    body = {"prompt": "The crust", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    async with served.http() as http:
        full = (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        stop = full[len(full) // 2 :][:3]
        cut = (await http.post("/v1/completions", json={**body, "stop": [stop]})).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == full[: full.index(stop)]


async def test_developer_role_and_consecutive_messages_render_like_their_merged_form(served):
    split = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "user", "content": "again"},
    ]
    merged = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello\n\nagain"},
    ]
    body = {"max_tokens": 8, "temperature": 0}
    async with served.http() as http:
        a = (await http.post("/v1/chat/completions", json={**body, "messages": split})).json()
        b = (await http.post("/v1/chat/completions", json={**body, "messages": merged})).json()
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


async def test_chat_request_refuses_image_parts_and_keeps_tool_messages():
    image = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    )
    with pytest.raises(APIError, match="image_url must be"):  # no url
        image.engine_messages()
    tool = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "tool", "content": "42", "tool_call_id": "x"}]}
    )
    assert tool.engine_messages() == [{"role": "tool", "content": "42", "tool_call_id": "x"}]


# -- bad input ------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # wrong types
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": "5"}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": True}, "max_tokens"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": MSG, "temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"messages": MSG, "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None),
        ("/v1/chat/completions", {}, "messages"),
        ("/v1/completions", {"prompt": 42}, "prompt"),
        # out of range
        ("/v1/chat/completions", {"messages": MSG, "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"messages": MSG, "top_p": 1.5}, "top_p"),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MSG, "presence_penalty": 3}, "presence_penalty"),
        ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, None),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 4}, "messages"),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        # not supported: said so, never ignored
        ("/v1/chat/completions", {"messages": MSG, "n": 2}, "n"),
        ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}, "tools"),
        (
            "/v1/chat/completions",
            {"messages": MSG, "response_format": {"type": "xml"}},
            "response_format",
        ),
        (
            "/v1/completions",
            {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format",
        ),
        ("/v1/chat/completions", {"messages": MSG, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"messages": MSG, "functions": [{"name": "f"}]}, "functions"),
        ("/v1/completions", {"prompt": "a", "tools": []}, "tools"),
        # accepted by others, ignored by this model's template: refused, not ignored
        ("/v1/chat/completions", {"messages": MSG, "reasoning_effort": "high"}, "reasoning_effort"),
        (
            "/v1/chat/completions",
            {"messages": MSG, "chat_template_kwargs": {"no_such_option": True}},
            "chat_template_kwargs",
        ),
        ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"5": 10}}, "logit_bias"),
        ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": MSG, "stream_options": {}}, "stream_options"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": "a", "echo": True}, "echo"),
    ],
)
async def test_bad_input_gets_400_with_an_openai_error_body(served, path, body, param):
    async with served.http() as http:
        r = await http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param)
    assert r.headers["x-request-id"].startswith(("chatcmpl-", "cmpl-"))


async def test_invalid_json_gets_400_that_says_so(served):
    async with served.http() as http:
        r = await http.post(
            "/v1/chat/completions",
            content=b'{"messages": [',
            headers={"content-type": "application/json"},
        )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"


async def test_unknown_model_gets_404_naming_the_served_one(served):
    async with served.http() as http:
        r = await http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": MSG})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert "stepline-demo" in r.json()["error"]["message"]


async def test_a_prompt_longer_than_the_context_gets_400_with_both_numbers(served):
    async with served.http() as http:
        r = await http.post("/v1/completions", json={"prompt": long_prompt(2100)})
    error = r.json()["error"]
    assert r.status_code == 400
    assert error["code"] == "context_length_exceeded"
    assert "2048" in error["message"] and "2100" in error["message"]


async def test_a_max_tokens_past_the_context_is_clamped_unless_strict(served):
    # Not long_prompt's tokens: a cached prefix of them would spoil the mid-prefill tests.
    prompt = [1002 - i % 1000 for i in range(2040)]
    body = {"prompt": prompt, "max_tokens": 5000, "ignore_eos": True}
    async with served.http() as http:
        clamped = await http.post("/v1/completions", json=body)
        keyed = {"authorization": f"Bearer {API_KEY}"}  # served with strict_max_tokens
        strict = await http.post(f"{served.urls['keyed']}/v1/completions", json=body, headers=keyed)
    assert clamped.status_code == 200
    assert clamped.headers["x-stepline-max-tokens"] == "8"
    assert clamped.json()["usage"]["completion_tokens"] == 8
    assert clamped.json()["choices"][0]["finish_reason"] == "length"
    assert strict.status_code == 400
    assert strict.json()["error"]["code"] == "context_length_exceeded"
    assert strict.json()["error"]["param"] == "max_tokens"


async def test_a_body_over_the_limit_gets_413_with_or_without_a_length(served):
    big = json.dumps({"prompt": "x" * MAX_BODY_BYTES}).encode()

    async def chunked():
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    async with served.http() as http:
        json_type = {"content-type": "application/json"}
        sized = await http.post("/v1/completions", content=big, headers=json_type)
        streamed = await http.post("/v1/completions", content=chunked(), headers=json_type)
    for r in (sized, streamed):
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"


async def test_a_missing_or_wrong_key_gets_401_and_probes_stay_open(served):
    async with httpx.AsyncClient(base_url=served.urls["keyed"]) as http:
        missing = await http.post("/v1/chat/completions", json=chat_body())
        wrong = await http.get("/v1/models", headers={"authorization": "Bearer nope"})
        right = await http.get("/v1/models", headers={"authorization": f"Bearer {API_KEY}"})
        health = await http.get("/health")
    for r in (missing, wrong):
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert right.status_code == 200
    assert health.status_code == 200


async def test_unknown_routes_get_an_openai_error_body(served):
    async with served.http() as http:
        r = await http.get("/v1/nothing")
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- disconnects and concurrency ------------------------------------------------------------


async def test_disconnecting_mid_stream_cancels_the_request_and_spares_the_others(served):
    long_body = chat_body(stream=True, max_tokens=1500, ignore_eos=True)
    async with served.http() as http:
        other = asyncio.ensure_future(
            stream_sse(http, "/v1/chat/completions", chat_body(stream=True, max_tokens=64))
        )
        with anyio.fail_after(30):
            async with http.stream("POST", "/v1/chat/completions", json=long_body) as r:
                rid = r.headers["x-request-id"]
                async for line in r.aiter_lines():
                    if '"content"' in line and '"role"' not in line:
                        break  # a token arrived: hang up
        survivor = await other
    terminal = await wait_for_terminal(served, rid)
    assert terminal.reason == "cancelled"
    state = served.engine.step_loop.state_of(rid)
    assert state.is_finished and state.num_output_tokens < 1500
    assert survivor.data[-1] == "[DONE]"
    assert finish_reasons(survivor.data) in (["stop"], ["length"])


async def test_disconnecting_mid_prefill_cancels_before_any_token(served):
    body = {"prompt": long_prompt(1500), "max_tokens": 4, "stream": True}
    async with served.http() as http:
        with anyio.fail_after(30):
            async with http.stream("POST", "/v1/completions", json=body) as r:
                rid = r.headers["x-request-id"]
                async for line in r.aiter_lines():
                    assert line in (": ping", ""), line  # hang up at the first ping
                    if line == ": ping":
                        break
    terminal = await wait_for_terminal(served, rid)
    assert terminal.reason == "cancelled"
    assert served.engine.step_loop.state_of(rid).num_output_tokens == 0


async def test_disconnecting_from_a_non_streaming_request_cancels_it(served):
    body = chat_body(max_tokens=1500, ignore_eos=True)
    async with served.http() as http:
        task = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
        live = await decoding_request(served.engine)
        task.cancel()  # the client gives up: httpx closes the connection
        with pytest.raises(asyncio.CancelledError):
            await task
    terminal = await wait_for_terminal(served, live)
    assert terminal.reason == "cancelled"


async def test_32_concurrent_streams_each_finish_once_and_end_with_done(served):
    async with served.http(limits=httpx.Limits(max_connections=64)) as http:
        results = await asyncio.gather(
            *[
                stream_sse(
                    http,
                    "/v1/chat/completions" if i % 2 else "/v1/completions",
                    chat_body(stream=True, max_tokens=8 + i % 5, seed=i)
                    if i % 2
                    else {"prompt": f"Loaf {i}", "max_tokens": 8, "stream": True},
                )
                for i in range(32)
            ]
        )
    assert len({r.headers["x-request-id"] for r in results}) == 32
    for r in results:
        assert r.status == 200
        assert r.data[-1] == "[DONE]"
        assert len(finish_reasons(r.data)) == 1


# -- probes ---------------------------------------------------------------------------------


async def test_health_says_ok_and_metrics_parse_as_prometheus_text(served):
    async with served.http() as http:
        health = await http.get("/health")
        metrics = await http.get("/metrics")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert metrics.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(metrics.text)}
    for name in (
        "stepline_requests_waiting",
        "stepline_requests_prefilling",
        "stepline_requests_decoding",
        "stepline_step_budget_use",
        "stepline_time_to_first_token_seconds",
        "stepline_inter_token_latency_seconds",
        "stepline_generated_tokens",
        "stepline_event_log_lag_events",
    ):
        assert name in names


@pytest_asyncio.fixture(loop_scope="module")
async def doomed(demo) -> AsyncIterator[Served]:
    """An engine of its own, for tests that kill it."""
    value, close = await hold_open(open_served(**SERVED))
    yield value
    await close()


async def test_an_engine_failure_mid_stream_sends_an_error_frame_then_done(doomed):
    body = chat_body(stream=True, max_tokens=1500, ignore_eos=True)
    async with doomed.http() as http:
        with anyio.fail_after(30):
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                raw = b""
                async for chunk in r.aiter_raw():
                    if not raw:  # the first token is out: now the executor dies
                        doomed.engine.step_loop.executor.mark_dead(RuntimeError("boom"))
                    raw += chunk
        sse = SSE(r.status_code, r.headers, raw)
        health = await http.get("/health")
        after = await http.post("/v1/chat/completions", json=chat_body())
    *_, error, done = sse.data
    assert done == "[DONE]"
    assert set(error) == {"error"}
    # The client gets a stable message naming its request; the exception is for the log.
    assert error["error"]["code"] == "engine_unhealthy"
    assert r.headers["x-request-id"] in error["error"]["message"]
    assert "boom" not in error["error"]["message"]
    assert finish_reasons(sse.data) == []
    assert health.status_code == 503
    assert "boom" in health.json()["reason"]
    assert after.status_code == 503
    assert after.json()["error"]["code"] == "engine_unhealthy"


async def test_an_engine_failure_fails_a_non_streaming_request_with_503(doomed):
    async with doomed.http() as http:
        task = asyncio.ensure_future(
            http.post("/v1/chat/completions", json=chat_body(max_tokens=1500, ignore_eos=True))
        )
        await decoding_request(doomed.engine)
        doomed.engine.step_loop.executor.mark_dead(RuntimeError("boom"))
        with anyio.fail_after(10):
            r = await task
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "engine_unhealthy"
    assert r.headers["x-request-id"] in r.json()["error"]["message"]
    assert "boom" not in r.text


# -- the command ----------------------------------------------------------------------------


def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    return parser.parse_args(["serve", *argv])


async def test_serve_binds_localhost_port_8000_by_default():
    args = _serve_args([])
    assert (args.host, args.port) == ("127.0.0.1", 8000)


async def test_serve_reports_a_port_in_use_before_loading_any_model(capsys):
    taken = bind_socket("127.0.0.1", 0)
    try:
        args = _serve_args(["--port", str(taken.getsockname()[1]), "--model", "/nonexistent"])
        assert args.func(args) == 1
    finally:
        taken.close()
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


async def test_serve_prints_a_curl_line_that_streams():
    from stepline.api.http.serve import _curl_line

    line = _curl_line("http://127.0.0.1:8000", "stepline-demo", api_key=None)
    assert line.startswith("curl -N http://127.0.0.1:8000/v1/chat/completions")
    body = json.loads(line.split("-d '", 1)[1].rstrip("'"))
    assert body["stream"] is True and body["model"] == "stepline-demo"


async def test_a_failed_event_log_shows_on_health_and_metrics_while_serving_goes_on(tmp_path):
    class FullDisk:
        def __init__(self, real) -> None:
            self.real = real

        def write(self, data) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self) -> None:
            self.real.close()

    async with open_served(event_log=tmp_path / "events.jsonl", **SERVED) as served:
        writer = served.engine.step_loop.event_log
        async with served.http() as client:
            assert (await client.get("/health")).json()["status"] == "ok"
            writer._file = FullDisk(writer._file)  # a disk that fills up now
            for _ in range(2):
                r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
                assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
            health = await client.get("/health")
            metrics = (await client.get("/metrics")).text
    assert health.status_code == 200  # still serving
    body = health.json()
    assert body["status"] == "degraded" and "No space left" in body["event_log"]
    assert "stepline_event_log_degraded 1.0" in metrics
    dropped = next(
        line for line in metrics.splitlines() if line.startswith("stepline_event_log_dropped")
    )
    assert float(dropped.split()[-1]) > 0


async def test_a_burst_over_http_is_gathered_so_its_first_step_takes_the_shortest(demo):
    # Over HTTP a request is parsed and tokenized before `Engine.submit`. The short chats
    # here are tokenized after the long one: without waiting for the requests the server is
    # still preparing, the long one would start the first step alone.
    long_text = "a long prompt " * 12
    async with open_served() as served:
        engine = served.engine
        prepare = engine.prepare_async
        long_prepared = anyio.Event()

        async def slow_for_short(prompt, messages, template_kwargs):
            # The short chats are tokenized once the long one is.
            if messages and messages[-1]["content"].startswith("hi "):
                await long_prepared.wait()
            prepared = await prepare(prompt, messages, template_kwargs)
            if messages and messages[-1]["content"] == long_text:
                long_prepared.set()
            return prepared

        engine.prepare_async = slow_for_short
        first: dict[str, tuple[int, int]] = {}

        def on_step(loop) -> None:
            if not first:
                first.update(
                    {
                        r: (s.num_prompt_tokens, s.num_computed_tokens)
                        for r, s in loop.states.items()
                    }
                )

        engine.step_loop.on_step = on_step
        async with served.client() as client:

            async def chat(text: str) -> None:
                await client.chat.completions.create(
                    model="stepline-demo",
                    messages=[{"role": "user", "content": text}],
                    max_tokens=2,
                    temperature=0,
                )

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(chat, long_text)
                    for i in range(4):
                        tg.start_soon(chat, f"hi {i}")
    assert len(first) == 5  # all five were admitted before the first step
    shorts = [(n, done) for n, done in first.values() if n < 30]
    assert len(shorts) == 4 and all(done == n for n, done in shorts)  # and the short ones ran
    assert engine.snapshot.num_preparing == 0
