"""The OpenAI door's handlers: /v1/chat/completions, /v1/completions, /v1/models,
/v1/embeddings and rerank (/v1/rerank, /rerank), over the pipeline every door shares
(`Serving`). Responses and stream chunks are the `openai`
package's own types, dumped with the fields set (`exclude_unset`): `null` where OpenAI sends
null, and a streaming `delta` that holds only the keys that changed.

Every request gets an id (`chatcmpl-<hex>` / `cmpl-<hex>`) that is its id in the engine's
event log, returned as the body's `id` and the `x-request-id` header. A client that
disconnects cancels its request (its cache is freed within one step).
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from openai.types import (
    Completion,
    CompletionChoice,
    CompletionUsage,
    CreateEmbeddingResponse,
    Embedding,
    Model,
)
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionTokenLogprob,
    chat_completion,
    chat_completion_chunk,
)
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs
from openai.types.completion_usage import PromptTokensDetails
from openai.types.create_embedding_response import Usage as EmbeddingUsage

from stepline.api.openai import agents
from stepline.api.openai.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
)
from stepline.api.pipeline import embed, rerank
from stepline.api.pipeline.errors import OPENAI, APIError, model_not_found
from stepline.api.pipeline.model_output import split_output
from stepline.api.pipeline.serving import (
    Call,
    Piece,
    RequestContext,
    Serving,
    Started,
    client_of,
    json_response,
)
from stepline.api.pipeline.writer import PING, TextFrames

if TYPE_CHECKING:
    from stepline.actors.request import RequestOutput
    from stepline.actors.scheduler.work import TokenLogprob

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DONE = b"data: [DONE]\n\n"


def usage(out: RequestOutput) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=out.num_output_tokens,
        total_tokens=out.num_prompt_tokens + out.num_output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens),
    )


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _json(body: Any) -> bytes:
    return b"data: " + body.model_dump_json(exclude_unset=True).encode() + b"\n\n"


class OpenAIDoor:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, serving: Serving):
        self.serving = serving
        self.created = int(time.time())

    def chat_logprobs(
        self, ctx: RequestContext[Any], lps: Sequence[TokenLogprob]
    ) -> list[ChatCompletionTokenLogprob]:
        token_text = ctx.model.token_text
        out = []
        for lp in lps:
            token = token_text(lp.token_id)
            top = [
                TopLogprob(token=(t := token_text(i)), logprob=v, bytes=list(t.encode()))
                for i, v in lp.top
            ]
            out.append(
                ChatCompletionTokenLogprob(
                    token=token, logprob=lp.logprob, bytes=list(token.encode()), top_logprobs=top
                )
            )
        return out

    def completion_logprobs(
        self, ctx: RequestContext[Any], lps: Sequence[TokenLogprob], text_offset: int
    ) -> Logprobs:
        token_text = ctx.model.token_text
        tokens = [token_text(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(text_offset)
            text_offset += len(t)
        return Logprobs(
            tokens=tokens,
            token_logprobs=[lp.logprob for lp in lps],
            top_logprobs=[{token_text(i): v for i, v in lp.top} for lp in lps],
            text_offset=offsets,
        )

    # -- /v1/chat/completions --

    async def chat(self, ctx: RequestContext[ChatCompletionRequest]) -> Response:
        serving, request, rid, req = self.serving, ctx.request, ctx.rid, ctx.body
        num_logprobs = req.num_logprobs
        model = ctx.model
        agent = agents.chat_plan(req, model.engine.tokenizer, model.default_template_kwargs)
        # Chat boundaries (end of the system prompt, of earlier turns) feed the prefix cache.
        started = await serving.start(
            ctx,
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
                reasoning=model.reasoning,
                client=client_of(request.headers, req.user),
            ),
        )
        created = int(time.time())
        if req.stream:
            renderer = ChatRenderer(self, started, req, created)
            return self._stream(request, started, renderer, req.resumable)
        outs = await serving.collect(request, started)
        last = outs[-1]
        split = split_output("".join(o.text for o in outs), started.fmt, started.tools)
        logprobs = None
        if num_logprobs is not None:
            lps = [lp for o in outs for lp in o.logprobs]
            logprobs = chat_completion.ChoiceLogprobs(content=self.chat_logprobs(ctx, lps))
        choice = chat_completion.Choice(
            index=0,
            message=agents.message(split, parallel=req.parallel_tool_calls),
            logprobs=logprobs,
            finish_reason=agents.finish_reason(last.finish_reason, len(split.tool_calls)),  # type: ignore[arg-type]
        )
        body = ChatCompletion(
            id=rid,
            object="chat.completion",
            created=created,
            model=ctx.response_model,
            choices=[choice],
            usage=usage(last),
        )
        return json_response(body, headers=started.headers, exclude_unset=True)

    def _stream(self, request: Request, started: Started, renderer, resumable: bool) -> Response:
        serving = self.serving
        record = None
        if serving.asks_resumable(request, resumable):
            record = serving.keep(request, started, OPENAI, resumable=True)
        return serving.stream(started, renderer, OPENAI, record=record)

    # -- /v1/completions --

    async def completions(self, ctx: RequestContext[CompletionRequest]) -> Response:
        serving, request, rid, req = self.serving, ctx.request, ctx.rid, ctx.body
        agent = agents.completion_plan(req, ctx.engine.tokenizer)
        started = await serving.start(
            ctx,
            Call(
                rid,
                req,
                agent,
                "prompt",
                prompt=req.engine_prompt(),
                max_tokens=req.max_tokens,
                default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS,
                logprobs=req.logprobs,
                client=client_of(request.headers, req.user),
            ),
        )
        created = int(time.time())
        if req.stream:
            renderer = CompletionRenderer(self, started, req, created)
            return self._stream(request, started, renderer, req.resumable)
        outs = await serving.collect(request, started)
        last = outs[-1]
        logprobs = None
        if req.logprobs is not None:
            logprobs = self.completion_logprobs(ctx, [lp for o in outs for lp in o.logprobs], 0)
        choice = CompletionChoice(
            index=0,
            text="".join(o.text for o in outs),
            logprobs=logprobs,
            finish_reason=last.finish_reason,  # type: ignore[arg-type]
        )
        body = Completion(
            id=rid,
            object="text_completion",
            created=created,
            model=ctx.response_model,
            choices=[choice],
            usage=usage(last),
        )
        return json_response(body, headers=started.headers, exclude_unset=True)

    # -- /v1/models --

    def model_card(self, name: str) -> Model:
        """`name`'s card: with its context (vLLM's `max_model_len`) and the defaults a request
        that sets none gets (`sampling_defaults`: api/defaults.py) once it is loaded, and in a
        server of several models whether it is (`loaded`, stepline's)."""
        extra: dict[str, Any] = {}
        served = self.serving.loaded(name)
        if served is not None:
            extra["max_model_len"] = served.engine.max_context
            extra["sampling_defaults"] = served.defaults.card()
            # what it does (stepline's): an embedding model embeds and generates nothing
            extra["capabilities"] = (
                ["chat", "completions"]
                if served.engine.embedding is None
                else ["rerank"]
                if embed.is_reranker(served.engine)
                else ["embeddings"]
            )
            if name in served.engine.adapters:  # a LoRA adapter: its base model (vLLM's)
                extra["parent"] = served.name
        if self.serving.models.on_demand:
            extra["loaded"] = served is not None
        return Model(id=name, object="model", created=self.created, owned_by="stepline", **extra)

    # -- /v1/embeddings --

    async def embeddings(self, ctx: RequestContext[EmbeddingRequest]) -> Response:
        req = ctx.body
        done = await embed.embed(
            self.serving,
            ctx,
            req.inputs(),
            dimensions=req.dimensions,
            client=client_of(ctx.request.headers, req.user),
        )
        data = [
            Embedding(embedding=v, index=i, object="embedding")
            if req.encoding_format == "float"
            # base64 of little-endian float32: a string where the SDK's type has a list
            else Embedding.model_construct(embedding=_base64(v), index=i, object="embedding")
            for i, v in enumerate(done.vectors)
        ]
        body = CreateEmbeddingResponse(
            data=data,
            model=ctx.response_model,
            object="list",
            usage=EmbeddingUsage(
                prompt_tokens=done.num_prompt_tokens, total_tokens=done.num_prompt_tokens
            ),
        )
        return json_response(body, headers={"x-request-id": ctx.rid}, warnings=False)

    # -- /v1/rerank, /rerank --

    async def rerank(self, ctx: RequestContext[RerankRequest]) -> Response:
        req = ctx.body
        texts = req.texts()
        done = await rerank.rerank(
            self.serving,
            ctx,
            req.query,
            texts,
            instruction=req.instruction,
            client=client_of(ctx.request.headers, req.user),
        )
        order = sorted(range(len(texts)), key=lambda i: -done.scores[i])[: req.top_n]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": done.scores[i]}
            if req.return_documents:
                result["document"] = {"text": texts[i]}
            results.append(result)
        body = {
            "id": ctx.rid,
            "model": ctx.response_model,
            "results": results,
            "usage": {"total_tokens": done.num_prompt_tokens},
        }
        return JSONResponse(body, headers={"x-request-id": ctx.rid})

    def models(self) -> dict[str, Any]:
        """Every served model under its first name, loaded or not (their other names are
        accepted as `model` too)."""
        cards = [self.model_card(name) for name in self.serving.models.listed]
        return {"object": "list", "data": [c.model_dump(exclude_unset=True) for c in cards]}


class _StreamRenderer:
    """What a streamed chat completion and a streamed completion share: every chunk is a
    `Body` of the request's id, model and time; the last ones are the finish reason's, usage
    (when asked) and `[DONE]`; a failure is OpenAI's error frame and `[DONE]`."""

    Body: type[ChatCompletionChunk] | type[Completion]
    OBJECT: str

    def __init__(
        self,
        door: OpenAIDoor,
        started: Started,
        req: ChatCompletionRequest | CompletionRequest,
        created: int,
    ):
        self.door, self.ctx = door, started.ctx
        self.splitter = started.splitter()
        self.rid, self.model, self.created = started.rid, started.ctx.response_model, created
        self.include_usage = req.include_usage

    def body(self, choice: Any) -> Any:
        """A chunk with one choice; `usage` null until the last when usage is asked for."""
        fields: dict[str, Any] = {"usage": None} if self.include_usage else {}
        return self.Body(
            id=self.rid,
            object=self.OBJECT,  # type: ignore[arg-type]
            created=self.created,
            model=self.model,
            choices=[choice],
            **fields,
        )

    def tail(self, out: RequestOutput) -> list[bytes]:
        """The frames after the finish reason's: usage (when asked for), `[DONE]`."""
        frames = []
        if self.include_usage:
            body = self.Body(
                id=self.rid,
                object=self.OBJECT,  # type: ignore[arg-type]
                created=self.created,
                model=self.model,
                choices=[],
                usage=usage(out),
            )
            frames.append(_json(body))
        frames.append(DONE)
        return frames

    def failed(self, err: APIError) -> bytes:
        return OPENAI.frames(err)

    cancelled = failed


class ChatRenderer(_StreamRenderer):
    """A streamed chat completion: the role's chunk with the first output, a chunk per piece
    (text pre-encoded, `TextFrames`), the finish reason's chunk, usage when asked, `[DONE]`."""

    Body = ChatCompletionChunk
    OBJECT = "chat.completion.chunk"

    def __init__(
        self,
        door: OpenAIDoor,
        started: Started,
        req: ChatCompletionRequest,
        created: int,
    ):
        super().__init__(door, started, req, created)
        self.req = req
        self.text_frame = TextFrames(
            self._chunk(chat_completion_chunk.ChoiceDelta(content=TextFrames.SENTINEL)),
            exclude_unset=True,
        )
        self.began = False

    def _chunk(
        self, delta: chat_completion_chunk.ChoiceDelta, finish: str | None = None, lps=()
    ) -> ChatCompletionChunk:
        logprobs = None
        if self.req.logprobs:
            logprobs = chat_completion_chunk.ChoiceLogprobs(
                content=self.door.chat_logprobs(self.ctx, lps)
            )
        choice = chat_completion_chunk.Choice(
            index=0,
            delta=delta,
            logprobs=logprobs,
            finish_reason=finish,  # type: ignore[arg-type]
        )
        return self.body(choice)

    def frame(self, delta: chat_completion_chunk.ChoiceDelta, **kw: Any) -> bytes:
        return _json(self._chunk(delta, **kw))

    def frames(self, piece: Piece) -> bytes:
        if piece.is_progress:
            return PING  # a long prompt is prefilling: keep proxies from timing out
        out, delta = piece.out, piece.delta
        frames = []
        if not self.began:  # the role, with the first output
            self.began = True
            first = chat_completion_chunk.ChoiceDelta(role="assistant", content="")
            frames.append(self.frame(first))
        if self.req.logprobs and out.logprobs:
            content = chat_completion_chunk.ChoiceDelta(content=delta.content)
            frames.append(self.frame(content, lps=out.logprobs))
            delta.content = ""
        if delta.content and not delta.reasoning and not delta.tool_call_deltas:
            frames.append(self.text_frame(delta.content))  # the common case, pre-encoded
        else:
            for d in agents.deltas(delta, parallel=self.req.parallel_tool_calls):
                frames.append(self.frame(d))
        if out.finish_reason is not None:
            reason = agents.finish_reason(out.finish_reason, self.splitter.num_tool_calls)
            frames.append(self.frame(chat_completion_chunk.ChoiceDelta(), finish=reason))
            frames += self.tail(out)
        return b"".join(frames)


class CompletionRenderer(_StreamRenderer):
    """A streamed completion: a chunk per output's text, the finish reason's chunk, usage
    when asked, `[DONE]`."""

    Body = Completion
    OBJECT = "text_completion"

    def __init__(self, door: OpenAIDoor, started: Started, req: CompletionRequest, created: int):
        super().__init__(door, started, req, created)
        self.req = req
        self.offset = 0  # characters sent so far (logprobs' text_offset)
        self.text_frame = TextFrames(self._body(TextFrames.SENTINEL), exclude_unset=True)

    def _body(self, text: str, finish: str | None = None, logprobs: Logprobs | None = None):
        # Unchecked: the SDK's type has no null finish reason, which every chunk but the
        # last has.
        choice = CompletionChoice.model_construct(
            index=0, text=text, logprobs=logprobs, finish_reason=finish
        )
        return self.body(choice)

    def frames(self, piece: Piece) -> bytes:
        if piece.is_progress:
            return PING
        out = piece.out
        frames = []
        if self.req.logprobs is not None and out.logprobs:
            lps = self.door.completion_logprobs(self.ctx, out.logprobs, self.offset)
            frames.append(_json(self._body(out.text, logprobs=lps)))
        elif out.text:
            frames.append(self.text_frame(out.text))
        self.offset += len(out.text)
        if out.finish_reason is not None:
            logprobs: Logprobs | None = None
            if self.req.logprobs is not None:
                logprobs = self.door.completion_logprobs(self.ctx, [], 0)
            frames.append(_json(self._body("", finish=out.finish_reason, logprobs=logprobs)))
            frames += self.tail(out)
        return b"".join(frames)


def router(serving: Serving) -> APIRouter:
    """The OpenAI routes (the app's key check covers them)."""
    door = OpenAIDoor(serving)
    routes = APIRouter()

    @routes.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return await serving.handle(request, rid, door.chat, OPENAI, body=ChatCompletionRequest)

    @routes.post("/v1/completions")
    async def completions(request: Request) -> Response:
        rid = f"cmpl-{uuid.uuid4().hex}"
        return await serving.handle(request, rid, door.completions, OPENAI, body=CompletionRequest)

    @routes.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        rid = f"embd-{uuid.uuid4().hex}"
        return await serving.handle(request, rid, door.embeddings, OPENAI, body=EmbeddingRequest)

    @routes.post("/v1/rerank")  # Jina's, vLLM's
    @routes.post("/v2/rerank")  # Cohere's
    @routes.post("/rerank")
    async def rerank_(request: Request) -> Response:
        rid = f"rerank-{uuid.uuid4().hex}"
        return await serving.handle(request, rid, door.rerank, OPENAI, body=RerankRequest)

    @routes.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(door.models())

    @routes.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id not in serving.served_model_names:  # its other names get the card too
            raise model_not_found(model_id)
        return JSONResponse(door.model_card(model_id).model_dump(exclude_unset=True))

    return routes
