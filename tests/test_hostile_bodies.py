"""Small bodies that froze the whole server, sent to a real server on 127.0.0.1 (uvicorn over
an engine on the demo model), each beside a bystander: deep JSON, lone surrogates, tens of
thousands of tools or stop strings, keep-alive connections without TCP_NODELAY, idle sockets
past the concurrency limit. Every one is a 400 naming the limit, answered while /health
stays fast and the engine healthy."""

from __future__ import annotations

import json
import os
import socket
import time

import anyio
import httpx
import pytest
from anyio.abc import SocketAttribute
from helpers import until_async

from stepline.api.json_limits import MAX_JSON_DEPTH, MAX_STOP_STRINGS, MAX_TOOLS

pytestmark = pytest.mark.asyncio(loop_scope="module")

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served_options() -> dict:
    # Beside the default app, the same engine behind --limit-concurrency 4 ("limited").
    return dict(apps={"limited": {}}, serve={"limited": dict(limit_concurrency=4)})


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def deep_bodies(depth: int) -> list[tuple[str, bytes]]:
    """(path, body) with a list `depth` deep where each API takes free-form JSON."""
    deep = nested(depth)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    return [
        (
            "/v1/chat/completions",
            b'{"messages":[{"role":"user","content":"x"}],"max_tokens":2,'
            b'"chat_template_kwargs":{"enable_thinking":' + deep.encode() + b"}}",
        ),
        (  # JSON inside a string: the arguments of an earlier tool call
            "/v1/chat/completions",
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "x"},
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                    ],
                    "max_tokens": 2,
                }
            ).encode(),
        ),
        (
            "/v1/messages",
            b'{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"x"}],'
            b'"metadata":{"user_id":' + deep.encode() + b"}}",
        ),
        (
            "/v1/responses",
            b'{"input":"x","max_output_tokens":2,"tools":[{"type":"function","name":"f",'
            b'"parameters":' + b'{"a":' * depth + b"1" + b"}" * depth + b"}]}",
        ),
    ]


# A probe held behind idle or stalled connections waits for one of them to time out: the
# served app's shortest timeout is its keep-alive's 5 s. An answer sooner than that was not
# held, however busy the machine running the test is.
HELD_BEHIND_S = 5.0


async def health_answers(http: httpx.AsyncClient) -> None:
    t0 = time.monotonic()
    r = await http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert time.monotonic() - t0 < HELD_BEHIND_S


# -- 1. nesting depth -------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 900, 100_000])
async def test_json_nested_past_the_limit_is_a_400_naming_it_on_every_api(served, depth):
    async with served.http() as http:
        for path, body in deep_bodies(depth):
            r = await http.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, r.text[:300])
            assert f"more than {MAX_JSON_DEPTH} levels" in r.text, (path, r.text[:300])
        await health_answers(http)
    assert served.engine.healthy


async def test_json_nested_to_the_limit_is_served(served):
    # Within the limit, the same fields work: a tool schema 20 objects deep.
    schema: dict = {"type": "object", "properties": {}}
    for _ in range(20):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {
        "messages": HI,
        "max_tokens": 2,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
    }
    async with served.http() as http:
        r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


# -- 2. lone surrogates -----------------------------------------------------------------------

LONE = "\\ud800"  # as JSON text: json.dumps would escape it the same way


def surrogate_bodies() -> list[tuple[str, str, str]]:
    """(path, body, field named in the error) with a lone surrogate in a text field."""
    return [
        (
            "/v1/chat/completions",
            '{"messages":[{"role":"user","content":"a' + LONE + '"}],"max_tokens":2}',
            "messages.0.content",
        ),
        ("/v1/completions", '{"prompt":"a' + LONE + '","max_tokens":2}', "prompt"),
        (
            "/v1/chat/completions",
            '{"messages":[{"role":"user","content":"a"}],"stop":["' + LONE + '"]}',
            "stop.0",
        ),
        (
            "/v1/messages",
            '{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"' + LONE + '"}]}',
            "messages.0.content",
        ),
        (
            "/v1/messages/count_tokens",
            '{"model":"m","system":"' + LONE + '","messages":[{"role":"user","content":"a"}]}',
            "system",
        ),
        ("/v1/responses", '{"input":"' + LONE + '","max_output_tokens":2}', "input"),
        (
            "/v1/responses",
            '{"input":"a","max_output_tokens":2,"background":true,"metadata":{"k":"' + LONE + '"}}',
            "metadata.k",
        ),
        (  # in a key, and as raw UTF-8 bytes of a surrogate (json reads them too)
            "/v1/chat/completions",
            '{"messages":[{"role":"user","content":"a"}],"chat_template_kwargs":{"'
            + LONE
            + '":1}}',
            "chat_template_kwargs",
        ),
    ]


