"""The Anthropic Messages API: `POST /v1/messages` (streamed or not) and
`POST /v1/messages/count_tokens`, a thin adapter over the pipeline every door shares
(`Serving.handle` / `start` / `stream`): one event log, prefix cache, cancellation
path, parameter builder, output splitter and stream writer. Messages and stream events are
the `anthropic` package's own types.

Every request gets an id `msg_<hex>`, its id in the event log. Errors, in a body or as a
stream's last event, are Anthropic's `{"type": "error", "error": {"type", "message"}}`; a
stream's events follow Anthropic's order: message_start, then per block content_block_start /
_delta... / _stop, message_delta (stop_reason, usage), message_stop, with ping events while a
long prompt prefills. Sent with `x-stepline-resumable: 1`, a stream survives a dropped
connection (`resume`).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from anthropic import types as sdk
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from stepline.api.anthropic import schema
from stepline.api.anthropic.wire import ANTHROPIC, event
from stepline.api.pipeline.agents import AgentPlan, plan, reads_template_kwarg
from stepline.api.pipeline.errors import APIError
from stepline.api.pipeline.model_output import OutputDelta, ToolCall, split_output
from stepline.api.pipeline.serving import (
    Call,
    Piece,
    RequestContext,
    Serving,
    Started,
    client_of,
)

if TYPE_CHECKING:
    from stepline.actors.request import RequestOutput

_STOP_REASONS = {"length": "max_tokens"}


class AnthropicDoor:
    def __init__(self, serving: Serving):
        self.serving = serving

    def _plan(
        self, ctx: RequestContext[schema.MessagesRequest | schema.CountTokensRequest]
    ) -> AgentPlan:
        req = ctx.body
        choice, parallel = schema.tool_choice(req)
        kwargs = schema.template_kwargs(req)
        tokenizer = ctx.engine.tokenizer
        if not reads_template_kwarg(tokenizer, "enable_thinking"):
            kwargs.pop("enable_thinking", None)  # a model that does not think: nothing to turn on
        return plan(
            tokenizer,
            tools=schema.tool_specs(req),
            tool_choice=choice,
            parallel_tool_calls=parallel,
            schema=req.answer_schema,
            template_kwargs={**ctx.model.default_template_kwargs, **kwargs},
            schema_param=req.schema_param,
        )

    async def count_tokens(self, ctx: RequestContext[schema.CountTokensRequest]) -> Response:
        agent = self._plan(ctx)
        messages = await self.serving.with_images(ctx, schema.engine_messages(ctx.body))
        prepared = await self.serving.prepare(
            ctx, messages=messages, template_kwargs=agent.template_kwargs
        )
        return JSONResponse({"input_tokens": len(prepared.ids)})

    async def messages(self, ctx: RequestContext[schema.MessagesRequest]) -> Response:
        serving, request, rid, req = self.serving, ctx.request, ctx.rid, ctx.body
        started = await serving.start(
            ctx,
            Call(
                rid,
                req,
                self._plan(ctx),
                "messages",
                messages=schema.engine_messages(req),
                max_tokens=req.max_tokens,
                # Thinking splits out when the request turns it on, or the server's parser is.
                reasoning=ctx.model.reasoning or (req.thinking is not None and req.thinking.on),
                think_budget=req.think_budget,
                headers={"request-id": rid},
                client=client_of(request.headers, req.user_id),
                calls_as_input=True,
            ),
        )
        if req.stream:
            renderer = MessageRenderer(self, req, started)
            record = None
            if serving.asks_resumable(request, False):
                record = serving.keep(request, started, ANTHROPIC, resumable=True)
            return serving.stream(started, renderer, ANTHROPIC, record=record)
        outs = await serving.collect(request, started)
        split = split_output("".join(o.text for o in outs), started.fmt, started.tools)
        stop_reason, stop_sequence = self.stop_reason(ctx, outs, split.tool_calls)
        body = sdk.Message(
            id=rid,
            type="message",
            role="assistant",
            model=ctx.response_model,
            content=_blocks(split),
            stop_reason=stop_reason,  # type: ignore[arg-type]
            stop_sequence=stop_sequence,
            usage=_usage(outs[-1]),
        )
        return Response(_json(body), media_type="application/json", headers=started.headers)

    def stop_reason(
        self, ctx: RequestContext[Any], outs: list[RequestOutput], calls: list[ToolCall]
    ) -> tuple[str, str | None]:
        """Anthropic's stop_reason, and the stop sequence that ended the text, if one did."""
        req: schema.MessagesRequest = ctx.body
        reason = outs[-1].finish_reason or "stop"
        if reason != "stop":
            return _STOP_REASONS.get(reason, reason), None
        if calls:
            return "tool_use", None
        tokenizer = ctx.engine.tokenizer
        ids = [t for o in outs for t in o.token_ids]
        eos = set(tokenizer.eos_token_ids or ())
        if ids and ids[-1] in eos or not req.stop_sequences:
            return "end_turn", None
        # The text stops just before the stop string: the full decode shows which one it was.
        text = "".join(o.text for o in outs)
        rest = tokenizer.decode(ids)[len(text) :]
        found = [s for s in req.stop_sequences if s and rest.startswith(s)]
        return ("stop_sequence", max(found, key=len)) if found else ("end_turn", None)


def _usage(out: RequestOutput, *, output: bool = True) -> sdk.Usage:
    return sdk.Usage(
        input_tokens=out.num_prompt_tokens - out.num_cached_tokens,
        output_tokens=out.num_output_tokens if output else 0,
        cache_creation_input_tokens=0,
        cache_read_input_tokens=out.num_cached_tokens,
    )


