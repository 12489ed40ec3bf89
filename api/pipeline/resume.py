"""Streams that survive a dropped connection, and streams kept after they end.

Every frame of a numbered stream carries `id: N`, from 0. A kept stream writes its frames into
a `StreamRecord`: the producer (which reads the engine) writes into the record, and each HTTP
connection only follows it. So a client whose connection drops reconnects at
`GET /v1/requests/{id}/stream` with `Last-Event-ID: N` and gets frames N+1.. from the record,
then the live ones: byte for byte the tail of the original stream. A door that keeps its
answers (Responses) keeps their records the same way.

The producer runs in the task of the request that started it (uvicorn does not cancel a
request's task when its client goes away), or in its background task, so no task outlives
the server's shutdown. A record nobody follows for its `grace_s` while its request runs
cancels the request; `StreamRecord.cancel` cancels it on request.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, Generic, TypeVar

import anyio
import structlog
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from stepline.api.pipeline.errors import APIError, Wire, cut_by_shutdown
from stepline.api.pipeline.writer import Emit, Producer, StreamResponse

log = structlog.get_logger(__name__)

DEFAULT_MAX_RECORDS = 4096  # ended records kept past this are dropped, oldest first
RESUMABLE_HEADER = "x-stepline-resumable"


def presented_key(headers: Headers) -> str:
    """The API key a request carries, as `Authorization: Bearer <key>` (OpenAI) or
    `x-api-key: <key>` (Anthropic); empty when none."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key", "")


def key_of(headers: Headers) -> str:
    """A fingerprint of the API key a request carries: what a kept stream's owner is
    compared by."""
    return hashlib.sha256(presented_key(headers).encode()).hexdigest()


def wants_resumable(headers: Headers) -> bool:
    return headers.get(RESUMABLE_HEADER, "").strip().lower() in ("1", "true", "yes")


def frame_cursor(value: str | None, param: str) -> int:
    """A client's position in a stream (`Last-Event-ID`, `starting_after`): the number of the
    last frame it has, -1 (or absent) for none. Raises APIError 400 naming `param`."""
    if value is None or value.strip() == "":
        return -1
    try:
        n = int(value.strip())
    except ValueError:
        n = -2
    if n < -1:  # replayed frames out of order, duplicated, GBs of them
        raise APIError(
            400,
            f"{param} must be a frame's number (>= 0; -1 = from the start), got {value!r}",
            param=param,
            code="invalid_value",
        )
    return n


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
    """The numbered frames of one kept stream, in memory, and who follows them.

    One writer (the producer, through `append`/`finish`); any number of followers."""

    def __init__(self, rid: str, owner: str, grace_s: float | None, wire: Wire):
        self.rid = rid
        self.owner = owner
        self.wire = wire  # the API whose frames these are (how a shutdown ends a follower)
        self.grace_s = grace_s  # None: never cancelled for want of a follower (background)
        self.frames: list[bytes] = []  # frames[i] carries `id: i`
        self.done = False
        self.ended_at: float | None = None
        self.num_followers = 0
        self.abandoned = False  # cancelled because nobody followed it within the grace
        self.cancel_requested = False  # `cancel` was called
        self._scope: anyio.CancelScope | None = None  # the producer's, while it runs
        self._counter = FrameCounter()
        self._changed = anyio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def changed(self) -> None:
        await self._changed.wait()

    def add(self, data: bytes) -> None:
        """The frames in `data`, numbered, kept and sent to followers; pings are dropped
        (each follower sends its own)."""
        frames = [f for f in self._counter.split(data) if not f.startswith(b":")]
        if frames and not self.done:
            self.frames.extend(frames)
            self._notify()

    async def append(self, data: bytes) -> None:
        """The producer's `emit` (`add`)."""
        self.add(data)

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self.ended_at = time.monotonic()
            self._notify()

    def cancel(self) -> None:
        """Cancel the request this record's producer reads (now, or as soon as it starts);
        it ends the record the way its door ends a cancelled answer."""
        self.cancel_requested = True
        if self._scope is not None:
            self._scope.cancel()

    async def wait_done(self) -> None:
        while not self.done:
            await self.changed()

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

    async def run(
        self,
        produce: Producer,
        *,
        on_close: Callable[[bool], Awaitable[None]],
        on_cancel: Callable[[APIError], bytes],
    ) -> None:
        """Run `produce` into this record until it ends; then (whatever happened) `on_close`
        (it cancels the engine request if still running: True where the server's shutdown cut
        it off) and finish the record. A producer
        cancelled meanwhile (`cancel`, nobody following within the grace, the server's
        shutdown) ends the record with `on_cancel`'s frames."""
        by_shutdown = False
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                if self.cancel_requested:
                    scope.cancel()
                await produce(self.append)
            if scope.cancelled_caught:  # by `cancel`
                await self.append(on_cancel(APIError(499, "cancelled", code="cancelled")))
        except anyio.get_cancelled_exc_class():
            if self.abandoned:
                err = APIError(
                    500,
                    f"the request was cancelled: nobody reconnected within {self.grace_s:g} s",
                    code="cancelled",
                )
            else:
                err, by_shutdown = cut_by_shutdown(), True
            await self.append(on_cancel(err))
            raise
        finally:
            self._scope = None
            with anyio.CancelScope(shield=True):
                await on_close(by_shutdown)
            self.finish()


