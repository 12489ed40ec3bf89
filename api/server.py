"""The OpenAI-compatible HTTP server: `stepline serve`.

    POST /v1/chat/completions, POST /v1/completions   (streaming with server-sent events, or not)
    GET  /v1/models, GET /health, GET /metrics

Every request gets an id (`chatcmpl-<hex>` / `cmpl-<hex>`) that is its id in the engine's
event log, returned as the body's `id` and the `x-request-id` header. Errors are OpenAI-style
`{"error": {"message", "type", "param", "code"}}` bodies. A client that disconnects cancels
its request (its cache is freed within one step).

Streams are written by hand (`EventStreamResponse`), not with sse-starlette: the frames must
be byte-exact (`data: {json}\\n\\n`, `: ping\\n\\n` comments, `data: [DONE]\\n\\n`), pings must
also go out for each prefill chunk of a long prompt, and a disconnect must cancel the request
even mid-prefill, when nothing is being sent; a small response class does exactly that.
"""

from __future__ import annotations

import argparse
import hmac
import importlib.util
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import structlog
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from stepline.actors.step_loop import EngineDeadError
from stepline.api.engine import SamplingParams
from stepline.api.openai_schema import (
    AssistantMessage,
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
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    RequestError,
    TopLogprob,
    Usage,
    now,
)
from stepline.engine.policy import ContextLengthExceededError

if TYPE_CHECKING:
    from stepline.actors.request import RequestOutput
    from stepline.api.engine import Engine, RequestStream
    from stepline.engine.work import TokenLogprob

log = structlog.get_logger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a 128k-token conversation is well under 1 MiB
DEFAULT_HEARTBEAT_S = 15.0  # under the 30-60 s idle timeouts of common proxies
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
PING = b": ping\n\n"
DONE = b"data: [DONE]\n\n"

Emit = Callable[[bytes], Awaitable[None]]
_R = TypeVar("_R", ChatCompletionRequest, CompletionRequest)


def sse(payload: BaseModel, *, exclude: set[str] | None = None) -> bytes:
    """One server-sent event carrying `payload` as compact JSON."""
    return b"data: " + payload.model_dump_json(exclude=exclude).encode() + b"\n\n"


class TextFrames:
    """Text-delta frames from a template: the hot path (one frame per token) without building
    and dumping pydantic models each time. `example` is a chunk whose only text is SENTINEL;
    a frame is byte-identical to `sse(example with that text)`, since the text is encoded
    by pydantic's own JSON encoder."""

    SENTINEL = "\x00stepline-text\x00"

    def __init__(self, example: BaseModel, *, exclude: set[str] | None = None):
        self._head, self._tail = sse(example, exclude=exclude).split(to_json(self.SENTINEL))

    def __call__(self, text: str) -> bytes:
        return self._head + to_json(text) + self._tail


# -- errors ---------------------------------------------------------------------------------


