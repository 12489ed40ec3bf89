"""Streams that survive a dropped connection, over real HTTP: a uvicorn on 127.0.0.1 over an
engine on the demo model, httpx reading raw SSE bytes and reconnecting with Last-Event-ID."""

from __future__ import annotations

import re
import time

import anyio
import httpx
import pytest
from helpers import wait_finished, wait_until
from starlette.datastructures import Headers

from stepline.api.pipeline import resume
from stepline.api.pipeline.errors import OPENAI
from stepline.api.pipeline.resume import FrameCounter, ResumeRegistry, key_of
from stepline.api.pipeline.writer import PING

pytestmark = pytest.mark.asyncio(loop_scope="module")

GRACE_S = 1.5
PROMPT = [{"role": "user", "content": "Tell me about sourdough."}]


@pytest.fixture(scope="module")
def served_options() -> dict:
    # No loop guard: the demo's Anthropic answers (whose max_tokens is always set) would
    # otherwise end as loops before a dropped stream's grace runs out.
    return dict(resume_grace_s=GRACE_S, loop_guard="off")


def client(url: str, key: str = "sk-one") -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=30, headers={"authorization": f"Bearer {key}"})


def body(**kw) -> dict:
    return {
        "model": "stepline-demo",
        "messages": PROMPT,
        "max_tokens": 120,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"resumable": True},
        **kw,
    }


async def read_all(http: httpx.AsyncClient, method: str, path: str, **kw) -> httpx.Response:
    with anyio.fail_after(30):
        async with http.stream(method, path, **kw) as r:
            await r.aread()
            return r


async def read_frames_then_drop(
    http: httpx.AsyncClient, n: int, path: str = "/v1/chat/completions", **kw
) -> tuple[str, bytes]:
    """Start a stream, keep its first `n` frames, hang up; (its request id, those bytes)."""
    raw = b""
    with anyio.fail_after(30):
        async with http.stream("POST", path, **kw) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            async for chunk in r.aiter_raw():
                raw += chunk
                if raw.count(b"\n\n") >= n:
                    break
    frames = raw.split(b"\n\n")[:n]
    return rid, b"\n\n".join(frames) + b"\n\n"


def same_but_ids(raw: bytes, rid: str, other: bytes, other_rid: str) -> None:
    """`raw` equals `other` but for the request id and the `created` second."""

    def norm(b: bytes, r: str) -> bytes:
        return re.sub(rb'"created":\d+', b'"created":0', b.replace(r.encode(), b"RID"))

    assert norm(raw, rid) == norm(other, other_rid)


# -- frames and the registry, without a server -----------------------------------------------


async def test_frames_are_numbered_from_zero_and_pings_are_not():
    counter = FrameCounter()
    out = counter.split(b"data: a\n\ndata: b\n\n" + PING + b"data: [DONE]\n\n")
    assert out == [b"id: 0\ndata: a\n\n", b"id: 1\ndata: b\n\n", PING, b"id: 2\ndata: [DONE]\n\n"]


async def test_a_stream_is_private_to_the_key_that_started_it():
    registry = ResumeRegistry(grace_s=60)
    mine = key_of(Headers({"authorization": "Bearer sk-a"}))
    registry.open("chatcmpl-1", mine, OPENAI)
    assert registry.get("chatcmpl-1", mine).rid == "chatcmpl-1"
    theirs = key_of(Headers({"x-api-key": "sk-b"}))
    with pytest.raises(Exception, match="no stream 'chatcmpl-1' to resume"):
        registry.get("chatcmpl-1", theirs)


# -- over HTTP -------------------------------------------------------------------------------