async def test_a_lone_surrogate_in_any_text_field_is_a_400_naming_it(served):
    async with served.http() as http:
        for path, body, field in surrogate_bodies():
            r = await http.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, body, r.text)
            assert "surrogate" in r.text and field in r.text, (path, r.text)
        raw = b'{"prompt":"a\xed\xa0\x80","max_tokens":2}'  # U+D800 encoded as UTF-8
        r = await http.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "surrogate" in r.text
        assert (await http.get("/v1/responses/none")).status_code == 404
        await health_answers(http)
    assert served.engine.healthy


async def test_twenty_surrogate_bodies_at_once_leave_health_fast(served):
    body = surrogate_bodies()[0][1].encode()
    headers = {"content-type": "application/json"}
    statuses: list[int] = []
    async with served.http(limits=httpx.Limits(max_connections=30)) as http:

        async def post() -> None:
            r = await http.post("/v1/chat/completions", content=body, headers=headers)
            statuses.append(r.status_code)

        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(post)
            await health_answers(http)
    assert statuses == [400] * 20


# -- 3. caps, linear checks -------------------------------------------------------------------


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


async def test_more_tools_stop_strings_or_messages_than_the_caps_are_a_400_at_once(served):
    cases = [
        ("/v1/chat/completions", {"messages": HI, "tools": [tool("f")] * 60_000}, "tools"),
        (
            "/v1/chat/completions",
            {"messages": HI, "tools": [tool(f"f{i}") for i in range(MAX_TOOLS + 1)]},
            "tools",
        ),
        (
            "/v1/messages/count_tokens",
            {
                "model": "m",
                "messages": HI,
                "tools": [{"name": "f", "input_schema": {}}] * 60_000,
            },
            "tools",
        ),
        (
            "/v1/messages",
            {"model": "m", "max_tokens": 2, "messages": HI, "stop_sequences": ["x"] * 60_000},
            "stop_sequences",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": "s"}] * 20_000 + HI},
            "messages",
        ),
        ("/v1/completions", {"prompt": "hi", "stop": "a" * 100_000}, "stop"),
        (
            "/v1/messages",
            {"model": "m", "max_tokens": 2, "messages": HI, "stop_sequences": ["a" * 1001]},
            "stop_sequences.0",
        ),
    ]
    async with served.http() as http:
        for path, body, field in cases:
            r = await http.post(path, json=body)
            assert r.status_code == 400, (path, r.text[:300])
            assert "at most" in r.text and field in r.text, r.text[:300]
        await health_answers(http)


async def test_stop_sequences_up_to_the_cap_are_served(served):
    body = {
        "model": "stepline-demo",
        "max_tokens": 4,
        "messages": HI,
        "stop_sequences": [f"never{i}" for i in range(MAX_STOP_STRINGS)],
    }
    async with served.http() as http:
        r = await http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text


async def test_duplicate_tool_names_are_named_among_many_tools(served):
    tools = [tool(f"f{i}") for i in range(MAX_TOOLS - 1)] + [tool("f7")]
    async with served.http() as http:
        r = await http.post("/v1/chat/completions", json={"messages": HI, "tools": tools})
    assert r.status_code == 400 and "duplicate tool names ['f7']" in r.text


async def test_many_consecutive_system_messages_are_merged_into_one(served):
    # Merged by joining once (appending in a loop was quadratic: 130k of them froze /health).
    messages = [{"role": "system", "content": f"rule {i}"} for i in range(5000)] + HI
    async with served.http() as http:
        r = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    from stepline.api.openai.schema import ChatCompletionRequest

    merged = ChatCompletionRequest.model_validate({"messages": messages}).engine_messages()
    assert [m["role"] for m in merged] == ["system", "user"]
    assert merged[0]["content"].startswith("rule 0\n\nrule 1\n\n")
    assert merged[0]["content"].endswith("rule 4999")


# -- 4. TCP_NODELAY ---------------------------------------------------------------------------


def _server_side(client: socket.socket) -> socket.socket:
    """The server's end of `client`'s connection (the server runs in this process)."""
    want = client.getsockname()
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.getpeername() == want:
                return s
        except OSError:
            pass
        s.close()
    raise AssertionError("no server socket for the connection")


async def test_accepted_connections_send_without_delay(served):
    host, port = served.url.removeprefix("http://").split(":")
    async with await anyio.connect_tcp(host, int(port)) as client:
        await client.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await client.receive()).startswith(b"HTTP/1.1 200")  # accepted by now
        with _server_side(client.extra(SocketAttribute.raw_socket)) as server_end:
            assert server_end.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


# -- 5. idle sockets, the concurrency limit ---------------------------------------------------


async def test_idle_sockets_past_the_limit_leave_health_metrics_and_requests_answering(served):
    host, port = served.urls["limited"].removeprefix("http://").split(":")
    idle = [await anyio.connect_tcp(host, int(port)) for _ in range(200)]  # limit: 4
    try:
        async with served.http(served.urls["limited"]) as http:
            # The probe's connection queues behind the idle ones: once it is answered, the
            # server has accepted them all (the kernel hands connections over in order).
            await health_answers(http)
            assert (await http.get("/metrics")).status_code == 200
            assert (await http.get("/v1/models")).status_code == 200
    finally:
        for conn in idle:
            await conn.aclose()


