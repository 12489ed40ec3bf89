"""The Anthropic Messages API: `POST /v1/messages` (streamed or not) and
`POST /v1/messages/count_tokens`, a second front door to the same engine request as the
OpenAI endpoints (one event log, prefix cache and cancellation path).

Every request gets an id `msg_<hex>`, its id in the event log. Errors are Anthropic's
`{"type": "error", "error": {"type", "message"}}`; a stream's events follow Anthropic's
order: message_start, then per block content_block_start / _delta... / _stop, message_delta
(stop_reason, output usage), message_stop, with ping events while a long prompt prefills.
Sent with `x-stepline-resumable: 1`, a stream survives a dropped connection (`resume`).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from stepline.api import anthropic_schema as schema
from stepline.api.agents import AgentPlan, plan
from stepline.api.engine import SamplingParams
from stepline.api.errors import APIError, validation_error
from stepline.api.model_output import OutputDelta, OutputSplitter, ToolCall, split_output
from stepline.api.openai_schema import RequestError
from stepline.api.resume import ResumableStreamResponse, key_of, run_producer, wants_resumable
from stepline.api.serving import Serving, json_response
from stepline.api.sse import EventStreamResponse

if TYPE_CHECKING:
    from stepline.actors.request import RequestOutput
    from stepline.api.engine import RequestStream
    from stepline.api.sse import Emit

log = structlog.get_logger(__name__)

_STOP_REASONS = {"length": "max_tokens"}


class AnthropicServing(Serving):
    def _plan(self, req: schema.MessagesRequest | schema.CountTokensRequest) -> AgentPlan:
        choice, parallel = schema.tool_choice(req)
        return plan(
            self.engine.tokenizer,
            tools=schema.tool_specs(req),
            tool_choice=choice,
            parallel_tool_calls=parallel,
            template_kwargs={**self.default_template_kwargs, **schema.template_kwargs(req)},
        )

    async def count_tokens(self, request: Request) -> Response:
        req = await self.parse(request, schema.CountTokensRequest, generates=False)
        agent = self._plan(req)
        ids, _ = await self.prepare(
            messages=schema.engine_messages(req), template_kwargs=agent.template_kwargs
        )
        return JSONResponse({"input_tokens": len(ids)})

    async def messages(self, request: Request, rid: str) -> Response:
        req = await self.parse(request, schema.MessagesRequest)
        agent = self._plan(req)
        messages = schema.engine_messages(req)
        ids, checkpoints = await self.prepare(
            messages=messages, template_kwargs=agent.template_kwargs
        )
        max_tokens = self.max_tokens(
            req.max_tokens, len(ids), default=None, prompt_param="messages"
        )
        fields: dict[str, Any] = {
            name: getattr(req, name)
            for name in ("temperature", "top_p", "top_k")
            if getattr(req, name) is not None
        }
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                stop=tuple(req.stop_sequences or ()),
                grammar=agent.grammar,
                **fields,
            )
        except ValidationError as exc:
            raise validation_error(exc) from None
        stream = await self.submit(
            rid, ids, params, "messages", checkpoints, grammar_param=agent.grammar_param
        )
        # Thinking splits out when the request turns it on, or the server's parser is on.
        reasoning = self.reasoning or (req.thinking is not None and req.thinking.type == "enabled")
        fmt = agent.output_format(
            self.engine.tokenizer,
            reasoning=reasoning,
            prompt_text=self.engine.tokenizer.decode(ids[-8:]),
        )
        tools = agent.openai_tools or None
        if req.stream:
            produce = _Stream(self, req, rid, stream, OutputSplitter(fmt, tools, stream=True))
            headers = {"x-request-id": rid, "request-id": rid}
            if wants_resumable(request.headers):
                record = self.resume.open(rid, key_of(request.headers))
                return ResumableStreamResponse(
                    record,
                    lambda: run_producer(
                        record,
                        produce.run,
                        stream.aclose,
                        lambda message: _error_event(500, message),
                    ),
                    headers=headers,
                    heartbeat_s=self.heartbeat_s,
                )
            return EventStreamResponse(
                produce.run, headers=headers, heartbeat_s=self.heartbeat_s, on_close=stream.aclose
            )
        outs = await self.collect(request, stream)
        last = outs[-1]
        text = "".join(o.text for o in outs)
        split = split_output(text, fmt, tools)
        stop_reason, stop_sequence = self.stop_reason(req, outs, split.tool_calls)
        body = schema.MessageResponse(
            id=rid,
            model=self.response_model(req.model),
            content=_blocks(split),
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=_usage(last),
        )
        return json_response(body, headers={"x-request-id": rid, "request-id": rid})

    def stop_reason(
        self, req: schema.MessagesRequest, outs: list[RequestOutput], calls: list[ToolCall]
    ) -> tuple[str, str | None]:
        """Anthropic's stop_reason, and the stop sequence that ended the text, if one did."""
        reason = outs[-1].finish_reason or "stop"
        if reason != "stop":
            return _STOP_REASONS.get(reason, reason), None
        if calls:
            return "tool_use", None
        ids = [t for o in outs for t in o.token_ids]
        eos = set(self.engine.tokenizer.eos_token_ids or ())
        if ids and ids[-1] in eos or not req.stop_sequences:
            return "end_turn", None
        # The text stops just before the stop string: the full decode shows which one it was.
        text = "".join(o.text for o in outs)
        rest = self.engine.tokenizer.decode(ids)[len(text) :]
        found = [s for s in req.stop_sequences if s and rest.startswith(s)]
        return ("stop_sequence", max(found, key=len)) if found else ("end_turn", None)


