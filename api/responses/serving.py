"""The OpenAI Responses API on the engine: `POST /v1/responses` (streaming or not,
`background`), `GET /v1/responses/{id}` (`?stream=true&starting_after=N` replays the events
after sequence number N, then the live ones), `POST /v1/responses/{id}/cancel`,
`DELETE /v1/responses/{id}`, and `previous_response_id` (the server keeps the conversation).

A response's events are written into its `StreamRecord` (api/resume.py) by one producer,
`_run`; a stream only follows the record, so its `sequence_number`s are the record's frame
numbers and a replay is byte for byte the original. Stored responses are kept in memory for
`ttl_s` after they end (at most `max_count` ended ones) and only the API key that created one
reads, streams, cancels or continues it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.background import BackgroundTask

from stepline.api.pipeline.agents import plan
from stepline.api.pipeline.errors import APIError
from stepline.api.pipeline.resume import (
    ResumableStreamResponse,
    StreamRecord,
    follower_response,
    key_of,
    wants_resumable,
)
from stepline.api.pipeline.serving import Call, RequestFailed, Serving, Started
from stepline.api.responses.output import OutputWriter
from stepline.api.responses.schema import (
    IncompleteDetails,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    event_frame,
)

if TYPE_CHECKING:
    from stepline.actors.request import RequestOutput
    from stepline.api.engine import RequestStream

log = structlog.get_logger(__name__)

DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_COUNT = 1000
ANY_OWNER = ""  # a response recovered from the log: its key is not recorded (see `recover`)


@dataclass
class StoredResponse:
    response: ResponseObject
    owner: str  # the fingerprint of the API key that created it
    record: StreamRecord
    messages: list[dict[str, Any]]  # the conversation, this response's output last once done
    cancel_requested: bool = False
    scope: anyio.CancelScope | None = None  # the producer's, while it runs
    ended_at: float | None = None
    ended: anyio.Event = field(default_factory=anyio.Event)
    # Held so that dropping the HTTP task's references does not cancel the engine request.
    stream: RequestStream | None = None


class ResponseStore:
    """Stored responses by id: an ended one is dropped `ttl_s` after it ended, and the
    oldest ended ones past `max_count`."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_count: int = DEFAULT_MAX_COUNT):
        self.ttl_s = ttl_s
        self.max_count = max_count
        self._items: dict[str, StoredResponse] = {}

    def put(self, stored: StoredResponse) -> None:
        self._sweep()
        self._items[stored.response.id] = stored

    def get(self, rid: str, owner: str, param: str | None = None) -> StoredResponse:
        """Raises APIError 404 if there is none for this key (never, expired, or another's)."""
        self._sweep()
        stored = self._items.get(rid)
        if stored is None or stored.owner not in (owner, ANY_OWNER):
            raise APIError(
                404,
                f"No response with id {rid!r} found: responses are kept {self.ttl_s:g} s after "
                "they end, for the API key that created them",
                param=param,
                code="response_not_found",
            )
        return stored

    def delete(self, rid: str) -> None:
        self._items.pop(rid, None)

    def _sweep(self) -> None:
        now = time.monotonic()
        ended = sorted(
            (s for s in self._items.values() if s.ended_at is not None),
            key=lambda s: s.ended_at or 0.0,
        )
        excess = len(self._items) - self.max_count
        for i, s in enumerate(ended):
            if i < excess or now - (s.ended_at or now) > self.ttl_s:
                del self._items[s.response.id]


