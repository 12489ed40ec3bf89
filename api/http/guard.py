"""What keeps hostile or broken clients from taking the server down: a deadline for each
request head (uvicorn has none), chunk sizes past the body limit refused at once, TCP_NODELAY
on every connection, a limit on requests in flight that never refuses the probes, the
open-file limit raised to what the system allows, and accept errors logged at most once a
second.

uvicorn times out idle keep-alive connections (`timeout_keep_alive`), but a connection that
sends part of a request head and then nothing is never timed out (slowloris): each holds a
file descriptor until the process runs out, and then every client, /health included, is
refused. `guarded_protocol` closes such connections; it is uvicorn's own HTTP protocol
class with one timer added, passed as `Config(http=...)`. With h11 (uvicorn's parser unless
httptools is installed) it also refuses a chunked body's chunk that says it holds more than
the body limit: h11 takes chunk sizes of up to 20 hex digits and waits for that many bytes,
so the client waited for the body deadline (408) instead. uvicorn's own `limit_concurrency`
counts idle connections too (2,500 idle sockets made /health answer 503, and a load balancer
would pull the server): `RequestLimit` counts requests in flight instead, and never /health
or /metrics.
"""

from __future__ import annotations

import asyncio
import http
import resource
import socket
import time
from collections.abc import Callable
from typing import Any

import h11
import structlog
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from stepline.api.http.doors import error_response
from stepline.api.pipeline.errors import APIError, body_too_large
from stepline.engine.throttle import Throttle

log = structlog.get_logger(__name__)