def _usage(out: RequestOutput) -> schema.Usage:
    return schema.Usage(
        input_tokens=out.num_prompt_tokens - out.num_cached_tokens,
        output_tokens=out.num_output_tokens,
        cache_read_input_tokens=out.num_cached_tokens,
    )


def _blocks(split: OutputDelta) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if split.reasoning:
        blocks.append({"type": "thinking", "thinking": split.reasoning, "signature": ""})
    if split.content or not (split.tool_calls or split.reasoning):
        blocks.append({"type": "text", "text": split.content})
    for call in split.tool_calls:
        blocks.append(
            {"type": "tool_use", "id": _tool_id(call.id), "name": call.name, "input": call.input}
        )
    return blocks


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class _Stream:
    """Writes one streamed message: blocks open as their kind of output starts and close
    when another kind starts or the message ends."""

    def __init__(
        self,
        serving: AnthropicServing,
        req: schema.MessagesRequest,
        rid: str,
        stream: RequestStream,
        splitter: OutputSplitter,
    ) -> None:
        self.serving, self.req, self.rid, self.stream, self.splitter = (
            serving,
            req,
            rid,
            stream,
            splitter,
        )
        self.index = -1
        self.open: str | None = None  # kind of the open block: "text", "thinking"
        self.calls: list[ToolCall] = []

    async def run(self, emit: Emit) -> None:
        try:
            await self._run(emit)
        except Exception as exc:  # a bug here must still end the stream Anthropic's way
            log.exception("stream_failed", request_id=self.rid)
            await emit(_error_event(500, f"the server failed: {exc!r}"))

    async def _run(self, emit: Emit) -> None:
        outs: list[RequestOutput] = []
        started = False
        async for out in self.stream:
            frames: list[bytes] = []
            if not started:
                started = True
                frames.append(self._message_start(out))
                frames.append(schema.event("ping", {"type": "ping"}))
            if out.is_progress:
                if frames:
                    await emit(b"".join(frames))
                else:
                    await emit(schema.event("ping", {"type": "ping"}))
                continue
            if out.finish_reason not in (None, "stop", "length"):
                err = self.serving.failure(out)
                await emit(b"".join(frames) + _error_event(err.status_code, err.detail.message))
                return
            outs.append(out)
            piece = self.splitter.feed(out.text)
            if out.finish_reason is not None:
                piece.extend(self.splitter.finish())
            frames.extend(self._pieces(piece))
            if out.finish_reason is not None:
                frames.extend(self._close())
                reason, sequence = self.serving.stop_reason(self.req, outs, self.calls)
                frames.append(
                    schema.event(
                        "message_delta",
                        {
                            "type": "message_delta",
                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                            "usage": {"output_tokens": out.num_output_tokens},
                        },
                    )
                )
                frames.append(schema.event("message_stop", {"type": "message_stop"}))
            if frames:
                await emit(b"".join(frames))
            if out.finish_reason is not None:
                return
        await emit(_error_event(500, "the request ended without a finish reason"))

    def _message_start(self, out: RequestOutput) -> bytes:
        message = schema.MessageResponse(
            id=self.rid,
            model=self.serving.response_model(self.req.model),
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=schema.Usage(
                input_tokens=out.num_prompt_tokens - out.num_cached_tokens,
                output_tokens=0,
                cache_read_input_tokens=out.num_cached_tokens,
            ),
        )
        return schema.event(
            "message_start", {"type": "message_start", "message": message.model_dump()}
        )

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self.index += 1
        self.open = kind
        frames.append(
            schema.event(
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": block},
            )
        )
        return frames

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [
            schema.event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        ]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return schema.event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index, "delta": delta},
        )

    def _pieces(self, piece: OutputDelta) -> list[bytes]:
        frames: list[bytes] = []
        if piece.reasoning:
            if self.open != "thinking":
                frames += self._open("thinking", {"type": "thinking", "thinking": ""})
            frames.append(self._delta({"type": "thinking_delta", "thinking": piece.reasoning}))
        if piece.content:
            if self.open != "text":
                frames += self._open("text", {"type": "text", "text": ""})
            frames.append(self._delta({"type": "text_delta", "text": piece.content}))
        for d in piece.tool_call_deltas:
            if d.id is not None:
                block = {"type": "tool_use", "id": _tool_id(d.id), "name": d.name, "input": {}}
                frames += self._open("tool_use", block)
            if d.arguments:
                frames.append(
                    self._delta({"type": "input_json_delta", "partial_json": d.arguments})
                )
            if d.done:
                frames += self._close()
        self.calls.extend(piece.tool_calls)
        return frames


