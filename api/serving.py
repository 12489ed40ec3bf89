"""What every front door's handlers share: reading and validating a body, encoding a prompt,
submitting it to the engine, collecting or streaming its outputs, and turning failures into
`APIError`s that carry the request id. `OpenAIServing` (and any other API) subclasses it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import structlog
from fastapi import Request
from fastapi.responses import Response
from jinja2 import TemplateError
from pydantic import BaseModel, ValidationError

from stepline.actors.step_loop import EngineDeadError
from stepline.api.engine import SamplingParams
from stepline.api.errors import APIError, context_error, validation_error
from stepline.api.openai_schema import RequestError, now
from stepline.api.sse import DONE, Emit, EventStreamResponse, error_frame
from stepline.engine.policy import ContextLengthExceededError

if TYPE_CHECKING:
    from stepline.actors.request import RequestOutput
    from stepline.api.engine import Engine, RequestStream

log = structlog.get_logger(__name__)


class ServedRequest(Protocol):
    """What `Serving.parse` needs of a request model."""

    model: str | None

    def check_supported(self) -> None: ...


_R = TypeVar("_R", bound=ServedRequest)


def json_response(body: BaseModel, status_code: int = 200, headers: dict | None = None) -> Response:
    # pydantic's encoder, not json.dumps: a -inf logprob becomes null instead of an error.
    return Response(
        body.model_dump_json(),
        status_code=status_code,
        headers=headers,
        media_type="application/json",
    )


class Serving:
    """Engine plumbing for HTTP handlers: a front door subclasses it and adds its handlers."""

    def __init__(self, engine: Engine, *, max_body_bytes: int, heartbeat_s: float):
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.heartbeat_s = heartbeat_s
        self.created = now()
        self._token_text: dict[int, str] = {}

    # -- request side --

    async def read_body(self, request: Request) -> bytes:
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

    async def parse(self, request: Request, cls: type[_R]) -> _R:
        body = await self.read_body(request)
        try:
            req = cls.model_validate_json(body)  # type: ignore[attr-defined]
        except ValidationError as exc:
            raise validation_error(exc) from None
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

    def max_tokens(
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
            raise context_error(ContextLengthExceededError(num_prompt, max_context), prompt_param)
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

    def sampling(self, req: Any, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """`req`'s sampling fields (those of `_SamplingFields`) as engine parameters."""
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
            raise validation_error(exc) from None

    async def submit(
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
            raise context_error(exc, prompt_param) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unhealthy") from None
        except ValueError as exc:  # AdmissionError (empty prompt, KV too small), bad token ids
            raise APIError(400, str(exc), param=prompt_param) from None
        except RuntimeError as exc:  # the engine is closed: the server is shutting down
            raise APIError(503, str(exc), code="shutting_down") from None

    def encode(self, *, prompt: str | list[int] | None = None, messages=None) -> list[int]:
        param = "prompt" if messages is None else "messages"
        try:
            return self.engine.encode(prompt, messages)
        except (ValueError, TemplateError) as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None

    # -- response side --

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.engine.tokenizer.decode([token_id])
        return text

    def failure(self, out: RequestOutput) -> APIError:
        if out.finish_reason == "cancelled":
            return APIError(
                503, "the request was cancelled: the server is shutting down", code="shutting_down"
            )
        if not self.engine.healthy:
            return APIError(503, out.error or "the engine failed", code="engine_unhealthy")
        return APIError(500, out.error or "the request failed", code="engine_error")

    async def collect(self, request: Request, stream: RequestStream) -> list[RequestOutput]:
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
            raise self.failure(outs[-1])
        return outs

    def stream_response(
        self, rid: str, stream: RequestStream, produce: Callable[[Emit], Awaitable[None]]
    ) -> EventStreamResponse:
        async def guarded(emit: Emit) -> None:
            try:
                await produce(emit)
            except Exception as exc:  # a bug here must still end the stream the OpenAI way
                log.exception("stream_failed", request_id=rid)
                await emit(error_frame(f"the server failed: {exc!r}", code="server_error"))
                await emit(DONE)

        return EventStreamResponse(
            guarded,
            headers={"x-request-id": rid},
            heartbeat_s=self.heartbeat_s,
            on_close=stream.aclose,
        )

    async def stream_error(self, emit: Emit, out: RequestOutput | None) -> None:
        if out is None:
            await emit(
                error_frame("the request ended without a finish reason", code="engine_error")
            )
        else:
            err = self.failure(out)
            await emit(error_frame(err.detail.message, code=err.detail.code))
        await emit(DONE)

    async def handle(self, request: Request, rid: str, handler) -> Response:
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
