"""A started request's way out, for every door: its outputs as typed pieces (`Output.pieces`),
a whole answer (`collect`, cancelled when the client leaves), or the one stream writer
(`stream`: frames, pings, numbering, disconnects, resumable and kept streams). A door only
renders pieces in its wire format (`Renderer`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import anyio
import structlog
from fastapi import Request
from fastapi.responses import Response
from starlette.background import BackgroundTask

from stepline.actors.scheduler.work import GRAMMAR_FAILED
from stepline.api.config import ServerConfig
from stepline.api.pipeline.errors import (
    APIError,
    Wire,
    client_closed,
    engine_unhealthy,
    grammar_failed,
    internal_error,
    shutting_down,
)
from stepline.api.pipeline.model_output import OutputDelta, OutputSplitter
from stepline.api.pipeline.resume import (
    FrameCounter,
    ResumableStreamResponse,
    ResumeRegistry,
    StreamRecord,
    key_of,
    wants_resumable,
)
from stepline.api.pipeline.writer import Emit, StreamResponse

if TYPE_CHECKING:
    from stepline.actors.request import RequestOutput
    from stepline.api.pipeline.start import Started

log = structlog.get_logger(__name__)


@dataclass
class Piece:
    """One step of a request's output, split."""

    delta: OutputDelta
    out: RequestOutput  # `is_progress`: no output yet, a long prompt is prefilling

    @property
    def is_progress(self) -> bool:
        return self.out.is_progress


# How an end the APIs have no word for reaches a client: the loop guard's (the answer
# repeated itself verbatim; actors/scheduler/loop_guard.py) as a length, the nearest standard
# value (OpenAI's finish_reason, Ollama's done_reason; Anthropic's stop_reason max_tokens,
# Responses' incomplete max_output_tokens). The event log and the Python API keep "loop".
AS_SENT = {"loop": "length"}


def as_sent(out: RequestOutput) -> RequestOutput:
    """`out` with its finish reason as the doors send it (`AS_SENT`)."""
    reason = out.finish_reason
    if reason is None or reason not in AS_SENT:
        return out
    return replace(out, finish_reason=AS_SENT[reason])


class RequestFailed(APIError):
    """The error of a request that ended with an error or was cancelled; `out` is its last
    output (its finish reason)."""

    def __init__(self, err: APIError, out: RequestOutput):
        super().__init__(err.status_code, err.message, type=err.type, code=err.code)
        self.out = out


class Renderer(Protocol):
    """A door's rendering of one streamed request: its pieces as frames."""

    splitter: OutputSplitter

    def frames(self, piece: Piece) -> bytes:
        """The frames of one piece (b"" for none); the last piece's include the stream's end."""
        ...

    def failed(self, err: APIError) -> bytes:
        """The stream's last frames after the request failed."""
        ...

    def cancelled(self, err: APIError) -> bytes:
        """The stream's last frames after its producer was cancelled (`err` says why)."""
        ...


def asks_resumable(request: Request, in_body: bool) -> bool:
    """Whether `request` asked for a resumable stream (in its body or by header)."""
    return in_body or wants_resumable(request.headers)


def failure(started: Started, out: RequestOutput) -> APIError:
    """The client's error for a request that ended without stop or length; what went wrong
    goes to the log, under the request id the client's message names."""
    rid = out.request_id
    if out.finish_reason == "cancelled":
        return shutting_down("the request was cancelled: the server is shutting down")
    if out.error is not None and out.error.startswith(GRAMMAR_FAILED):
        log.info("request_failed", request_id=rid, error=out.error)  # its schema's fault
        return grammar_failed(out.error, rid)
    log.error("request_failed", request_id=rid, error=out.error)
    if not started.ctx.engine.healthy:
        return engine_unhealthy(rid)
    return internal_error(rid, code="engine_error")


async def pieces(started: Started, splitter: OutputSplitter) -> AsyncIterator[Piece]:
    """The one read loop of every door: the request's outputs as typed pieces (content,
    reasoning, tool-call deltas and calls, split by `splitter`), a progress piece (no
    output) while a long prompt prefills, the last one with the finish reason. Raises
    APIError for a request that failed or ended without a finish reason. Once it ended,
    `started.after` hears its whole text."""
    texts: list[str] = []
    async for received in started.stream:
        out = as_sent(received)
        if out.is_progress:
            yield Piece(OutputDelta(), out)
            continue
        if out.finish_reason not in (None, "stop", "length"):
            raise RequestFailed(failure(started, out), out)
        delta = splitter.feed(out.text)
        if started.after is not None:
            texts.append(out.text)
        if out.finish_reason is not None:
            delta.extend(splitter.finish())
            ended(started, out, texts)
        yield Piece(delta, out)
        if out.finish_reason is not None:
            return
    log.error("request_unfinished", request_id=started.rid, error="no finish reason")
    raise internal_error(started.rid, code="engine_error")