def _error_event(status: int, message: str) -> bytes:
    kind = schema.ERROR_TYPES.get(status, "api_error")
    return schema.event("error", {"type": "error", "error": {"type": kind, "message": message}})


def error_response(err: APIError) -> JSONResponse:
    kind = schema.ERROR_TYPES.get(err.status_code, "api_error")
    body = schema.ErrorResponse(error=schema.ErrorBody(type=kind, message=err.detail.message))
    headers = dict(err.headers)  # e.g. retry-after
    if err.request_id:
        headers["request-id"] = headers["x-request-id"] = err.request_id
    return JSONResponse(body.model_dump(), status_code=err.status_code, headers=headers)


def anthropic_router(serving: AnthropicServing) -> APIRouter:
    """The Anthropic routes (the app's key check covers them: `x-api-key` or a Bearer token)."""
    router = APIRouter()

    async def answer(request: Request, rid: str, handler) -> Response:
        try:
            return await handler(request, rid)
        except RequestError as exc:
            err = APIError(400, exc.message, param=exc.param, code=exc.code)
            err.request_id = rid
            return error_response(err)
        except APIError as exc:
            exc.request_id = rid
            return error_response(exc)
        finally:
            serving.engine.arrived()  # a request that failed before it was submitted

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await answer(request, f"msg_{uuid.uuid4().hex}", serving.messages)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        rid = f"count_{uuid.uuid4().hex}"
        return await answer(request, rid, lambda r, _: serving.count_tokens(r))

    return router
