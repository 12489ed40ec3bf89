"""Streams that survive a dropped connection.

Every frame of an OpenAI stream is numbered (`id: N`, from 0). A resumable request keeps its
frames in a `StreamRecord`: the producer (which reads the engine) writes into the record, and
each HTTP connection only follows it. So a client whose connection drops reconnects at
`GET /v1/requests/{id}/stream` with `Last-Event-ID: N` and gets frames N+1.. from the record,
then the live ones: byte for byte the tail of the original stream.

The producer runs in the task of the request that started it (uvicorn does not cancel a
request's task when its client goes away), so no task outlives the server's shutdown. A
record nobody follows for `grace_s` while its request runs cancels the request; a record
is dropped `grace_s` after its request ended (lazily, on the next lookup).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import structlog
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from stepline.api.pipeline.errors import APIError, Wire
from stepline.api.pipeline.sse import OPENAI, PING, Emit, EventStreamResponse

log = structlog.get_logger(__name__)

DEFAULT_GRACE_S = 60.0
DEFAULT_MAX_RECORDS = 4096  # ended records kept past this are dropped, oldest first
RESUMABLE_HEADER = "x-stepline-resumable"


def key_of(headers: Headers) -> str:
    """A fingerprint of the API key a request carries (`Authorization: Bearer` or
    `x-api-key`; empty when none): what a stored stream's owner is compared by."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key", "")
    return hashlib.sha256(given.encode()).hexdigest()


def wants_resumable(headers: Headers) -> bool:
    return headers.get(RESUMABLE_HEADER, "").strip().lower() in ("1", "true", "yes")


def numbered(frame: bytes, n: int) -> bytes:
    """`frame` (one complete SSE event) with `id: n` in front."""
    return b"id: %d\n" % n + frame


class FrameCounter:
    """Numbers the frames of one stream as they go out: `emit` may carry several frames at
    once (`data: …\\n\\n` each, JSON never holds a raw blank line); comments (pings) are
    not events and get no number."""

    def __init__(self) -> None:
        self.next_id = 0

    def split(self, data: bytes) -> list[bytes]:
        """The numbered events in `data`; pings stay as they are."""
        out = []
        for part in data.split(b"\n\n")[:-1]:
            if part.startswith(b":"):
                out.append(part + b"\n\n")
            else:
                out.append(numbered(part + b"\n\n", self.next_id))
                self.next_id += 1
        return out

    def wrap(self, emit: Emit) -> Emit:
        async def numbered_emit(data: bytes) -> None:
            await emit(b"".join(self.split(data)))

        return numbered_emit


class StreamRecord:
    """The numbered frames of one resumable stream, in memory, and who follows them.

    One writer (the producer, through `append`/`finish`); any number of followers."""

    def __init__(self, rid: str, owner: str, grace_s: float | None, wire: Wire = OPENAI):
        self.rid = rid
        self.owner = owner
        self.wire = wire  # the API whose frames these are (how a shutdown ends a follower)
        self.grace_s = grace_s  # None: never cancelled for want of a follower (background)
        self.frames: list[bytes] = []  # frames[i] carries `id: i`
        self.done = False
        self.ended_at: float | None = None
        self.num_followers = 0
        self.abandoned = False  # cancelled because nobody followed it within the grace
        self._counter = FrameCounter()
        self._changed = anyio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def changed(self) -> None:
        await self._changed.wait()

    async def append(self, data: bytes) -> None:
        """The producer's `emit`: the frames in `data`, numbered, kept and sent to followers;
        pings are dropped (each follower sends its own)."""
        frames = [f for f in self._counter.split(data) if f != PING]
        if frames and not self.done:
            self.frames.extend(frames)
            self._notify()

    def append_event(self, frame: bytes) -> int:
        """One frame (a complete SSE event), numbered; returns its number."""
        n = len(self.frames)
        self.frames.append(numbered(frame, n))
        self._counter.next_id = n + 1
        self._notify()
        return n

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self.ended_at = time.monotonic()
            self._notify()

    async def follow(self, emit: Emit, after: int = -1) -> None:
        """Send every frame after number `after`, then the live ones until the record ends;
        counted as a follower meanwhile."""
        self.num_followers += 1
        self._notify()
        try:
            i = after + 1
            while True:
                if i < len(self.frames):
                    batch = self.frames[i:]
                    i += len(batch)
                    await emit(b"".join(batch))
                elif self.done:
                    return
                else:
                    await self.changed()
        finally:
            self.num_followers -= 1
            self._notify()

    async def wait_done_or_abandoned(self) -> bool:
        """Wait until the stream ends (False) or nobody followed it for `grace_s` (True)."""
        while not self.done:
            if self.num_followers > 0 or self.grace_s is None:
                await self.changed()
                continue
            with anyio.move_on_after(self.grace_s) as scope:
                while self.num_followers == 0 and not self.done:
                    await self.changed()
            if scope.cancelled_caught and self.num_followers == 0 and not self.done:
                return True
        return False