def _json(body: BaseModel) -> bytes:
    """An SDK model as the API writes it: the fields we set (a null we set stays a null)."""
    return body.model_dump_json(exclude_unset=True).encode()


def _event(body: sdk.RawMessageStreamEvent) -> bytes:
    """One Anthropic server-sent event: `event: <type>` and its JSON."""
    return b"event: " + body.type.encode() + b"\ndata: " + _json(body) + b"\n\n"


PING = event("ping", {"type": "ping"})


def _blocks(split: OutputDelta) -> list[sdk.ContentBlock]:
    blocks: list[sdk.ContentBlock] = []
    if split.reasoning:
        blocks.append(sdk.ThinkingBlock(type="thinking", thinking=split.reasoning, signature=""))
    if split.content or not (split.tool_calls or split.reasoning):
        blocks.append(sdk.TextBlock(type="text", text=split.content))
    for call in split.tool_calls:
        blocks.append(
            sdk.ToolUseBlock(
                type="tool_use", id=_tool_id(call.id), name=call.name, input=call.input
            )
        )
    return blocks


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class MessageRenderer:
    """Renders one request's pieces as a streamed message: message_start (with a ping) at the
    first piece, blocks that open as their kind of output starts and close when another kind
    starts or the message ends, then message_delta (stop reason, usage) and message_stop."""

    def __init__(self, door: AnthropicDoor, req: schema.MessagesRequest, started: Started):
        self.door, self.req, self.started = door, req, started
        self.splitter = started.splitter()
        self.index = -1
        self.open: str | None = None  # kind of the open block: "text", "thinking", "tool_use"
        self.calls: list[ToolCall] = []
        self.outs: list[RequestOutput] = []
        self.began = False  # message_start sent (progress pieces come before any output)

    def frames(self, piece: Piece) -> bytes:
        out = piece.out
        frames: list[bytes] = []
        if not self.began:
            self.began = True
            frames.append(self._message_start(out))
            frames.append(PING)
        if piece.is_progress:
            return b"".join(frames) or PING
        self.outs.append(out)
        frames.extend(self._pieces(piece.delta))
        if out.finish_reason is not None:
            frames.extend(self._close())
            reason, sequence = self.door.stop_reason(self.started.ctx, self.outs, self.calls)
            usage = _usage(out)  # streamed usage carries input and cache counts too
            delta = sdk.RawMessageDeltaEvent(
                type="message_delta",
                delta={"stop_reason": reason, "stop_sequence": sequence},  # type: ignore[arg-type]
                usage=sdk.MessageDeltaUsage(**usage.model_dump(exclude_unset=True)),
            )
            frames.append(_event(delta))
            frames.append(_event(sdk.RawMessageStopEvent(type="message_stop")))
        return b"".join(frames)

    def failed(self, err: APIError) -> bytes:
        return ANTHROPIC.frames(err)

    cancelled = failed

    def _message_start(self, out: RequestOutput) -> bytes:
        message = sdk.Message(
            id=self.started.rid,
            type="message",
            role="assistant",
            model=self.started.ctx.response_model,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=_usage(out, output=False),
        )
        return _event(sdk.RawMessageStartEvent(type="message_start", message=message))

    def _open(self, block: sdk.ContentBlock) -> list[bytes]:
        frames = self._close()
        self.index += 1
        self.open = block.type
        start = sdk.RawContentBlockStartEvent(
            type="content_block_start", index=self.index, content_block=block
        )
        frames.append(_event(start))
        return frames

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event(sdk.RawContentBlockStopEvent(type="content_block_stop", index=self.index))]

    def _delta(self, delta: sdk.RawContentBlockDelta) -> bytes:
        event = sdk.RawContentBlockDeltaEvent(
            type="content_block_delta", index=self.index, delta=delta
        )
        return _event(event)

    def _pieces(self, piece: OutputDelta) -> list[bytes]:
        frames: list[bytes] = []
        if piece.reasoning:
            if self.open != "thinking":
                frames += self._open(sdk.ThinkingBlock(type="thinking", thinking="", signature=""))
            frames.append(
                self._delta(sdk.ThinkingDelta(type="thinking_delta", thinking=piece.reasoning))
            )
        if piece.content:
            if self.open != "text":
                frames += self._open(sdk.TextBlock(type="text", text=""))
            frames.append(self._delta(sdk.TextDelta(type="text_delta", text=piece.content)))
        for d in piece.tool_call_deltas:
            if d.id is not None:
                block = sdk.ToolUseBlock(
                    type="tool_use", id=_tool_id(d.id), name=d.name or "", input={}
                )
                frames += self._open(block)
            if d.arguments:
                delta = sdk.InputJSONDelta(type="input_json_delta", partial_json=d.arguments)
                frames.append(self._delta(delta))
            if d.done:
                frames += self._close()
        self.calls.extend(piece.tool_calls)
        return frames


def router(serving: Serving) -> APIRouter:
    """The Anthropic routes (the app's key check covers them: `x-api-key` or a Bearer token)."""
    door = AnthropicDoor(serving)
    routes = APIRouter()

    @routes.post("/v1/messages")
    async def messages(request: Request) -> Response:
        rid = f"msg_{uuid.uuid4().hex}"
        return await serving.handle(
            request, rid, door.messages, ANTHROPIC, body=schema.MessagesRequest
        )

    @routes.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        rid = f"count_{uuid.uuid4().hex}"
        return await serving.handle(
            request,
            rid,
            door.count_tokens,
            ANTHROPIC,
            body=schema.CountTokensRequest,
            generates=False,
        )

    return routes
