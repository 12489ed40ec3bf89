"""The one stream writer: `StreamResponse` writes what a producer emits, in its wire's framing
(server-sent events, or JSON lines for Ollama's API), with keep-alive pings while nothing is
sent, and a client's disconnect cancels the producer (and writes the access log's line of its
end, `log_stopped`). Also the SSE frames' building blocks
(`sse`, `TextFrames`, `PING`).

Streams are written by hand, not with sse-starlette: the frames must be byte-exact
(`data: {json}\\n\\n`, `: ping\\n\\n` comments), pings must also go out for each prefill chunk
of a long prompt, and a disconnect must cancel the request even mid-prefill, when nothing is
being sent; a small response class does exactly that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic_core import to_json
from starlette.types import Receive, Scope, Send

from stepline.api.pipeline.errors import APIError, Wire, cut_by_shutdown

PING = b": ping\n\n"

Emit = Callable[[bytes], Awaitable[None]]
Producer = Callable[[Emit], Awaitable[None]]


def sse(
    payload: BaseModel, *, exclude: set[str] | None = None, exclude_unset: bool = False
) -> bytes:
    """One server-sent event carrying `payload` as compact JSON."""
    data = payload.model_dump_json(exclude=exclude, exclude_unset=exclude_unset)
    return b"data: " + data.encode() + b"\n\n"


class TextFrames:
    """Text-delta frames from a template: the hot path (one frame per token) without building
    and dumping pydantic models each time. `example` is a chunk whose only text is SENTINEL;
    a frame is byte-identical to `sse(example with that text)`, since the text is encoded
    by pydantic's own JSON encoder."""

    SENTINEL = "\x00stepline-text\x00"

    def __init__(
        self, example: BaseModel, *, exclude: set[str] | None = None, exclude_unset: bool = False
    ):
        frame = sse(example, exclude=exclude, exclude_unset=exclude_unset)
        self._head, self._tail = frame.split(to_json(self.SENTINEL))

    def __call__(self, text: str) -> bytes:
        return self._head + to_json(text) + self._tail


def log_stopped(scope: Scope, seconds: float) -> None:
    """The access log's second line of a stream its client stopped: uvicorn's first, written
    when the stream started, says 200 and nothing of how it ended. Written like uvicorn's
    (and only where uvicorn writes its access log), with the status the client saw."""
    access = logging.getLogger("uvicorn.access")
    if not access.hasHandlers():  # the access log is off
        return
    host, port = scope.get("client") or ("-", 0)
    query = scope.get("query_string", b"").decode("latin-1")
    path = scope.get("path", "") + (f"?{query}" if query else "")
    access.info(
        '%s - "%s %s HTTP/%s" %d cancelled: the client stopped the stream after %.1f s',
        f"{host}:{port}",
        scope.get("method", ""),
        path,
        scope.get("http_version", "1.1"),
        200,
        seconds,
    )


class StreamResponse(Response):
    """A streamed response whose body `produce(emit)` writes, framed as `wire` frames it.

    While `produce` runs, `wire.ping` goes out whenever nothing was sent for `heartbeat_s`
    (never, for a wire without pings), and a client disconnect cancels `produce`. `on_close`
    runs at the end whatever happened (it cancels the engine request if it is still running).
    Stopped by the server's shutdown before `produce` ended, the stream ends with `on_cancel`'s
    frames (by default the wire's error frames).
    """

    def __init__(
        self,
        produce: Producer,
        *,
        wire: Wire,
        headers: dict[str, str],
        heartbeat_s: float,
        on_close: Callable[[], Awaitable[None]],
        on_cancel: Callable[[APIError], bytes] | None = None,
    ):
        # No Response.__init__: it would set `content-length: 0`.
        self.status_code = 200
        self.background = None
        self._produce = produce
        self._ping = wire.ping
        self._heartbeat_s = heartbeat_s
        self._on_close = on_close
        self._on_cancel = on_cancel or wire.frames
        self.media_type = wire.media_type
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **headers})

    async def produce_into(self, emit: Emit) -> None:
        """Write this stream's frames into another stream's `emit` (one that started before
        this one existed: `Intake.handle`'s, while a model loaded)."""
        await self._produce(emit)

    async def close(self) -> None:
        """What ends this stream's request when it was written into another (`produce_into`)."""
        await self._on_close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lock = anyio.Lock()  # one writer at a time: the producer or the heartbeat
        started = last_sent = time.monotonic()
        produced = False  # the producer is done: its last frame is out
        disconnected = False
        ended = False  # the response's last message is sent

        async def emit(data: bytes) -> None:
            nonlocal last_sent
            async with lock:
                await send({"type": "http.response.body", "body": data, "more_body": True})
                last_sent = time.monotonic()

        async def heartbeat(ping: bytes) -> None:
            nonlocal last_sent
            while True:
                await anyio.sleep(max(0.0, last_sent + self._heartbeat_s - time.monotonic()))
                async with lock:
                    if produced:  # never a ping after the last frame
                        return
                    if time.monotonic() - last_sent >= self._heartbeat_s:
                        await send({"type": "http.response.body", "body": ping, "more_body": True})
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
                if self._ping is not None:
                    tg.start_soon(heartbeat, self._ping)
                await self._produce(emit)
                produced = True
                tg.cancel_scope.cancel()
            if not disconnected:
                ended = True  # set first: a cancel during this send must not send again
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we were writing
            disconnected = True
        except anyio.get_cancelled_exc_class():
            # Cancelled from outside (the server's graceful-shutdown timeout): the client
            # still gets its last frames, as after any other failure.
            if not (ended or disconnected):
                body = b""
                if not produced:
                    body = self._on_cancel(cut_by_shutdown())
                with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                    await send({"type": "http.response.body", "body": body, "more_body": False})
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()
            if disconnected and not ended:
                log_stopped(scope, time.monotonic() - started)
