"""What keeps hostile or broken clients from taking the server down: a deadline for each
request head (uvicorn has none), TCP_NODELAY on every connection, a limit on requests in
flight that never refuses the probes, the open-file limit raised to what the system allows,
and accept errors logged at most once a second.

uvicorn times out idle keep-alive connections (`timeout_keep_alive`), but a connection that
sends part of a request head and then nothing is never timed out (slowloris): each holds a
file descriptor until the process runs out, and then every client, /health included, is
refused. `head_deadline_protocol` closes such connections; it is uvicorn's own HTTP protocol
class with one timer added, passed as `Config(http=...)`. uvicorn's own `limit_concurrency`
counts idle connections too (2,500 idle sockets made /health answer 503, and a load balancer
would pull the server): `RequestLimit` counts requests in flight instead, and never /health
or /metrics.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import time
from collections.abc import Callable
from typing import Any

import structlog
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from stepline.api.http.doors import error_response
from stepline.api.pipeline.errors import APIError

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


def head_deadline_protocol(head_timeout_s: float) -> type:
    """uvicorn's HTTP protocol class (httptools when installed, else h11) with a deadline of
    `head_timeout_s` for every request head."""
    base: type = H11Protocol
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    except ImportError:  # httptools is optional (uvicorn[standard])
        pass
    return type(
        f"HeadDeadline{base.__name__}",
        (_HeadDeadline, base),
        {"head_timeout_s": head_timeout_s},
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
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        key = (str(context.get("message", "")), type(exc).__name__ if exc else "")
        now = self._clock()
        if now - self._last.get(key, -float("inf")) < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        left_out = self._suppressed.pop(key, 0)
        log.error(
            "event_loop_error",
            message=key[0],
            error=repr(exc) if exc else None,
            left_out_since_last=left_out,
            exc_info=exc,  # the traceback, as asyncio's own handler would log it
        )
