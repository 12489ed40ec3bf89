"""Server-sent events: the frames (`sse`, `TextFrames`, `PING`, `DONE`, `error_frame`) and
`EventStreamResponse`, the response that writes them.

Streams are written by hand, not with sse-starlette: the frames must be byte-exact
(`data: {json}\\n\\n`, `: ping\\n\\n` comments, `data: [DONE]\\n\\n`), pings must also go out for
each prefill chunk of a long prompt, and a disconnect must cancel the request even
mid-prefill, when nothing is being sent; a small response class does exactly that.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic_core import to_json
from starlette.types import Receive, Scope, Send

from stepline.api.openai.schema import ErrorDetail, ErrorResponse
from stepline.api.pipeline.errors import APIError, Wire

PING = b": ping\n\n"
DONE = b"data: [DONE]\n\n"

Emit = Callable[[bytes], Awaitable[None]]


def sse(payload: BaseModel, *, exclude: set[str] | None = None) -> bytes:
    """One server-sent event carrying `payload` as compact JSON."""
    return b"data: " + payload.model_dump_json(exclude=exclude).encode() + b"\n\n"


class TextFrames:
    """Text-delta frames from a template: the hot path (one frame per token) without building
    and dumping pydantic models each time. `example` is a chunk whose only text is SENTINEL;
    a frame is byte-identical to `sse(example with that text)`, since the text is encoded
    by pydantic's own JSON encoder."""

    SENTINEL = "\x00stepline-text\x00"

    def __init__(self, example: BaseModel, *, exclude: set[str] | None = None):
        self._head, self._tail = sse(example, exclude=exclude).split(to_json(self.SENTINEL))

    def __call__(self, text: str) -> bytes:
        return self._head + to_json(text) + self._tail


def error_frame(message: str, *, code: str | None = None) -> bytes:
    """An OpenAI-style error body as one event (a stream's last frame before [DONE])."""
    detail = ErrorDetail(message=message, type="server_error", param=None, code=code)
    return sse(ErrorResponse(error=detail))


class OpenAIWire:
    """How the OpenAI endpoints write errors: `{"error": {...}}` bodies, and in a stream an
    error event then `[DONE]`."""

    numbered = True

    def error_response(self, err: APIError) -> Response:
        return err.response()

    def error_frames(self, err: APIError) -> bytes:
        return error_frame(err.detail.message, code=err.detail.code) + DONE


OPENAI = OpenAIWire()


class EventStreamResponse(Response):
    """A `text/event-stream` response whose body `produce(emit)` writes.

    While `produce` runs, a `: ping` comment goes out whenever nothing was sent for
    `heartbeat_s`, and a client disconnect cancels `produce`. `on_close` runs at the end
    whatever happened (it cancels the engine request if it is still running). Stopped by the
    server's shutdown, the stream ends with `wire`'s error frames.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        produce: Callable[[Emit], Awaitable[None]],
        *,
        headers: dict[str, str],
        heartbeat_s: float,
        on_close: Callable[[], Awaitable[None]],
        wire: Wire = OPENAI,
    ):
        # No Response.__init__: it would set `content-length: 0`.
        self._wire = wire
        self.status_code = 200
        self.background = None
        self._produce = produce
        self._heartbeat_s = heartbeat_s
        self._on_close = on_close
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lock = anyio.Lock()  # one writer at a time: the producer or the heartbeat
        last_sent = time.monotonic()
        produced = False  # the producer is done: its last frame ([DONE]) is out
        disconnected = False
        ended = False  # the response's last message is sent

        async def emit(data: bytes) -> None:
            nonlocal last_sent
            async with lock:
                await send({"type": "http.response.body", "body": data, "more_body": True})
                last_sent = time.monotonic()

        async def heartbeat() -> None:
            nonlocal last_sent
            while True:
                await anyio.sleep(max(0.0, last_sent + self._heartbeat_s - time.monotonic()))
                async with lock:
                    if produced:  # never a ping after [DONE]
                        return
                    if time.monotonic() - last_sent >= self._heartbeat_s:
                        await send({"type": "http.response.body", "body": PING, "more_body": True})
                        last_sent = time.monotonic()

        async def watch_disconnect(scope: anyio.CancelScope) -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            scope.cancel()

        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_disconnect, tg.cancel_scope)
                tg.start_soon(heartbeat)
                await self._produce(emit)
                produced = True
                tg.cancel_scope.cancel()
            if not disconnected:
                ended = True  # set first: a cancel during this send must not send again
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we were writing
            pass
        except anyio.get_cancelled_exc_class():
            # Cancelled from outside (the server's graceful-shutdown timeout): the client
            # still gets an error frame and [DONE], as after any other failure.
            if not (ended or disconnected):
                body = b""
                if not produced:
                    message = "the server shut down before the request finished"
                    body = self._wire.error_frames(APIError(503, message, code="shutting_down"))
                with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                    await send({"type": "http.response.body", "body": body, "more_body": False})
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()