async def test_a_dropped_stream_resumes_with_last_event_id_and_equals_an_uninterrupted_run(
    served,
):
    async with client(served.url) as http:
        whole = await read_all(http, "POST", "/v1/chat/completions", json=body())
        rid, head = await read_frames_then_drop(http, 5, json=body())
        tail = await read_all(
            http, "GET", f"/v1/requests/{rid}/stream", headers={"last-event-id": "4"}
        )
        replay = await read_all(http, "GET", f"/v1/requests/{rid}/stream")
    assert tail.status_code == 200 and tail.headers["x-request-id"] == rid
    assert tail.content.startswith(b"id: 5\n")
    assert tail.content.endswith(b"data: [DONE]\n\n")
    resumed = head + tail.content
    # Byte for byte what the request's record holds, and what an uninterrupted run got.
    assert resumed == replay.content
    same_but_ids(resumed, rid, whole.content, whole.headers["x-request-id"])
    assert resumed.count(b'"finish_reason":"length"') == 1
    assert (await wait_finished(served.engine.step_loop, rid, 5)).finish_reason == "length"


async def test_completions_resume_too_when_asked_by_header(served):
    kw = dict(
        json={"prompt": "Once upon a time", "max_tokens": 30, "ignore_eos": True, "stream": True},
        headers={"x-stepline-resumable": "1"},
    )
    async with client(served.url) as http:
        with anyio.fail_after(30):
            async with http.stream("POST", "/v1/completions", **kw) as r:
                rid = r.headers["x-request-id"]
                head = b""
                async for chunk in r.aiter_raw():
                    head += chunk
                    if b"\n\n" in head:
                        break
        head = head.split(b"\n\n")[0] + b"\n\n"
        assert head.startswith(b"id: 0\ndata: ")
        tail = await read_all(
            http, "GET", f"/v1/requests/{rid}/stream", headers={"last-event-id": "0"}
        )
    assert tail.content.startswith(b"id: 1\n")
    assert tail.content.endswith(b"data: [DONE]\n\n")


async def test_a_resumable_stream_nobody_resumes_is_cancelled_after_the_grace(served):
    engine = served.engine
    max_tokens = engine.max_context - 64
    async with client(served.url) as http:
        rid, _ = await read_frames_then_drop(http, 2, json=body(max_tokens=max_tokens))
        loop = engine.step_loop
        dropped_at = loop.state_of(rid).num_output_tokens
        # The disconnect did not cancel it: it generates on, with nobody following.
        await wait_until(loop, lambda: loop.state_of(rid).num_output_tokens > dropped_at + 8)
        state = loop.state_of(rid)
        assert state is not None and not state.is_finished
        state = await wait_finished(engine.step_loop, rid, GRACE_S * 4 + 10)
        assert state.finish_reason == "cancelled"
        assert state.num_output_tokens < max_tokens
        # Within the grace after its end, a reconnect learns why it ended.
        late = await read_all(
            http, "GET", f"/v1/requests/{rid}/stream", headers={"last-event-id": "1"}
        )
    assert late.status_code == 200
    assert b"nobody reconnected within" in late.content
    assert late.content.endswith(b"data: [DONE]\n\n")


class AfterTheGrace:
    """The resume records' clock (`time` in api/pipeline/resume.py), `GRACE_S` + 0.2 s on."""

    @staticmethod
    def monotonic() -> float:
        return time.monotonic() + GRACE_S + 0.2


async def test_a_reconnect_after_the_grace_gets_404_with_a_clear_message(served, monkeypatch):
    async with client(served.url) as http:
        done = await read_all(http, "POST", "/v1/chat/completions", json=body(max_tokens=4))
        rid = done.headers["x-request-id"]
        monkeypatch.setattr(resume, "time", AfterTheGrace)  # the grace after its end elapses
        gone = await http.get(f"/v1/requests/{rid}/stream", headers={"last-event-id": "2"})
    assert gone.status_code == 404
    error = gone.json()["error"]
    assert error["code"] == "stream_not_found"
    assert "after it ended" in error["message"]