class APIError(Exception):
    """An error the server answers with an OpenAI-style body and `status_code`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.detail = ErrorDetail(
            message=message,
            type=type or ("invalid_request_error" if status_code < 500 else "server_error"),
            param=param,
            code=code,
        )
        self.request_id: str | None = None

    def response(self) -> JSONResponse:
        headers = {"x-request-id": self.request_id} if self.request_id else None
        body = ErrorResponse(error=self.detail).model_dump()
        return JSONResponse(body, status_code=self.status_code, headers=headers)


def _is_type_tag(part: str) -> bool:
    # pydantic puts union branches in `loc` ("str", "list[ContentPart]"); they are no param.
    return "[" in part or part in {"str", "int", "float", "bool", "none"} or "-" in part


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json")
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and _is_type_tag(p))]
    param = ".".join(loc) or None
    where = f"{param}: " if param else "the body: "
    return APIError(400, f"{where}{err['msg']}", param=param, code="invalid_value")


def _json(body: BaseModel, status_code: int = 200, headers: dict | None = None) -> Response:
    # pydantic's encoder, not json.dumps: a -inf logprob becomes null instead of an error.
    return Response(
        body.model_dump_json(),
        status_code=status_code,
        headers=headers,
        media_type="application/json",
    )


def _error_frame(message: str, *, code: str | None = None) -> bytes:
    detail = ErrorDetail(message=message, type="server_error", param=None, code=code)
    return sse(ErrorResponse(error=detail))


def _context_error(exc: ContextLengthExceededError, param: str) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {exc.max_context} tokens, but the prompt has "
        f"{exc.num_prompt_tokens} tokens: shorten the prompt (at most {exc.max_context - 1} "
        "tokens, so one token can be generated)",
        param=param,
        code="context_length_exceeded",
    )


# -- server-sent events ---------------------------------------------------------------------


class EventStreamResponse(Response):
    """A `text/event-stream` response whose body `produce(emit)` writes.

    While `produce` runs, a `: ping` comment goes out whenever nothing was sent for
    `heartbeat_s`, and a client disconnect cancels `produce`. `on_close` runs at the end
    whatever happened (it cancels the engine request if it is still running).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        produce: Callable[[Emit], Awaitable[None]],
        *,
        headers: dict[str, str],
        heartbeat_s: float,
        on_close: Callable[[], Awaitable[None]],
    ):
        # No Response.__init__: it would set `content-length: 0`.
        self.status_code = 200
        self.background = None
        self._produce = produce
        self._heartbeat_s = heartbeat_s
        self._on_close = on_close
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lock = anyio.Lock()  # one writer at a time: the producer or the heartbeat
        last_sent = time.monotonic()
        produced = False  # the producer is done: its last frame ([DONE]) is out
        disconnected = False
        ended = False  # the response's last message is sent

        async def emit(data: bytes) -> None:
            nonlocal last_sent
            async with lock:
                await send({"type": "http.response.body", "body": data, "more_body": True})
                last_sent = time.monotonic()

        async def heartbeat() -> None:
            nonlocal last_sent
            while True:
                await anyio.sleep(max(0.0, last_sent + self._heartbeat_s - time.monotonic()))
                async with lock:
                    if produced:  # never a ping after [DONE]
                        return
                    if time.monotonic() - last_sent >= self._heartbeat_s:
                        await send({"type": "http.response.body", "body": PING, "more_body": True})
                        last_sent = time.monotonic()

        async def watch_disconnect(scope: anyio.CancelScope) -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            scope.cancel()

        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_disconnect, tg.cancel_scope)
                tg.start_soon(heartbeat)
                await self._produce(emit)
                produced = True
                tg.cancel_scope.cancel()
            if not disconnected:
                ended = True  # set first: a cancel during this send must not send again
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we were writing
            pass
        except anyio.get_cancelled_exc_class():
            # Cancelled from outside (the server's graceful-shutdown timeout): the client
            # still gets an error frame and [DONE], as after any other failure.
            if not (ended or disconnected):
                body = b""
                if not produced:
                    message = "the server shut down before the request finished"
                    body = _error_frame(message, code="shutting_down") + DONE
                with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                    await send({"type": "http.response.body", "body": body, "more_body": False})
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


