"""The event log over HTTP, live, and the page it feeds.

    GET /v1/events                          the events as server-sent events (events/feed.py)
    GET /v1/events/about                    the run: its header, what memory and the file keep
    GET /v1/events/requests/{id}/timeline   one request's life, as `stepline replay --request`
    GET /dashboard/                         the page (static files in api/http/dashboard/)

`/v1/events` takes `request_id`, `model` and `type` (each repeated, or comma-separated: any
of them) and `after` (a place, `RUN.N`; `now`: only what comes next; `view`: what a picture of
the engine now is folded from, then everything after (`EventFeed.follow_view`: the page's
start); none: from the oldest event in memory); a `Last-Event-ID` header (a reconnecting
EventSource's) goes before `after`. Each event is one frame (`id: RUN.N`, `data: {event}`);
`event: run` frames say which run the events that follow are of, `event: missed` frames how
many did not come and why, an `event: caught-up` frame (its id a place) where a view's
catch-up ends.

A browser's EventSource cannot send headers, so under `--api-key` these paths (and only
these) also take the key as the `stepline_api_key` cookie (what the page sets) or an
`api_key` query parameter (`RequireKey`, api/http/app.py). The page itself needs no key: it
holds nothing, and says so when the key is missing.
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from pydantic_core import to_json
from starlette.staticfiles import StaticFiles

from stepline.api.pipeline.errors import OPENAI, APIError
from stepline.api.pipeline.writer import StreamResponse
from stepline.events.feed import EventFeed, EventFilter, Item, Place, frames, parse_place
from stepline.events.models import Event, LogHeader

DASHBOARD_DIR = Path(__file__).parent / "dashboard"
KEY_COOKIE = "stepline_api_key"  # the page's key, for the paths below only
KEY_QUERY = "api_key"
KEY_PATHS = ("/v1/events",)  # the paths that take the key as a cookie or a query parameter
OPEN_PREFIXES = ("/dashboard",)  # static files: open, so the page can say the key is missing
RETRY_MS = 2000  # how soon a browser reconnects after the stream drops


class EventsWire:
    """The event stream's errors: OpenAI's bodies; in a stream, an `error` event (a frame
    EventSource's `onmessage` does not take for an event of the log)."""

    numbered = False
    media_type = "text/event-stream"
    ping = b": ping\n\n"

    def response(self, err: APIError) -> Response:
        return OPENAI.response(err)

    def frames(self, err: APIError) -> bytes:
        body = {"message": err.message, "code": err.code}
        return b"event: error\ndata: " + to_json(body) + b"\n\n"


EVENTS_WIRE = EventsWire()


def _choices(values: Sequence[str] | None) -> frozenset[str] | None:
    if not values:
        return None
    return frozenset(v.strip() for value in values for v in value.split(",") if v.strip())


VIEW = "view"  # `after=view`: the page's start (EventFeed.follow_view)


def _start(feed: EventFeed, last_event_id: str | None, after: str | None) -> Place | str | None:
    """Where a reader starts: a place, VIEW, or None (the oldest event in memory). Raises
    APIError 400 for a place that is none."""
    text, param = (last_event_id, "Last-Event-ID") if last_event_id else (after, "after")
    if not text:
        return None
    if text.strip() == "now" and param == "after":
        return Place(feed.key, feed.last)
    if text.strip() == VIEW and param == "after":
        return VIEW
    try:
        return parse_place(text)
    except ValueError:
        raise APIError(
            400,
            f"{param} must be an event's place, RUN.N, as a frame's id says (or after=now, "
            "after=view), "
            f"got {text!r}",
            param=param,
            code="invalid_value",
        ) from None


def event_stream(
    feed: EventFeed, request: Request, wanted: EventFilter, after: str | None, heartbeat_s: float
) -> StreamResponse:
    """`GET /v1/events`: the events `wanted` takes, after the place the client names."""
    start = _start(feed, request.headers.get("last-event-id"), after)

    async def produce(emit: Any) -> None:
        await emit(b"retry: %d\n\n" % RETRY_MS)
        with feed.reading() as reader:
            batches: AsyncIterator[list[Item]] = (
                feed.follow_view(wanted, reader)
                if start == VIEW
                else feed.follow(start if isinstance(start, Place) else None, wanted, reader)
            )
            async for batch in batches:
                if batch:
                    data = frames(batch)
                    reader.holding = len(data)  # until the socket takes it
                    await emit(data)
                    reader.holding = 0

    async def nothing() -> None:
        pass

    return StreamResponse(
        produce, wire=EVENTS_WIRE, headers={}, heartbeat_s=heartbeat_s, on_close=nothing
    )


def about(feed: EventFeed) -> dict[str, Any]:
    """`GET /v1/events/about`: the run the feed is of, and where its events are kept."""
    return {
        "run": feed.key,
        "live": feed.live,
        "header": feed.header.model_dump(mode="json", exclude={"salt"}),
        "event_log": str(feed.log_path) if feed.log_path is not None else None,
        "kept_in_memory": feed.capacity,
        "first": str(Place(feed.key, feed.first - 1)) if feed.live else None,
        "last": str(Place(feed.key, feed.last)) if feed.live else None,
        # each reader following: how many events behind the newest it is, and the bytes the
        # server holds for it (a batch its socket has not taken yet)
        "readers": [
            {"behind": feed.last - r.at, "holding_bytes": r.holding} for r in feed.followers()
        ],
    }


def timeline_text(feed: EventFeed, request_id: str, in_memory: Sequence[Event] = ()) -> str:
    """One request's timeline, the text `stepline replay --request` prints: read from the
    log file, or without one from `in_memory` (the feed's events, taken on the event loop's
    thread, which changes them). Blocks (run it on a thread). Raises LookupError (replay's
    UnknownRequestError) when neither holds the request."""
    from stepline.events.replay import request_timeline
    from stepline.events.replay.request_text import text_timeline

    if feed.log_path is not None:
        if feed.flush is not None:
            feed.flush()
        timeline = request_timeline(feed.log_path, request_id, run=feed.run)
        return "\n".join(text_timeline(timeline)) + "\n"
    with tempfile.TemporaryDirectory(prefix="stepline-timeline-") as folder:
        path = Path(folder) / "events.jsonl"
        _write_memory(feed.header, in_memory, path)
        timeline = request_timeline(path, request_id)
        return "\n".join(text_timeline(timeline)) + "\n"


def _write_memory(header: LogHeader, in_memory: Sequence[Event], path: Path) -> None:
    """The events in memory as a log of their run (its prompts' ids are not kept)."""
    header = header.model_copy(update={"log_prompts": False})
    lines = [header.model_dump_json().encode()]
    lines += [event.model_dump_json().encode() for event in in_memory]
    path.write_bytes(b"\n".join(lines) + b"\n")


def events_routes(feed: EventFeed | None, *, heartbeat_s: float) -> APIRouter:
    """The routes of the events (module docstring) over `feed` (None: a 404 for each)."""
    router = APIRouter()

    def the_feed() -> EventFeed:
        if feed is None:
            raise APIError(404, "this server keeps no events to stream", code="not_found")
        return feed

    @router.get("/v1/events", response_model=None)
    async def events(
        request: Request,
        request_id: list[str] | None = Query(None),  # noqa: B008 - FastAPI's way
        model: list[str] | None = Query(None),  # noqa: B008
        type: list[str] | None = Query(None),  # noqa: B008
        after: str | None = None,
    ) -> Response:
        wanted = EventFilter(_choices(request_id), _choices(model), _choices(type))
        return event_stream(the_feed(), request, wanted, after, heartbeat_s)

    @router.get("/v1/events/about")
    async def events_about() -> JSONResponse:
        return JSONResponse(about(the_feed()))

    @router.get("/v1/events/requests/{request_id}/timeline")
    async def request_timeline(request_id: str) -> PlainTextResponse:
        feed = the_feed()
        in_memory = feed.in_memory() if feed.log_path is None else []
        try:
            text = await anyio.to_thread.run_sync(timeline_text, feed, request_id, in_memory)
        except LookupError as exc:
            raise APIError(404, str(exc), code="request_not_found") from None
        return PlainTextResponse(text)

    return router


def add_dashboard(app: FastAPI) -> None:
    """The page at /dashboard/ (and /dashboard, which goes there)."""

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    app.mount("/dashboard", StaticFiles(directory=DASHBOARD_DIR, html=True), name="dashboard")


def replay_app(feed: EventFeed) -> FastAPI:
    """The page and its events over a recorded log (`stepline replay LOG --serve`): no key,
    no engine; errors as the server's."""
    from stepline.api.http.app import add_error_handlers

    app = FastAPI(title="stepline replay", version="0.1.0")
    add_error_handlers(app)
    app.include_router(events_routes(feed, heartbeat_s=15.0))
    add_dashboard(app)
    return app
