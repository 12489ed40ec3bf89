"""The OpenAI endpoints' handlers: /v1/chat/completions, /v1/completions, /v1/models.

Every request gets an id (`chatcmpl-<hex>` / `cmpl-<hex>`) that is its id in the engine's
event log, returned as the body's `id` and the `x-request-id` header. A client that
disconnects cancels its request (its cache is freed within one step).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

from stepline.api.openai import agents as openai_agents
from stepline.api.openai.schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ModelCard,
    ModelList,
    TopLogprob,
    Usage,
    now,
)
from stepline.api.pipeline.model_output import split_output
from stepline.api.pipeline.serving import Call, Serving, Started, json_response
from stepline.api.pipeline.sse import DONE, PING, Emit, TextFrames, sse

if TYPE_CHECKING:
    from stepline.engine.work import TokenLogprob

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIServing(Serving):
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def _chat_logprobs(self, lps: Sequence[TokenLogprob]) -> list[ChatTokenLogprob]:
        out = []
        for lp in lps:
            token = self.token_text(lp.token_id)
            top = [
                TopLogprob(token=(t := self.token_text(i)), logprob=v, bytes=list(t.encode()))
                for i, v in lp.top
            ]
            out.append(
                ChatTokenLogprob(
                    token=token, logprob=lp.logprob, bytes=list(token.encode()), top_logprobs=top
                )
            )
        return out

    def _completion_logprobs(
        self, lps: Sequence[TokenLogprob], text_offset: int
    ) -> CompletionLogprobs:
        tokens = [self.token_text(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(text_offset)
            text_offset += len(t)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[lp.logprob for lp in lps],
            top_logprobs=[{self.token_text(i): v for i, v in lp.top} for lp in lps],
            text_offset=offsets,
        )

    # -- /v1/chat/completions --

    async def chat(self, request: Request) -> Response:
        return await self.handle(request, f"chatcmpl-{uuid.uuid4().hex}", self._chat)

    async def _chat(self, request: Request, rid: str) -> Response:
        req = await self.parse(request, ChatCompletionRequest)
        num_logprobs = req.num_logprobs
        agent = openai_agents.chat_plan(req, self.engine.tokenizer, self.default_template_kwargs)
        # Chat boundaries (end of the system prompt, of earlier turns) feed the prefix cache.
        started = await self.start(
            Call(
                rid,
                req,
                agent,
                "messages",
                messages=req.engine_messages(),
                max_tokens=req.requested_max_tokens,
                max_tokens_param="max_completion_tokens"
                if req.max_completion_tokens
                else "max_tokens",
                logprobs=num_logprobs,
                reasoning=self.reasoning,
            )
        )
        created = now()
        if req.stream:
            return self.stream_response(
                started,
                lambda emit: self._chat_stream(emit, started, req, created),
                resumable_from=self.asks_resumable(request, req.resumable),
            )
        outs = await self.collect(request, started.stream)
        last = outs[-1]
        split = split_output("".join(o.text for o in outs), started.fmt, started.tools)
        logprobs = None
        if num_logprobs is not None:
            logprobs = ChatLogprobs(
                content=self._chat_logprobs([lp for o in outs for lp in o.logprobs])
            )
        body = ChatCompletion(
            id=rid,
            created=created,
            model=self.response_model(req.model),
            choices=[
                ChatChoice(
                    message=openai_agents.message(split, parallel=req.parallel_tool_calls),
                    logprobs=logprobs,
                    finish_reason=openai_agents.finish_reason(
                        last.finish_reason, len(split.tool_calls)
                    ),
                )
            ],
            usage=Usage.of(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens),
        )
        return json_response(body, headers=started.headers)

    async def _chat_stream(
        self, emit: Emit, started: Started, req: ChatCompletionRequest, created: int
    ) -> None:
        rid = started.rid
        model = self.response_model(req.model)
        exclude = None if req.include_usage else {"usage"}
        want_logprobs = req.logprobs

        def chunk(delta: ChatDelta, finish: str | None = None, lps=()) -> bytes:
            logprobs = ChatLogprobs(content=self._chat_logprobs(lps)) if want_logprobs else None
            choice = ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish)
            body = ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])
            return sse(body, exclude=exclude)

        text_frame = TextFrames(
            ChatCompletionChunk(
                id=rid,
                created=created,
                model=model,
                choices=[ChatChunkChoice(delta=ChatDelta(content=TextFrames.SENTINEL))],
            ),
            exclude=exclude,
        )
        splitter = started.splitter()
        frames = [chunk(ChatDelta(role="assistant", content=""))]  # sent with the first output
        async for piece in self.pieces(started, splitter):
            out, delta = piece.out, piece.delta
            if piece.is_progress:
                await emit(PING)  # a long prompt is prefilling: keep proxies from timing out
                continue
            if want_logprobs and out.logprobs:
                frames.append(chunk(ChatDelta(content=delta.content), lps=out.logprobs))
                delta.content = ""
            if delta.content and not delta.reasoning and not delta.tool_call_deltas:
                frames.append(text_frame(delta.content))  # the common case, pre-encoded
            else:
                pieces = openai_agents.deltas(delta, parallel=req.parallel_tool_calls)
                frames.extend(chunk(d) for d in pieces)
            if out.finish_reason is not None:
                reason = openai_agents.finish_reason(out.finish_reason, splitter.num_tool_calls)
                frames.append(chunk(ChatDelta(), finish=reason))
                if req.include_usage:
                    usage = Usage.of(
                        out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens
                    )
                    body = ChatCompletionChunk(
                        id=rid, created=created, model=model, choices=[], usage=usage
                    )
                    frames.append(sse(body))
                frames.append(DONE)
            if frames:
                await emit(b"".join(frames))
                frames = []

    # -- /v1/completions --

    async def completions(self, request: Request) -> Response:
        return await self.handle(request, f"cmpl-{uuid.uuid4().hex}", self._completions)

    async def _completions(self, request: Request, rid: str) -> Response:
        req = await self.parse(request, CompletionRequest)
        agent = openai_agents.completion_plan(req, self.engine.tokenizer)
        started = await self.start(
            Call(
                rid,
                req,
                agent,
                "prompt",
                prompt=req.engine_prompt(),
                max_tokens=req.max_tokens,
                default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS,
                logprobs=req.logprobs,
            )
        )
        created = now()
        if req.stream:
            return self.stream_response(
                started,
                lambda emit: self._completion_stream(emit, started, req, created),
                resumable_from=self.asks_resumable(request, req.resumable),
            )
        outs = await self.collect(request, started.stream)
        last = outs[-1]
        logprobs = None
        if req.logprobs is not None:
            logprobs = self._completion_logprobs([lp for o in outs for lp in o.logprobs], 0)
        body = Completion(
            id=rid,
            created=created,
            model=self.response_model(req.model),
            choices=[
                CompletionChoice(
                    text="".join(o.text for o in outs),
                    logprobs=logprobs,
                    finish_reason=last.finish_reason,
                )
            ],
            usage=Usage.of(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens),
        )
        return json_response(body, headers=started.headers)

    async def _completion_stream(
        self, emit: Emit, started: Started, req: CompletionRequest, created: int
    ) -> None:
        rid = started.rid
        model = self.response_model(req.model)
        exclude = None if req.include_usage else {"usage"}
        want_logprobs = req.logprobs is not None
        offset = 0

        def chunk(text: str, finish: str | None = None, lps=()) -> bytes:
            logprobs = self._completion_logprobs(lps, offset) if want_logprobs else None
            choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish)
            return sse(
                Completion(id=rid, created=created, model=model, choices=[choice]),
                exclude=exclude,
            )

        text_frame = TextFrames(
            Completion(
                id=rid,
                created=created,
                model=model,
                choices=[CompletionChoice(text=TextFrames.SENTINEL)],
            ),
            exclude=exclude,
        )
        async for piece in self.pieces(started, started.splitter()):
            out = piece.out
            if piece.is_progress:
                await emit(PING)
                continue
            frames = []  # this output's frames, sent in one write
            if want_logprobs and out.logprobs:
                frames.append(chunk(out.text, lps=out.logprobs))
            elif out.text:
                frames.append(text_frame(out.text))
            offset += len(out.text)
            if out.finish_reason is not None:
                frames.append(chunk("", finish=out.finish_reason))
                if req.include_usage:
                    usage = Usage.of(
                        out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens
                    )
                    body = Completion(id=rid, created=created, model=model, choices=[], usage=usage)
                    frames.append(sse(body))
                frames.append(DONE)
            if frames:
                await emit(b"".join(frames))

    # -- the rest --

    def models(self) -> ModelList:
        """The served model under its first name (the others are accepted as `model` too)."""
        card = ModelCard(
            id=self.model_name, created=self.created, max_model_len=self.engine.max_context
        )
        return ModelList(data=[card])