async def test_past_the_limit_of_requests_in_flight_requests_get_503_but_probes_do_not(served):
    host, port = served.urls["limited"].removeprefix("http://").split(":")
    # Four requests in flight: heads sent, bodies still to come.
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    pending = [await anyio.connect_tcp(host, int(port)) for _ in range(4)]
    try:
        for conn in pending:
            await conn.send(head)
        async with served.http(served.urls["limited"]) as http:
            # The requests in flight are the middleware's, with no event to await: watched
            # over HTTP, as a client sees them, until their count says so.
            async def answered(status: int) -> httpx.Response | None:
                r = await http.get("/v1/models")
                return r if r.status_code == status else None

            busy = await until_async(lambda: answered(503), within=10, every=0.01, what="a 503")
            assert busy.json()["error"]["code"] == "server_busy"
            assert busy.headers["retry-after"] == "1"
            await health_answers(http)
            assert (await http.get("/metrics")).status_code == 200
            for conn in pending:
                await conn.aclose()
            await until_async(lambda: answered(200), within=10, every=0.01, what="a 200 again")
    finally:
        for conn in pending:
            await conn.aclose()


# -- 9, 12: Responses replay and metadata -----------------------------------------------------


async def test_responses_replay_from_before_the_start_is_a_400(served):
    async with served.http() as http:
        created = await http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3})
        rid = created.json()["id"]
        for bad in ("-2", "-100000000", "x", "9" * 5000):
            r = await http.get(
                f"/v1/responses/{rid}", params={"stream": "true", "starting_after": bad}
            )
            assert r.status_code == 400 and "starting_after" in r.text, (bad, r.text)
        whole = await http.get(f"/v1/responses/{rid}", params={"stream": "true"})
        again = await http.get(
            f"/v1/responses/{rid}", params={"stream": "true", "starting_after": "-1"}
        )
    assert whole.status_code == 200 and whole.text == again.text
    numbers = [
        json.loads(line[6:])["sequence_number"]
        for line in whole.text.splitlines()
        if line.startswith("data: ")
    ]
    assert numbers == list(range(len(numbers)))  # each event once, in order


@pytest.mark.parametrize(
    "metadata",
    [
        {f"k{i}": "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
        {"k": "v" * 3_900_000},
    ],
)
async def test_responses_metadata_past_openais_limits_is_a_400(served, metadata):
    async with served.http() as http:
        r = await http.post(
            "/v1/responses",
            json={"input": "hi", "max_output_tokens": 2, "background": True, "metadata": metadata},
        )
    assert r.status_code in (400, 413), r.text[:300]
    if r.status_code == 400:
        assert "metadata" in r.text


# -- 15. request smuggling --------------------------------------------------------------------


async def test_a_request_with_both_transfer_encoding_and_content_length_is_refused_and_closed(
    served,
):
    host, port = served.url.removeprefix("http://").split(":")
    body = b'{"prompt":"hi","max_tokens":1}'
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\n\r\n"
    )

    def send_and_read() -> bytes:
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(request)
            received = b""
            while chunk := conn.recv(65536):  # until the server closes the connection
                received += chunk
            return received

    received = await anyio.to_thread.run_sync(send_and_read)
    assert received.startswith(b"HTTP/1.1 400")
    assert received.count(b"HTTP/1.1") == 1


def _send_chunked_head(url: str, path: str, chunk_size: str) -> tuple[bytes, float]:
    """A chunked request whose first chunk says it holds `chunk_size` (hex) bytes, sent with
    a few of them; what the server answers until it closes, and how long that took."""
    host, port = url.removeprefix("http://").split(":")
    request = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Transfer-Encoding: chunked\r\n\r\n{chunk_size}\r\n{{"
    ).encode()
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(request)
        received = b""
        while chunk := conn.recv(65536):  # until the server closes the connection
            received += chunk
    return received, time.monotonic() - t0


@pytest.mark.parametrize(
    ("path", "chunk_size", "status", "code"),
    [
        # 20 hex digits, the most h11 takes: no body is that large
        ("/v1/chat/completions", "f" * 20, 400, "invalid_chunk_size"),
        # twice the 4 MiB body limit: what its Content-Length would get
        ("/v1/messages", f"{8 * 1024 * 1024:x}", 413, "request_too_large"),
    ],
)
async def test_a_chunk_past_the_body_limit_is_refused_at_once_in_the_doors_shape(
    served, path, chunk_size, status, code
):
    received, took = await anyio.to_thread.run_sync(
        _send_chunked_head, served.url, path, chunk_size
    )
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), received
    assert b"connection: close" in head.lower()
    assert took < 10  # not the body's 60 s deadline
    error = json.loads(body)
    if path.startswith("/v1/messages"):  # Anthropic's shape
        assert error["type"] == "error" and error["error"]["type"] == "request_too_large"
    else:
        assert error["error"]["code"] == code
    async with served.http() as http:  # the server serves on
        assert (await http.get("/health")).status_code == 200