# -- the OpenAI endpoints -------------------------------------------------------------------


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: Engine, *, max_body_bytes: int, heartbeat_s: float):
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.heartbeat_s = heartbeat_s
        self.created = now()
        self._token_text: dict[int, str] = {}

    # -- request side --

    async def _read_body(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        too_large = APIError(
            413,
            f"the request body is larger than this server's limit of {limit} bytes",
            code="request_too_large",
        )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():  # also bounds bodies sent without a length
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def _parse(self, request: Request, cls: type[_R]) -> _R:
        body = await self._read_body(request)
        try:
            req = cls.model_validate_json(body)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        req.check_supported()
        if req.model is not None and req.model != self.engine.model_name:
            raise APIError(
                404,
                f"The model {req.model!r} does not exist: this server serves "
                f"{self.engine.model_name!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return req

    def _max_tokens(
        self,
        requested: int | None,
        num_prompt: int,
        *,
        default: int | None,
        prompt_param: str,
        param: str = "max_tokens",
    ) -> int:
        max_context = self.engine.max_context
        if num_prompt >= max_context:
            raise _context_error(ContextLengthExceededError(num_prompt, max_context), prompt_param)
        room = max_context - num_prompt
        if requested is None:
            return min(default or room, room)
        if requested > room:
            raise APIError(
                400,
                f"This model's maximum context length is {max_context} tokens, but "
                f"{num_prompt + requested} tokens were requested ({num_prompt} in the prompt, "
                f"{requested} in the completion): shorten the prompt or lower {param} to at "
                f"most {room}",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    def _sampling(
        self, req: ChatCompletionRequest | CompletionRequest, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        fields: dict[str, Any] = {
            "max_tokens": max_tokens,
            "stop": req.stop_strings,
            "ignore_eos": req.ignore_eos,
            "logprobs": logprobs,
        }
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(req, name)
            if value is not None:
                fields[name] = value
        if req.top_k is not None:
            fields["top_k"] = max(req.top_k, 0)
        if req.stop_token_ids:
            fields["stop_token_ids"] = tuple(req.stop_token_ids)
        try:
            return SamplingParams(**fields)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    async def _submit(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        prompt_param: str,
        checkpoints: Sequence[int] = (),
    ) -> RequestStream:
        try:
            return await self.engine.submit(
                prompt=ids, params=params, request_id=rid, checkpoints=checkpoints
            )
        except ContextLengthExceededError as exc:
            raise _context_error(exc, prompt_param) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unhealthy") from None
        except ValueError as exc:  # AdmissionError (empty prompt, KV too small), bad token ids
            raise APIError(400, str(exc), param=prompt_param) from None
        except RuntimeError as exc:  # the engine is closed: the server is shutting down
            raise APIError(503, str(exc), code="shutting_down") from None

    def _encode(self, *, prompt: str | list[int] | None = None, messages=None) -> list[int]:
        param = "prompt" if messages is None else "messages"
        try:
            return self.engine.encode(prompt, messages)
        except (ValueError, TemplateError) as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None

    # -- response side --

    def _token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.engine.tokenizer.decode([token_id])
        return text

    def _chat_logprobs(self, lps: Sequence[TokenLogprob]) -> list[ChatTokenLogprob]:
        out = []
        for lp in lps:
            token = self._token(lp.token_id)
            top = [
                TopLogprob(token=(t := self._token(i)), logprob=v, bytes=list(t.encode()))
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
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(text_offset)
            text_offset += len(t)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[lp.logprob for lp in lps],
            top_logprobs=[{self._token(i): v for i, v in lp.top} for lp in lps],
            text_offset=offsets,
        )

    def _failure(self, out: RequestOutput) -> APIError:
        if out.finish_reason == "cancelled":
            return APIError(
                503, "the request was cancelled: the server is shutting down", code="shutting_down"
            )
        if not self.engine.healthy:
            return APIError(503, out.error or "the engine failed", code="engine_unhealthy")
        return APIError(500, out.error or "the request failed", code="engine_error")

    async def _collect(self, request: Request, stream: RequestStream) -> list[RequestOutput]:
        """Every output of a non-streaming request; a client disconnect cancels it."""
        outs: list[RequestOutput] = []
        gone = False

        async def watch_disconnect(scope: anyio.CancelScope) -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            scope.cancel()

        async with stream, anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect, tg.cancel_scope)
            async for out in stream:
                if not out.is_progress:
                    outs.append(out)
            tg.cancel_scope.cancel()
        if gone or not outs or outs[-1].finish_reason is None:
            raise APIError(499, "the client closed the connection", code="client_closed")
        if outs[-1].finish_reason not in ("stop", "length"):
            raise self._failure(outs[-1])
        return outs

    def _stream_response(
        self, rid: str, stream: RequestStream, produce: Callable[[Emit], Awaitable[None]]
    ) -> EventStreamResponse:
        async def guarded(emit: Emit) -> None:
            try:
                await produce(emit)
            except Exception as exc:  # a bug here must still end the stream the OpenAI way
                log.exception("stream_failed", request_id=rid)
                await emit(_error_frame(f"the server failed: {exc!r}", code="server_error"))
                await emit(DONE)

        return EventStreamResponse(
            guarded,
            headers={"x-request-id": rid},
            heartbeat_s=self.heartbeat_s,
            on_close=stream.aclose,
        )

    async def _stream_error(self, emit: Emit, out: RequestOutput | None) -> None:
        if out is None:
            await emit(
                _error_frame("the request ended without a finish reason", code="engine_error")
            )
        else:
            err = self._failure(out)
            await emit(_error_frame(err.detail.message, code=err.detail.code))
        await emit(DONE)

    # -- /v1/chat/completions --

    async def chat(self, request: Request) -> Response:
        return await self._handle(request, f"chatcmpl-{uuid.uuid4().hex}", self._chat)

    async def _handle(self, request: Request, rid: str, handler) -> Response:
        """Run `handler`; any error response it raises carries the request id."""
        try:
            return await handler(request, rid)
        except RequestError as exc:
            err = APIError(400, exc.message, param=exc.param, code=exc.code)
            err.request_id = rid
            raise err from None
        except APIError as exc:
            exc.request_id = rid
            raise

    async def _chat(self, request: Request, rid: str) -> Response:
        req = await self._parse(request, ChatCompletionRequest)
        num_logprobs = req.num_logprobs
        messages = req.engine_messages()
        ids = self._encode(messages=messages)
        max_tokens = self._max_tokens(
            req.requested_max_tokens,
            len(ids),
            default=None,
            prompt_param="messages",
            param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
        )
        params = self._sampling(req, max_tokens, num_logprobs)
        # Chat boundaries (end of the system prompt, of earlier turns) feed the prefix cache.
        checkpoints = self.engine.chat_checkpoints(messages, ids)
        stream = await self._submit(rid, ids, params, "messages", checkpoints)
        created = now()
        model = self.engine.model_name
        if req.stream:
            return self._stream_response(
                rid, stream, lambda emit: self._chat_stream(emit, stream, req, rid, created)
            )
        outs = await self._collect(request, stream)
        last = outs[-1]
        logprobs = None
        if num_logprobs is not None:
            logprobs = ChatLogprobs(
                content=self._chat_logprobs([lp for o in outs for lp in o.logprobs])
            )
        body = ChatCompletion(
            id=rid,
            created=created,
            model=model,
            choices=[
                ChatChoice(
                    message=AssistantMessage(content="".join(o.text for o in outs)),
                    logprobs=logprobs,
                    finish_reason=last.finish_reason,
                )
            ],
            usage=Usage.of(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens),
        )
        return _json(body, headers={"x-request-id": rid})

    async def _chat_stream(
        self, emit: Emit, stream: RequestStream, req: ChatCompletionRequest, rid: str, created: int
    ) -> None:
        model = self.engine.model_name
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
        started = False
        async for out in stream:
            if out.is_progress:
                await emit(PING)  # a long prompt is prefilling: keep proxies from timing out
                continue
            if out.finish_reason not in (None, "stop", "length"):
                await self._stream_error(emit, out)
                return
            frames = []  # this output's frames, sent in one write
            if not started:
                started = True
                frames.append(chunk(ChatDelta(role="assistant", content="")))
            if want_logprobs and out.logprobs:
                frames.append(chunk(ChatDelta(content=out.text), lps=out.logprobs))
            elif out.text:
                frames.append(text_frame(out.text))
            if out.finish_reason is not None:
                frames.append(chunk(ChatDelta(), finish=out.finish_reason))
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
            if out.finish_reason is not None:
                return
        await self._stream_error(emit, None)

    # -- /v1/completions --

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, f"cmpl-{uuid.uuid4().hex}", self._completions)

    async def _completions(self, request: Request, rid: str) -> Response:
        req = await self._parse(request, CompletionRequest)
        ids = self._encode(prompt=req.engine_prompt())
        max_tokens = self._max_tokens(
            req.max_tokens, len(ids), default=DEFAULT_COMPLETION_MAX_TOKENS, prompt_param="prompt"
        )
        params = self._sampling(req, max_tokens, req.logprobs)
        stream = await self._submit(rid, ids, params, "prompt")
        created = now()
        if req.stream:
            return self._stream_response(
                rid, stream, lambda emit: self._completion_stream(emit, stream, req, rid, created)
            )
        outs = await self._collect(request, stream)
        last = outs[-1]
        logprobs = None
        if req.logprobs is not None:
            logprobs = self._completion_logprobs([lp for o in outs for lp in o.logprobs], 0)
        body = Completion(
            id=rid,
            created=created,
            model=self.engine.model_name,
            choices=[
                CompletionChoice(
                    text="".join(o.text for o in outs),
                    logprobs=logprobs,
                    finish_reason=last.finish_reason,
                )
            ],
            usage=Usage.of(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens),
        )
        return _json(body, headers={"x-request-id": rid})

    async def _completion_stream(
        self, emit: Emit, stream: RequestStream, req: CompletionRequest, rid: str, created: int
    ) -> None:
        model = self.engine.model_name
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
        async for out in stream:
            if out.is_progress:
                await emit(PING)
                continue
            if out.finish_reason not in (None, "stop", "length"):
                await self._stream_error(emit, out)
                return
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
            if out.finish_reason is not None:
                return
        await self._stream_error(emit, None)

    # -- the rest --

    def models(self) -> ModelList:
        card = ModelCard(
            id=self.engine.model_name, created=self.created, max_model_len=self.engine.max_context
        )
        return ModelList(data=[card])


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
) -> FastAPI:
    """The HTTP app serving `engine`. With `api_key`, every /v1 route wants
    `Authorization: Bearer <api_key>` (401 otherwise); /health and /metrics stay open for
    probes and scrapers."""
    serving = OpenAIServing(engine, max_body_bytes=max_body_bytes, heartbeat_s=heartbeat_s)
    app = FastAPI(title="stepline", summary="OpenAI-compatible LLM server", version="0.1.0")
    app.state.serving = serving

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError(
                401,
                "missing or incorrect API key: send the key the server was started with as "
                "`Authorization: Bearer <key>`",
                code="invalid_api_key",
            )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), code=None).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, str(exc), code="invalid_value").response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_key(request)
        return await serving.chat(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_key(request)
        return await serving.completions(request)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_key(request)
        return JSONResponse(serving.models().model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        check_key(request)
        card = serving.models().data[0]
        if model_id != card.id:
            raise APIError(
                404, f"The model {model_id!r} does not exist", param="model", code="model_not_found"
            )
        return JSONResponse(card.model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.healthy:
            return JSONResponse({"status": "ok", "model": engine.model_name})
        reason = engine.unhealthy_reason or "the engine is shut down"
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# -- running it -----------------------------------------------------------------------------


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one. Binding before the
    model loads turns "port in use" into an immediate, clear error (uvicorn would call
    sys.exit) and lets early clients queue instead of being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn that tells when it accepts connections. With `own_signals`, SIGINT and SIGTERM
    start a graceful shutdown (a second SIGINT forces it) and are not re-raised afterwards, as
    uvicorn would: a re-raised SIGTERM kills the process before the engine closes and flushes
    its event log. Without, signals stay the host's (tests)."""

    def __init__(self, config: uvicorn.Config, *, own_signals: bool):
        super().__init__(config)
        self.own_signals = own_signals
        self.ready = anyio.Event()

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if not self.own_signals or threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()


def _url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"  # what a local client dials
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@asynccontextmanager
async def serve_in_process(
    app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, graceful_shutdown_s: float = 2.0
) -> AsyncIterator[str]:
    """Run `app` under uvicorn in this event loop and yield its base URL (no `/v1`); stops
    the server on exit (open streams get `graceful_shutdown_s`, then are cancelled). For tests
    and benchmarks."""
    sock = bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=graceful_shutdown_s,
    )
    server = _Server(config, own_signals=False)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: server.serve(sockets=[sock]))
        try:
            with anyio.fail_after(30):
                await server.ready.wait()
            yield _url(host, bound_port)
        finally:
            server.should_exit = True


def _curl_line(url: str, model: str, api_key: str | None) -> str:
    auth = ' -H "Authorization: Bearer $STEPLINE_API_KEY"' if api_key else ""
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        '"max_tokens": 64, "stream": true}'
    )
    return (
        f"curl -N {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
    )


