"""The OpenAI Responses API on the engine: `POST /v1/responses` (streamed or not,
`background`), `GET /v1/responses/{id}` (`?stream=true&starting_after=N` replays the events
after sequence number N, then the live ones), `POST /v1/responses/{id}/cancel`,
`DELETE /v1/responses/{id}`, and `previous_response_id` (the server keeps the conversation).

A thin adapter over the pipeline every door shares: a response's events are rendered by
`ResponseRenderer` (api/responses/output.py) into the pipeline's record of its stream (the one
writer, numbering, resume and disconnect handling of every door); a stream only follows the
record, so its `sequence_number`s are the record's frame numbers and a replay is byte for
byte the original. What is this door's own is its store: responses are kept for `ttl_s` after
they end (at most `max_count` ended ones), and only the API key that created one reads,
streams, cancels or continues it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import anyio
import structlog
from fastapi import APIRouter, Request
from fastapi.responses import Response
from openai.types import responses as sdk
from openai.types.responses import ResponseTextConfig
from pydantic import TypeAdapter, ValidationError

from stepline.api.pipeline.agents import plan
from stepline.api.pipeline.errors import OPENAI, APIError
from stepline.api.pipeline.resume import Kept, StreamRecord, follower_response, frame_cursor, key_of
from stepline.api.pipeline.serving import Call, RequestContext, Serving, client_of
from stepline.api.responses.output import ResponseRenderer, event_frame, failed_response
from stepline.api.responses.schema import ResponsesRequest, TextFormat

log = structlog.get_logger(__name__)

DEFAULT_MAX_COUNT = 1000
ANY_OWNER = ""  # a response recovered from the log: its key is not recorded (see `recover`)
CANCEL_WAIT_S = 30.0  # how long `cancel` waits for a response to end
_TOOL = TypeAdapter(sdk.Tool)
_TOOL_CHOICE = TypeAdapter(sdk.response.ToolChoice)


@dataclass
class StoredResponse:
    response: sdk.Response
    record: StreamRecord  # its stream's events; ended when the response ended
    messages: list[dict[str, Any]]  # the conversation, this response's output last once done

    @property
    def ended_at(self) -> float | None:
        return self.record.ended_at


class ResponseStore:
    """Stored responses by id (see the module docstring)."""

    def __init__(self, ttl_s: float, max_count: int = DEFAULT_MAX_COUNT):
        self.ttl_s = ttl_s
        self._kept: Kept[StoredResponse] = Kept(ttl_s, max_count, lambda s: s.ended_at)

    def put(self, owner: str, stored: StoredResponse) -> None:
        self._kept.put(stored.response.id, owner, stored)

    def get(self, rid: str, owner: str, param: str | None = None) -> StoredResponse:
        """Raises APIError 404 if there is none for this key (never, expired, or another's)."""
        stored = self._kept.find(rid, owner, any_owner=ANY_OWNER)
        if stored is None:
            raise APIError(
                404,
                f"No response with id {rid!r} found: responses are kept {self.ttl_s:g} s after "
                "they end, for the API key that created them",
                param=param,
                code="response_not_found",
            )
        return stored

    def delete(self, rid: str) -> None:
        self._kept.delete(rid)


def _echo_tools(tools: list[dict[str, Any]] | None) -> list[Any]:
    """The request's tools as the response lists them: those OpenAI's types know."""
    out = []
    for tool in tools or ():
        try:
            out.append(_TOOL.validate_python(tool))
        except ValidationError:
            continue  # a tool the SDK cannot name: not one this server runs either
    return out


def _echo_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    try:
        return _TOOL_CHOICE.validate_python(choice or "auto")
    except ValidationError:
        return "auto"  # checked already (`tool_choice_name`); a shape the SDK does not know


def _echo_text(fmt: TextFormat | None) -> dict[str, Any]:
    if fmt is None:
        return {"format": {"type": "text"}}
    echoed = fmt.model_dump(by_alias=True, exclude_none=True)
    if fmt.type == "json_schema":
        echoed.setdefault("name", "response")
    return {"format": echoed}


class ResponsesDoor:
    """The /v1/responses handlers."""

    def __init__(self, serving: Serving):
        self.serving = serving
        self.store = ResponseStore(serving.config.responses_ttl_s)
        for rid, admitted_at in serving.interrupted:
            self.recover(rid, admitted_at)

    async def create(self, ctx: RequestContext[ResponsesRequest]) -> Response:
        serving, request, rid, req = self.serving, ctx.request, ctx.rid, ctx.body
        owner = key_of(request.headers)
        turn = self._history(req, owner) + req.messages()
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        fmt = req.text_format
        tools = req.tool_specs()  # function tools, namespaces flattened, hosted ones dropped
        agent = plan(
            ctx.engine.tokenizer,
            tools=tools.specs,
            tool_choice=req.tool_choice_name(tools),
            parallel_tool_calls=req.parallel_tool_calls,
            schema=fmt.schema_ if fmt is not None and fmt.type == "json_schema" else None,
            json_object=fmt is not None and fmt.type == "json_object",
            template_kwargs=ctx.model.default_template_kwargs,
            schema_param="text.format.schema",
        )
        # Hosted tools (web search, ...) run on OpenAI's servers: a local model has none.
        # Named with any the model itself cannot use (`Serving.start` says so).
        agent = replace(agent, dropped_tools=(*tools.dropped, *agent.dropped_tools))
        started = await serving.start(
            ctx,
            Call(
                rid,
                req,
                agent,
                "input",
                messages=system + turn,
                max_tokens=req.max_output_tokens,
                max_tokens_param="max_output_tokens",
                client=client_of(request.headers, req.safety_identifier or req.user),
            ),
        )
        response = _new_response(rid, req, ctx.response_model)
        record = serving.keep(
            request,
            started,
            OPENAI,
            resumable=serving.asks_resumable(request, False),
            background=req.background,
        )
        stored = StoredResponse(response, record, turn)

        def on_end(message: dict[str, Any]) -> None:
            stored.messages = [*stored.messages, message]

        renderer = ResponseRenderer(
            response,
            started.splitter(),
            parallel=req.parallel_tool_calls,
            message_first=not tools.specs,
            names=tools.namespaced,
            on_end=on_end,
        )
        if req.store:
            self.store.put(owner, stored)
        if req.stream:
            return serving.stream(started, renderer, OPENAI, record=record)
        body = Response(
            response.model_dump_json(exclude_unset=True),
            media_type="application/json",
            headers=started.headers,
        )
        if req.background:
            return serving.in_background(record, started, renderer, body)
        await serving.attached(request, serving.run_kept(record, started, renderer))
        return _body(response, started.headers)

    def _history(self, req: ResponsesRequest, owner: str) -> list[dict[str, Any]]:
        """The conversation `req.previous_response_id` continues (none without one). Raises
        APIError: 404 for none of this key's, 400 for one still running or that failed."""
        if req.previous_response_id is None:
            return []
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
        return prev.messages

    def recover(self, rid: str, admitted_at: float) -> None:
        """Store `rid` as failed: the event log says the server stopped before it ended
        (`recovery`). Which key created it is not in the log, so any key reads it; it holds
        no input and no output, only the failure."""
        response = failed_response(
            rid,
            self.serving.model_name,  # which model it was for is not in the log
            admitted_at,
            "server_restarted",
            "the server stopped before this response finished and its output is lost: create "
            "it again",
        )
        record = StreamRecord(rid, ANY_OWNER, None, OPENAI)
        failed = response.model_dump(exclude_unset=True, mode="json")
        record.add(
            event_frame({"type": "response.failed", "sequence_number": 0, "response": failed})
        )
        record.finish()
        self.store.put(ANY_OWNER, StoredResponse(response, record, []))

    # -- by id --

    def _get(self, request: Request, rid: str) -> StoredResponse:
        return self.store.get(rid, key_of(request.headers))

    async def retrieve(self, request: Request, rid: str) -> Response:
        stored = self._get(request, rid)
        if request.query_params.get("stream", "").lower() != "true":
            return _body(stored.response)
        after = frame_cursor(request.query_params.get("starting_after"), "starting_after")
        return follower_response(
            stored.record, after, {"x-request-id": rid}, self.serving.config.heartbeat_s
        )

    async def cancel(self, request: Request, rid: str) -> Response:
        stored = self._get(request, rid)
        if not stored.response.background:
            raise APIError(
                400, "only a background response can be cancelled", code="invalid_request"
            )
        stored.record.cancel()
        with anyio.fail_after(CANCEL_WAIT_S):
            await stored.record.wait_done()
        return _body(stored.response)

    async def delete(self, request: Request, rid: str) -> Response:
        stored = self._get(request, rid)
        stored.record.cancel()
        self.store.delete(rid)
        body = f'{{"id":"{rid}","object":"response","deleted":true}}'
        return Response(body, media_type="application/json")


def _new_response(rid: str, req: ResponsesRequest, model: str) -> sdk.Response:
    """The response as it starts (queued, or in progress), echoing the request's settings."""
    return sdk.Response(
        id=rid,
        object="response",
        created_at=int(time.time()),
        status="queued" if req.background else "in_progress",
        background=req.background,
        error=None,
        incomplete_details=None,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        model=model,
        output=[],
        parallel_tool_calls=req.parallel_tool_calls,
        previous_response_id=req.previous_response_id,
        temperature=req.temperature,
        top_p=req.top_p,
        tool_choice=_echo_tool_choice(req.tool_choice),
        tools=_echo_tools(req.tools),
        text=ResponseTextConfig.model_validate(_echo_text(req.text_format)),
        truncation="disabled",
        usage=None,
        metadata=req.metadata or {},
        **{"store": req.store},  # the API's field, which the SDK's type lacks
    )


def _body(response: sdk.Response, headers: dict[str, str] | None = None) -> Response:
    return Response(
        response.model_dump_json(exclude_unset=True), media_type="application/json", headers=headers
    )


def router(serving: Serving) -> APIRouter:
    """The /v1/responses routes (the app's key check covers them)."""
    door = ResponsesDoor(serving)
    routes = APIRouter()

    @routes.post("/v1/responses")
    async def create(request: Request) -> Response:
        rid = f"resp_{uuid.uuid4().hex}"
        return await serving.handle(request, rid, door.create, OPENAI, body=ResponsesRequest)

    @routes.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Response:
        return await door.retrieve(request, response_id)

    @routes.post("/v1/responses/{response_id}/cancel")
    async def cancel(request: Request, response_id: str) -> Response:
        return await door.cancel(request, response_id)

    @routes.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> Response:
        return await door.delete(request, response_id)

    return routes