class ResumeRegistry:
    """Every resumable stream's record, by request id, private to the key that started it."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S, max_records: int = DEFAULT_MAX_RECORDS):
        self.grace_s = grace_s
        self.max_records = max_records
        self._records: dict[str, StreamRecord] = {}

    def __len__(self) -> int:
        self._sweep()
        return len(self._records)

    def open(self, rid: str, owner: str, *, wire: Wire = OPENAI) -> StreamRecord:
        self._sweep()
        record = StreamRecord(rid, owner, self.grace_s, wire)
        self._records[rid] = record
        return record

    def adopt(self, record: StreamRecord) -> None:
        """Make `record` (made by its door, e.g. a Responses stream) resumable here too."""
        self._sweep()
        self._records[record.rid] = record

    def get(self, rid: str, owner: str) -> StreamRecord:
        """The record of `rid`, for the key `owner`. Raises APIError 404 when there is none
        (never started resumable, ended more than the grace ago, or another key's)."""
        self._sweep()
        record = self._records.get(rid)
        if record is None or record.owner != owner:
            raise APIError(
                404,
                f"no stream {rid!r} to resume: only a stream started with "
                '`stream_options: {"resumable": true}` (or the x-stepline-resumable header) '
                f"can be resumed, by the API key that started it, until {self.grace_s:g} s "
                "after it ended",
                code="stream_not_found",
            )
        return record

    def _sweep(self) -> None:
        now = time.monotonic()
        expired = [
            rid
            for rid, r in self._records.items()
            if r.ended_at is not None and now - r.ended_at > self.grace_s
        ]
        for rid in expired:
            del self._records[rid]
        excess = len(self._records) - self.max_records
        if excess > 0:
            ended = sorted(
                (r for r in self._records.values() if r.ended_at is not None),
                key=lambda r: r.ended_at or 0.0,
            )
            for r in ended[:excess]:
                del self._records[r.rid]


Producer = Callable[[Emit], Awaitable[None]]


async def run_producer(
    record: StreamRecord, produce: Producer, on_close: Callable[[], Awaitable[None]]
) -> None:
    """Run `produce` into `record` until it ends; then (whatever happened) `on_close` (it
    cancels the engine request if still running) and finish the record. A producer
    cancelled meanwhile ends the record with its API's error frames."""
    try:
        await produce(record.append)
    except anyio.get_cancelled_exc_class():
        if record.abandoned:
            message = f"the request was cancelled: nobody reconnected within {record.grace_s:g} s"
        else:
            message = "the server shut down before the request finished"
        await record.append(record.wire.error_frames(APIError(500, message, code="cancelled")))
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await on_close()
        record.finish()


class ResumableStreamResponse(Response):
    """The response of a resumable stream: `run` writes the record (and finishes it) in this
    request's task; this response follows the record while its client stays, and after a
    disconnect lets `run` go on until it ends or nobody has reconnected for the grace (then
    `run` is cancelled: it cancels the engine request)."""

    def __init__(
        self,
        record: StreamRecord,
        run: Callable[[], Coroutine[Any, Any, None]],
        *,
        headers: dict[str, str],
        heartbeat_s: float,
    ):
        # No Response.__init__ (it would set `content-length: 0`); the follower sends the head.
        self.status_code = 200
        self.background = None
        self.init_headers(headers)
        self.record = record
        self.run = run
        self.stream_headers = headers
        self.heartbeat_s = heartbeat_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        record = self.record
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.run)
            await follower_response(record, -1, self.stream_headers, self.heartbeat_s)(
                scope, receive, send
            )
            if await record.wait_done_or_abandoned():
                log.info("request_abandoned", request_id=record.rid, grace_s=record.grace_s)
                record.abandoned = True
                tg.cancel_scope.cancel()


def follower_response(
    record: StreamRecord, after: int, headers: dict[str, str], heartbeat_s: float
) -> EventStreamResponse:
    """A response that follows `record` from after frame `after`."""

    async def nothing() -> None:
        pass

    return EventStreamResponse(
        lambda emit: record.follow(emit, after),
        headers=headers,
        heartbeat_s=heartbeat_s,
        on_close=nothing,
        wire=record.wire,
    )


def last_event_id(headers: Headers) -> int:
    """The `Last-Event-ID` header as a frame number; -1 when absent (from the start).
    Raises APIError 400 if it is not a number >= -1."""
    value = headers.get("last-event-id")
    if value is None or value.strip() == "":
        return -1
    try:
        n = int(value.strip())
    except ValueError:
        raise APIError(
            400, f"Last-Event-ID must be a frame number, got {value!r}", code="invalid_value"
        ) from None
    if n < -1:
        raise APIError(400, f"Last-Event-ID must be >= -1, got {n}", code="invalid_value")
    return n


def resume_response(
    registry: ResumeRegistry, rid: str, headers: Headers, heartbeat_s: float
) -> EventStreamResponse:
    """`GET /v1/requests/{rid}/stream`: the frames after `Last-Event-ID` (all of them without
    one), then the live stream. Raises APIError 404 (see `ResumeRegistry.get`), 400."""
    after = last_event_id(headers)
    record = registry.get(rid, key_of(headers))
    return follower_response(record, after, {"x-request-id": rid}, heartbeat_s)