async def attached(request: Request, run: Callable[[], Awaitable[None]]) -> None:
    """The one disconnect watch of non-streamed answers: run `run` to its end while the
    client stays; a client that disconnects cancels it (APIError 499)."""
    gone = False

    async def watch_disconnect(scope: anyio.CancelScope) -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_disconnect, tg.cancel_scope)
        await run()
        tg.cancel_scope.cancel()
    if gone:
        raise client_closed()


async def collect(request: Request, started: Started) -> list[RequestOutput]:
    """Every output of a non-streamed request; a client disconnect cancels it."""
    outs: list[RequestOutput] = []
    stream = started.stream

    async def read() -> None:
        async with stream:
            outs.extend([out async for out in stream if not out.is_progress])

    await attached(request, read)
    if not outs or outs[-1].finish_reason is None:
        raise client_closed()
    outs[-1] = as_sent(outs[-1])
    if outs[-1].finish_reason not in ("stop", "length"):
        raise RequestFailed(failure(started, outs[-1]), outs[-1])
    ended(started, outs[-1], [o.text for o in outs])
    return outs


def ended(started: Started, last: RequestOutput, texts: list[str]) -> None:
    """A request answered to its end (stop or length; `texts`: its outputs' texts where
    `started.after` wants them): its next turn's prefill hears of it, and a whole answer's
    headers say what the prefix cache served (a stream's went out before: its log says)."""
    if started.after is not None:
        started.after("".join(texts))
    started.headers[PREFIX_CACHE_HEADER] = prefix_cache_header(last)


# A whole answer's header: how much of its prompt the prefix cache served, and why not more.
PREFIX_CACHE_HEADER = "x-stepline-prefix-cache"


def prefix_cache_header(out: RequestOutput) -> str:
    """`cached=N; prompt=P`, and where a cached prefix could have served more, why not
    (`miss=cold|diverged|no-snapshot|evicted; shared=S`: `ChunkPrefilled.prefix_miss`)."""
    value = f"cached={out.num_cached_tokens}; prompt={out.num_prompt_tokens}"
    if out.prefix_miss is not None:
        value += f"; miss={out.prefix_miss}; shared={out.prefix_shared}"
    return value


async def produce(started: Started, renderer: Renderer, emit: Emit) -> None:
    """The one producer of every stream: the request's pieces through `renderer` into
    `emit`; a failed request (or a bug here) ends the stream with the renderer's failure
    frames, never a traceback."""
    try:
        async for piece in pieces(started, renderer.splitter):
            data = renderer.frames(piece)
            if data:
                await emit(data)
    except APIError as err:
        await emit(renderer.failed(err))
    except Exception:
        log.exception("stream_failed", request_id=started.rid)
        await emit(renderer.failed(internal_error(started.rid)))


def run_kept(
    record: StreamRecord, started: Started, renderer: Renderer
) -> Callable[[], Awaitable[None]]:
    """What writes `started`'s stream into `record` (see `StreamRecord.run`)."""

    async def run() -> None:
        await record.run(
            lambda emit: produce(started, renderer, emit),
            on_close=lambda by_shutdown: started.stream.aclose(shutdown=by_shutdown),
            on_cancel=renderer.cancelled,
        )

    return run


def in_background(
    record: StreamRecord, started: Started, renderer: Renderer, body: Response
) -> Response:
    """`body` now; the request runs on into `record` after it is sent."""
    body.background = BackgroundTask(run_kept(record, started, renderer))
    return body


class Output:
    """Streams out, for every door of one app: the server's heartbeat and the resumable
    streams' records."""

    def __init__(self, config: ServerConfig, resume: ResumeRegistry):
        self.heartbeat_s = config.heartbeat_s
        self.resume = resume

    def keep(
        self, request: Request, started: Started, wire: Wire, *, resumable: bool, background=False
    ) -> StreamRecord:
        """A record that keeps `started`'s stream (for a reconnect, a later read): resumable
        by the caller's key at GET /v1/requests/{id}/stream. A foreground one is cancelled
        once nobody follows it for the resume grace (`resumable`) or at once; a background
        one runs to its end."""
        grace = None if background else (self.resume.grace_s if resumable else 0.0)
        return self.resume.open(started.rid, key_of(request.headers), wire, grace_s=grace)

    def stream(
        self,
        started: Started,
        renderer: Renderer,
        wire: Wire,
        *,
        record: StreamRecord | None = None,
    ) -> Response:
        """The one stream writer: `renderer`'s frames in `wire`'s framing, numbered where the
        wire numbers them, with pings while nothing is sent. Kept in `record` (see `keep`)
        it survives a dropped connection."""
        if record is not None:
            return ResumableStreamResponse(
                record,
                run_kept(record, started, renderer),
                headers=started.headers,
                heartbeat_s=self.heartbeat_s,
            )
        counter = FrameCounter() if wire.numbered else None
        return StreamResponse(
            lambda emit: produce(
                started, renderer, counter.wrap(emit) if counter is not None else emit
            ),
            wire=wire,
            headers=started.headers,
            heartbeat_s=self.heartbeat_s,
            on_close=started.stream.aclose,
            on_cancel=renderer.cancelled,
        )