async def _serve(args: argparse.Namespace, sock: socket.socket, engine_kwargs: dict) -> None:
    from stepline.api.engine import Engine

    async with Engine.open(args.model, **engine_kwargs) as engine:
        app = create_app(engine, api_key=args.api_key, max_body_bytes=args.max_body_bytes)
        config = uvicorn.Config(app, lifespan="off", log_level="info", timeout_graceful_shutdown=5)
        server = _Server(config, own_signals=True)
        url = _url(args.host, sock.getsockname()[1])
        print(f"stepline: serving {engine.model_name} at {url}/v1 (OpenAI-compatible)")
        if args.api_key and os.environ.get("STEPLINE_API_KEY") != args.api_key:
            print("stepline: set STEPLINE_API_KEY to the key for the curl line below")
        print(f"try:\n  {_curl_line(url, engine.model_name, args.api_key)}", flush=True)
        await server.serve(sockets=[sock])


def run_serve(args: argparse.Namespace) -> int:
    """`stepline serve`: load the model, serve it until Ctrl-C. Returns the exit status."""
    engine_kwargs = args.engine_kwargs(args)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(
            f"stepline: error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc} "
            "(choose another --port, or stop what is using it)",
            file=sys.stderr,
        )
        return 1
    # uvloop (and httptools, which uvicorn picks by itself) cut the HTTP layer's CPU per
    # token when installed (`uvicorn[standard]`); plain asyncio and h11 work the same.
    use_uvloop = importlib.util.find_spec("uvloop") is not None
    try:
        anyio.run(_serve, args, sock, engine_kwargs, backend_options={"use_uvloop": use_uvloop})
    finally:
        sock.close()
    return 0


def add_serve_parser(
    subparsers: Any,
    add_engine_args: Callable[[argparse.ArgumentParser], None],
    engine_kwargs: Callable[[argparse.Namespace], dict],
) -> argparse.ArgumentParser:
    """Add `stepline serve` to the CLI's subparsers."""
    p = subparsers.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health, /metrics).",
    )
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000; 0 = any)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("STEPLINE_API_KEY") or None,
        help="require `Authorization: Bearer KEY` on /v1 routes (default: $STEPLINE_API_KEY; "
        "unset = no key)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body accepted, else 413 (default: {DEFAULT_MAX_BODY_BYTES})",
    )
    p.set_defaults(func=run_serve, engine_kwargs=engine_kwargs)
    return p