_K = TypeVar("_K")


class Kept(Generic[_K]):
    """Items by id, each private to the API key that made it, dropped `ttl_s` after it ended
    (`ended_at(item)`, a time.monotonic(); None while it runs) and, past `max_count`, the
    oldest ended first. Swept lazily, on each use."""

    def __init__(
        self, ttl_s: float, max_count: int, ended_at: Callable[[_K], float | None]
    ) -> None:
        self.ttl_s = ttl_s
        self.max_count = max_count
        self._ended_at = ended_at
        self._items: dict[str, tuple[str, _K]] = {}  # id -> (owner, item)

    def __len__(self) -> int:
        self._sweep()
        return len(self._items)

    def __iter__(self) -> Iterator[_K]:
        self._sweep()
        return iter([item for _, item in self._items.values()])

    def put(self, rid: str, owner: str, item: _K) -> None:
        self._sweep()
        self._items[rid] = (owner, item)

    def find(self, rid: str, owner: str, *, any_owner: str | None = None) -> _K | None:
        """The item `rid` if `owner` made it (or it was made by `any_owner`, for all)."""
        self._sweep()
        found = self._items.get(rid)
        if found is None or found[0] not in (owner, any_owner):
            return None
        return found[1]

    def delete(self, rid: str) -> None:
        self._items.pop(rid, None)

    def _sweep(self) -> None:
        now = time.monotonic()
        ended = []
        for rid, (_, item) in self._items.items():
            at = self._ended_at(item)
            if at is not None:
                ended.append((at, rid))
        ended.sort()
        excess = len(self._items) - self.max_count
        for i, (at, rid) in enumerate(ended):
            if i < excess or now - at > self.ttl_s:
                del self._items[rid]


class ResumeRegistry:
    """Every resumable stream's record, by request id, private to the key that started it;
    a record is dropped `grace_s` after its request ended."""

    def __init__(self, grace_s: float, max_records: int = DEFAULT_MAX_RECORDS):
        self.grace_s = grace_s
        self._records: Kept[StreamRecord] = Kept(grace_s, max_records, lambda r: r.ended_at)

    def __len__(self) -> int:
        return len(self._records)

    def open(self, rid: str, owner: str, wire: Wire, *, grace_s: float | None = -1) -> StreamRecord:
        """A new record for `rid`, resumable by `owner`. `grace_s`: how long it runs on with
        nobody following (None: until it ends; by default the registry's grace)."""
        record = StreamRecord(rid, owner, self.grace_s if grace_s == -1 else grace_s, wire)
        self._records.put(rid, owner, record)
        return record

    def get(self, rid: str, owner: str) -> StreamRecord:
        """The record of `rid`, for the key `owner`. Raises APIError 404 when there is none
        (never started resumable, ended more than the grace ago, or another key's)."""
        record = self._records.find(rid, owner)
        if record is None:
            raise APIError(
                404,
                f"no stream {rid!r} to resume: only a stream started with "
                '`stream_options: {"resumable": true}` (or the x-stepline-resumable header) '
                f"can be resumed, by the API key that started it, until {self.grace_s:g} s "
                "after it ended",
                code="stream_not_found",
            )
        return record


class ResumableStreamResponse(Response):
    """The response of a kept stream: `run` writes the record (and finishes it) in this
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
) -> StreamResponse:
    """A response that follows `record` from after frame `after`."""

    async def nothing() -> None:
        pass

    return StreamResponse(
        lambda emit: record.follow(emit, after),
        wire=record.wire,
        headers=headers,
        heartbeat_s=heartbeat_s,
        on_close=nothing,
    )


def resume_response(
    registry: ResumeRegistry, rid: str, headers: Headers, heartbeat_s: float
) -> StreamResponse:
    """`GET /v1/requests/{rid}/stream`: the frames after `Last-Event-ID` (all of them without
    one), then the live stream. Raises APIError 404 (see `ResumeRegistry.get`), 400."""
    after = frame_cursor(headers.get("last-event-id"), "Last-Event-ID")
    record = registry.get(rid, key_of(headers))
    return follower_response(record, after, {"x-request-id": rid}, heartbeat_s)