async def test_only_the_key_that_started_a_stream_resumes_it(served):
    async with client(served.url, key="sk-one") as mine, client(served.url, key="sk-two") as other:
        done = await read_all(mine, "POST", "/v1/chat/completions", json=body(max_tokens=4))
        rid = done.headers["x-request-id"]
        theirs = await other.get(f"/v1/requests/{rid}/stream")
        bad = await mine.get(f"/v1/requests/{rid}/stream", headers={"last-event-id": "x"})
        ours = await read_all(mine, "GET", f"/v1/requests/{rid}/stream")
    assert theirs.status_code == 404
    assert bad.status_code == 400
    assert ours.content == done.content


async def test_without_the_option_a_disconnect_cancels_at_once_and_nothing_is_kept(served):
    engine = served.engine
    async with client(served.url) as http:
        rid, head = await read_frames_then_drop(
            http, 2, json=body(max_tokens=engine.max_context - 64, stream_options=None)
        )
        state = await wait_finished(engine.step_loop, rid, GRACE_S / 2)  # well before any grace
        gone = await http.get(f"/v1/requests/{rid}/stream")
    assert head.startswith(b"id: 0\ndata: ")  # numbered all the same
    assert state.finish_reason == "cancelled"
    assert gone.status_code == 404


def anthropic_body(**kw) -> dict:
    return {
        "model": "stepline-demo",
        "messages": PROMPT,
        "max_tokens": 60,
        "temperature": 0.0,  # greedy: two runs write the same stream
        "stream": True,
        **kw,
    }


async def test_an_anthropic_stream_resumes_too_when_asked_by_header(served):
    resumable = {"x-stepline-resumable": "1", "x-api-key": "sk-one"}
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
        kw = dict(json=anthropic_body(), headers=resumable)
        whole = await read_all(http, "POST", "/v1/messages", **kw)
        rid, head = await read_frames_then_drop(http, 4, "/v1/messages", **kw)
        tail = await read_all(
            http, "GET", f"/v1/requests/{rid}/stream", headers={**resumable, "last-event-id": "3"}
        )
        plain = await read_all(http, "POST", "/v1/messages", json=anthropic_body(max_tokens=4))
    assert rid.startswith("msg_")
    assert head.startswith(b"id: 0\nevent: message_start\n")
    assert tail.status_code == 200 and tail.content.startswith(b"id: 4\n")
    assert tail.content.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')

    # The dropped connection's head and the resumed tail are the uninterrupted stream (but
    # for how much of the prompt the prefix cache served: the first run's prompt is cached).
    def counts_aside(raw: bytes) -> bytes:
        return re.sub(rb'"(input_tokens|cache_read_input_tokens)":\d+', rb'"\1":0', raw)

    same_but_ids(
        counts_aside(head + tail.content),
        rid,
        counts_aside(whole.content),
        whole.headers["x-request-id"],
    )
    assert (await wait_finished(served.engine.step_loop, rid, 5)).finish_reason == "length"
    assert not plain.content.startswith(b"id: ")  # unasked, Anthropic's own framing


async def test_an_anthropic_stream_nobody_resumes_ends_with_anthropics_error_event(served):
    engine = served.engine
    headers = {"x-stepline-resumable": "1", "x-api-key": "sk-one"}
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
        big = anthropic_body(max_tokens=engine.max_context - 64)
        rid, _ = await read_frames_then_drop(http, 2, "/v1/messages", json=big, headers=headers)
        state = await wait_finished(engine.step_loop, rid, GRACE_S * 4 + 10)
        late = await read_all(
            http, "GET", f"/v1/requests/{rid}/stream", headers={**headers, "last-event-id": "1"}
        )
    assert state.finish_reason == "cancelled"
    assert late.status_code == 200
    assert late.content.rstrip().splitlines()[-2:] == [
        b"event: error",
        b'data: {"type":"error","error":{"type":"api_error","message":"the request was '
        b'cancelled: nobody reconnected within 1.5 s"}}',
    ]