class _HeadDeadline:
    """Mixin for uvicorn's HTTP protocols: a connection that has not sent a whole request head
    within `head_timeout_s` of connecting, or of its previous response, is closed."""

    head_timeout_s: float = 10.0
    # Provided by the uvicorn protocol class this is mixed into.
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        set_nodelay(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._arm_head_deadline()  # the next request's head is due as well

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_deadline_passed)

    def _waiting_for_head(self) -> bool:
        # No request yet, or the last one answered and no new head complete since.
        return self.cycle is None or self.cycle.response_complete

    def _head_deadline_passed(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()


# A chunk size this large is no size at all (it overflows a signed 64-bit count): 400, as
# nginx answers; a chunk within it but past the body limit is 413, as its Content-Length
# would be.
_MAX_CHUNK_SIZE = 2**63 - 1


class _ChunkLimit:
    """Mixin for uvicorn's h11 protocol: a chunk of a chunked body that says it holds more
    than `max_body_bytes` is refused at once, in the error shape of the request's door
    (`error_response`), and its connection closed; the app's request then sees the client
    gone."""

    max_body_bytes: int = 4 * 1024 * 1024
    # Provided by uvicorn's H11Protocol.
    conn: h11.Connection
    transport: asyncio.Transport
    cycle: Any

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        left = _chunk_bytes_left(self.conn)
        if left > self.max_body_bytes and not self.transport.is_closing():
            if left > _MAX_CHUNK_SIZE:
                err = APIError(
                    400,
                    f"a chunk of the body says it holds {left} bytes, more than any body "
                    "can: the chunked encoding is malformed",
                    code="invalid_chunk_size",
                )
            else:
                err = body_too_large(self.max_body_bytes)
            self._refuse(err)

    def _refuse(self, err: APIError) -> None:
        cycle = self.cycle
        log.info("request_refused", status=err.status_code, reason=err.message)
        if cycle is not None and not cycle.response_started:
            if self.conn.our_state is h11.SEND_RESPONSE:
                response = error_response(cycle.scope["path"], err)
                headers = [(k, v) for k, v in response.raw_headers if k != b"connection"]
                head = h11.Response(
                    status_code=response.status_code,
                    headers=[*headers, (b"connection", b"close")],
                    reason=http.HTTPStatus(response.status_code).phrase.encode(),
                )
                for event in (head, h11.Data(data=bytes(response.body)), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            # What the app sends from now on goes nowhere: the client has its answer.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def _chunk_bytes_left(conn: h11.Connection) -> int:
    """How many bytes h11 still waits for in the chunk it is reading (0 when none). h11 has
    no public accessor: it keeps the count in its body reader. Were that renamed, this reads
    0 and such a body waits for its deadline (408) as before."""
    return int(getattr(getattr(conn, "_reader", None), "_bytes_in_chunk", 0))


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    """Send small writes at once on `transport`'s TCP socket. Without TCP_NODELAY, every
    response after the first on a keep-alive connection waited ~40 ms (Nagle's algorithm
    holding the body until the client's delayed ACK of the head)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # the peer already gone
            pass


class RequestLimit:
    """ASGI middleware: at most `limit` HTTP requests in flight (a stream counts until it
    ends); past it, 503 with `Retry-After: 1`. Requests to `open_paths` (the probes) are
    always served and never counted, and idle connections are no requests."""

    def __init__(
        self, app: ASGIApp, *, limit: int, open_paths: frozenset[str] = frozenset()
    ) -> None:
        if limit < 1:
            raise ValueError(f"the request limit must be >= 1, got {limit}")
        self.app = app
        self.limit = limit
        self.open_paths = open_paths
        self.num_in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        if self.num_in_flight >= self.limit:
            busy = APIError(
                503,
                f"the server has {self.num_in_flight} requests in flight, its limit "
                "(--limit-concurrency): retry shortly",
                code="server_busy",
                headers={"retry-after": "1"},
            )
            await error_response(scope["path"], busy)(scope, receive, send)
            return
        self.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_in_flight -= 1


class RefuseAmbiguousLength:
    """ASGI middleware: a request that carries both `Transfer-Encoding` and
    `Content-Length` gets 400 and its connection is closed. Two servers in a chain that
    disagree on which header frames the body see different requests in the same bytes
    (request smuggling); RFC 9112 lets a server refuse such a message, and it must then
    close the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            names = {name for name, _ in scope["headers"]}
            if b"transfer-encoding" in names and b"content-length" in names:
                refused = APIError(
                    400,
                    "the request has both Transfer-Encoding and Content-Length: send one",
                    code="ambiguous_length",
                    headers={"connection": "close"},
                )
                await error_response(scope["path"], refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def guarded_protocol(head_timeout_s: float, max_body_bytes: int) -> type:
    """uvicorn's HTTP protocol class (httptools when installed, else h11) with a deadline of
    `head_timeout_s` for every request head, and with h11, chunks of more than
    `max_body_bytes` refused as they are announced (httptools tells no chunk's size)."""
    bases: tuple[type, ...] = (_HeadDeadline, _ChunkLimit, H11Protocol)
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        bases = (_HeadDeadline, HttpToolsProtocol)
    except ImportError:  # httptools is optional (uvicorn[standard])
        pass
    return type(
        f"Guarded{bases[-1].__name__}",
        bases,
        {"head_timeout_s": head_timeout_s, "max_body_bytes": max_body_bytes},
    )


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (each connection is a file);
    returns (soft, hard) as they are afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:  # macOS refuses above OPEN_MAX
        log.warning("open_file_limit_not_raised", soft=soft, hard=hard, error=str(exc))
        return soft, hard
    return target, hard


class RateLimitedExceptionHandler:
    """An event-loop exception handler that logs each kind of error (message and exception
    type) at most once per `interval_s`, with the count of those it left out. Accept errors
    (EMFILE: too many open files) repeat for every connection attempt; logged each time, they
    fill a disk in minutes."""

    def __init__(self, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self._throttle = Throttle(interval_s, clock)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        key = (str(context.get("message", "")), type(exc).__name__ if exc else "")
        left_out = self._throttle.admit(key)
        if left_out is None:
            return
        log.error(
            "event_loop_error",
            message=key[0],
            error=repr(exc) if exc else None,
            left_out_since_last=left_out,
            exc_info=exc,  # the traceback, as asyncio's own handler would log it
        )