class ResponsesServing(Serving):
    """The /v1/responses handlers."""

    def __init__(self, *args: Any, ttl_s: float = DEFAULT_TTL_S, **kw: Any):
        super().__init__(*args, **kw)
        self.store = ResponseStore(ttl_s)

    async def create(self, request: Request) -> Response:
        return await self.handle(request, f"resp_{uuid.uuid4().hex}", self._create)

    async def _create(self, request: Request, rid: str) -> Response:
        req = await self.parse(request, ResponsesRequest)
        owner = key_of(request.headers)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id, owner, "previous_response_id")
            if prev.ended_at is None:
                raise APIError(
                    400,
                    f"response {req.previous_response_id!r} is still in progress: wait for it "
                    "to end before continuing from it",
                    param="previous_response_id",
                )
            if prev.response.status not in ("completed", "incomplete"):
                raise APIError(
                    400,
                    f"response {req.previous_response_id!r} is {prev.response.status}: only a "
                    "completed (or incomplete) response can be continued",
                    param="previous_response_id",
                )
            history = prev.messages
        turn = history + req.messages()
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        fmt = req.text_format
        tools = req.tool_specs()  # function tools, namespaces flattened, hosted ones dropped
        agent = plan(
            self.engine.tokenizer,
            tools=tools.specs,
            tool_choice=req.tool_choice_name(tools),
            parallel_tool_calls=req.parallel_tool_calls,
            schema=fmt.schema_ if fmt is not None and fmt.type == "json_schema" else None,
            json_object=fmt is not None and fmt.type == "json_object",
            template_kwargs=self.default_template_kwargs,
            schema_param="text.format.schema",
        )
        # Hosted tools (web search, ...) run on OpenAI's servers: a local model has none.
        # Named with any the model itself cannot use (`Serving.start` says so).
        agent = replace(agent, dropped_tools=(*tools.dropped, *agent.dropped_tools))
        started = await self.start(
            Call(
                rid,
                req,
                agent,
                "input",
                messages=system + turn,
                max_tokens=req.max_output_tokens,
                max_tokens_param="max_output_tokens",
            )
        )
        stream, splitter = started.stream, started.splitter()
        response = ResponseObject(
            id=rid,
            status="queued" if req.background else "in_progress",
            background=req.background,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            model=self.response_model(req.model),
            previous_response_id=req.previous_response_id,
            temperature=req.temperature,
            top_p=req.top_p,
            metadata=req.metadata or {},
            store=req.store,
            tools=req.tools or [],
            tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=req.parallel_tool_calls,
            text={
                "format": {"type": "text"}
                if fmt is None
                else fmt.model_dump(by_alias=True, exclude_none=True)
            },
        )
        # Not background: a disconnect cancels at once, unless the client asked to resume.
        grace = self.resume.grace_s if wants_resumable(request.headers) else 0.0
        record = StreamRecord(rid, owner, None if req.background else grace)
        stored = StoredResponse(response, owner, record, turn, stream=stream)
        if req.store:
            self.store.put(stored)
        self.resume.adopt(record)  # GET /v1/requests/{id}/stream follows it too
        headers = started.headers
        writer = OutputWriter(
            stored,
            splitter,
            parallel=req.parallel_tool_calls,
            message_first=not tools.specs,
            names=tools.namespaced,
        )

        async def run() -> None:
            await self._run(stored, started, writer)

        if req.stream:
            return ResumableStreamResponse(
                record, run, headers=headers, heartbeat_s=self.heartbeat_s
            )
        if req.background:
            body = response.model_dump_json()
            return Response(
                body, media_type="application/json", headers=headers, background=BackgroundTask(run)
            )
        await self.attached(request, run)  # a disconnect cancels it
        return Response(response.model_dump_json(), media_type="application/json", headers=headers)

    async def _run(self, stored: StoredResponse, started: Started, writer: OutputWriter) -> None:
        """The producer: read the engine request, write the events, keep the response object
        current; always ends the record with one of response.completed / .incomplete /
        .failed / .cancelled."""
        resp, stream = stored.response, started.stream
        last: RequestOutput | None = None
        failed: RequestFailed | None = None
        cancelled = False
        try:
            with anyio.CancelScope() as scope:
                stored.scope = scope
                if stored.cancel_requested:
                    scope.cancel()
                writer.emit("response.created", response=resp)
                resp.status = "in_progress"
                writer.emit("response.in_progress", response=resp)
                if writer.message_first:
                    writer.open_message()
                try:
                    async for piece in self.pieces(started, writer.splitter):
                        if not piece.is_progress:
                            last = piece.out
                            writer.write(piece.delta)
                except RequestFailed as exc:  # `_end` says how
                    last, failed = exc.out, exc
            cancelled = scope.cancelled_caught
        except anyio.get_cancelled_exc_class():
            if not resp.background:  # its client went away (and did not come back)
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
            # else the server shuts down: the engine's shutdown, right after, ends the request
            # and its log says so, which a restart reads (`responses_recovery`).
            self._end(stored, writer, None, cancelled=True)
            raise
        except Exception:  # a bug: the response still ends, as failed, never hangs its readers
            log.exception("response_failed", request_id=resp.id)
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            self._end(stored, writer, None, cancelled=False)
            return
        await stream.aclose()  # cancels the engine request if it still runs
        self._end(stored, writer, last, cancelled=cancelled, failed=failed)

    def _end(
        self,
        stored: StoredResponse,
        writer: OutputWriter,
        last: RequestOutput | None,
        *,
        cancelled: bool,
        failed: APIError | None = None,
    ) -> None:
        resp = stored.response
        if last is not None:
            resp.usage = ResponseUsage.of(
                last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens
            )
        reason = None if last is None else last.finish_reason
        if cancelled or reason == "cancelled":
            resp.status = "cancelled"
            writer.abandon()
            writer.emit("response.cancelled", response=resp)
        elif reason in ("stop", "length"):
            writer.close(complete=reason == "stop")
            if reason == "stop":
                resp.status = "completed"
                writer.emit("response.completed", response=resp)
            else:
                resp.status = "incomplete"
                resp.incomplete_details = IncompleteDetails(reason="max_output_tokens")
                writer.emit("response.incomplete", response=resp)
            stored.messages = [*stored.messages, writer.assistant_message()]
        else:
            message = f"internal error (request id {resp.id})"
            code = "server_error"
            if failed is not None:  # already logged where the request failed
                message, code = failed.detail.message, failed.detail.code or code
            resp.status = "failed"
            writer.abandon()
            resp.error = ResponseError(code=code, message=message)
            writer.emit("response.failed", response=resp)
        stored.ended_at = time.monotonic()
        stored.scope = None
        stored.stream = None
        stored.record.finish()
        stored.ended.set()

    def recover(self, rid: str, admitted_at: float) -> None:
        """Store `rid` as failed: the event log says the server stopped before it ended
        (`responses_recovery`). Which key created it is not in the log, so any key reads
        it; it holds no input and no output, only the failure."""
        response = ResponseObject(
            id=rid,
            created_at=int(admitted_at),
            status="failed",
            background=True,
            model=self.model_name,
            error=ResponseError(
                code="server_restarted",
                message="the server stopped before this response finished and its output is "
                "lost: create it again",
            ),
        )
        record = StreamRecord(rid, ANY_OWNER, None)
        record.append_event(event_frame("response.failed", 0, response=response))
        record.finish()
        stored = StoredResponse(response, ANY_OWNER, record, [], ended_at=time.monotonic())
        stored.ended.set()
        self.store.put(stored)

    # -- by id --

    def _get(self, request: Request, rid: str) -> StoredResponse:
        return self.store.get(rid, key_of(request.headers))

    async def retrieve(self, request: Request, rid: str) -> Response:
        stored = self._get(request, rid)
        if request.query_params.get("stream", "").lower() != "true":
            return Response(stored.response.model_dump_json(), media_type="application/json")
        after = request.query_params.get("starting_after", "")
        try:
            starting_after = int(after) if after else -1
            if starting_after < -1:  # replayed events out of order, duplicated, GBs of them
                raise ValueError(after)
        except ValueError:
            raise APIError(
                400,
                f"starting_after must be an event's sequence_number (>= 0; -1 = from the "
                f"start), got {after!r}",
                param="starting_after",
            ) from None
        return follower_response(
            stored.record, starting_after, {"x-request-id": rid}, self.heartbeat_s
        )

    async def cancel(self, request: Request, rid: str) -> Response:
        stored = self._get(request, rid)
        if not stored.response.background:
            raise APIError(
                400, "only a background response can be cancelled", code="invalid_request"
            )
        if stored.ended_at is None:
            stored.cancel_requested = True
            if stored.scope is not None:
                stored.scope.cancel()
            with anyio.fail_after(30):
                await stored.ended.wait()
        return Response(stored.response.model_dump_json(), media_type="application/json")

    async def delete(self, request: Request, rid: str) -> Response:
        stored = self._get(request, rid)
        if stored.ended_at is None and stored.scope is not None:
            stored.cancel_requested = True
            stored.scope.cancel()
        self.store.delete(rid)
        body = f'{{"id":"{rid}","object":"response","deleted":true}}'
        return Response(body, media_type="application/json")


def responses_router(serving: ResponsesServing) -> APIRouter:
    """The /v1/responses routes (the app's key check covers them)."""
    router = APIRouter()

    @router.post("/v1/responses")
    async def create(request: Request) -> Response:
        return await serving.create(request)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Response:
        return await serving.retrieve(request, response_id)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel(request: Request, response_id: str) -> Response:
        return await serving.cancel(request, response_id)

    @router.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> Response:
        return await serving.delete(request, response_id)

    return router
