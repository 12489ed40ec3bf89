"""The one pipeline under every front door (chat, completions, Messages, Responses): each door
translates its request into a `Call` and renders `Piece`s in its wire format; the rest is
here, once. `parse` reads and validates a body; `start` turns a Call into an admitted engine
request (the prompt's tokens off the event loop, the token limit, the think budget, the one
sampling-parameter builder, the submission); `pieces` is the one read loop (outputs split by
the one output splitter, failures raised); `collect` / `attached` the one disconnect watch of
non-streamed answers; `stream_response` the one SSE writer (numbered frames, pings, resume);
`handle` the one error wrapper, answering in the door's shape (`errors.Wire`) with the
request id. `OpenAIServing` (and every other door) subclasses it.

Clients get stable messages and codes plus the request id, never an exception's text; the
detail goes to the server log under the same id.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import structlog
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from stepline.actors.step_loop import EngineDeadError
from stepline.api.engine import SamplingParams
from stepline.api.json_limits import InputLimitError, parse_body
from stepline.api.openai.schema import RequestError, now
from stepline.api.pipeline.agents import AgentPlan
from stepline.api.pipeline.errors import APIError, Wire, context_error, validation_error
from stepline.api.pipeline.model_output import OutputDelta, OutputFormat, OutputSplitter
from stepline.api.pipeline.resume import (
    FrameCounter,
    ResumableStreamResponse,
    ResumeRegistry,
    key_of,
    run_producer,
    wants_resumable,
)
from stepline.api.pipeline.sse import OPENAI, Emit, EventStreamResponse
from stepline.api.prompts import PromptTooLongError
from stepline.engine.grammar import GrammarError
from stepline.engine.policy import ContextLengthExceededError, QueueFullError

if TYPE_CHECKING:
    from stepline.actors.request import RequestOutput
    from stepline.api.engine import Engine, RequestStream

log = structlog.get_logger(__name__)

# Below this, a temperature is greedy: dividing logits by 1e-308 overflows to inf/nan.
GREEDY_TEMPERATURE = 1e-5
JSON_MEDIA_TYPES = ("application/json",)
# The sampling fields a door's request may carry, by their engine names (`Serving.sampling`).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
DEFAULT_BODY_TIMEOUT_S = 60.0  # 4 MiB at 1 Mbit/s takes 34 s


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


def loads_strict(body: bytes) -> Any:
    """Parse a JSON body held to `json_limits` (finite numbers, bounded depth and lists,
    valid text). Raises APIError 400 naming the limit."""
    try:
        return parse_body(body)
    except InputLimitError as exc:
        raise APIError(400, exc.message, param=exc.param, code=exc.code) from None


class Serving:
    """Engine plumbing for HTTP handlers: a front door subclasses it and adds its handlers.

    `served_model_names`: the names clients may send as `model` (the first is the one listed);
    default: the engine's model name.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_body_bytes: int,
        heartbeat_s: float,
        served_model_names: Sequence[str] = (),
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    ):
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.heartbeat_s = heartbeat_s
        self.served_model_names: tuple[str, ...] = tuple(served_model_names) or (engine.model_name,)
        self.created = now()
        self._token_text: dict[int, str] = {}
        self.reasoning = False  # split <think> blocks into reasoning (--reasoning-parser)
        self.default_template_kwargs: dict[str, Any] = {}  # --default-chat-template-kwargs
        self.resume = ResumeRegistry()  # resumable streams' records (create_app shares one)
        self.strict_max_tokens = False  # --strict-max-tokens: a max_tokens past the room is a 400

    @property
    def model_name(self) -> str:
        """The name this server lists and answers with by default."""
        return self.served_model_names[0]

    def response_model(self, requested: str | None) -> str:
        """The `model` of a response: the name the client asked for (it is a served one)."""
        return requested if requested is not None else self.model_name

    # -- request side --

    async def read_body(self, request: Request) -> bytes:
        """The body, if it is JSON (415 otherwise: a page cannot send JSON cross-site without
        a CORS preflight), within the size limit (413), and whole within `body_timeout_s`
        (408). A client that hangs up while sending it gets its request logged as cancelled
        and answered 499."""
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type not in JSON_MEDIA_TYPES:
            raise APIError(
                415,
                f"the body must be JSON sent as `Content-Type: application/json`, not "
                f"{media_type or 'no content type'!r}",
                code="unsupported_media_type",
            )
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
        try:
            # A body trickled byte by byte would hold its connection and task forever.
            with anyio.fail_after(self.body_timeout_s):
                async for chunk in request.stream():  # also bounds bodies sent without a length
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {self.body_timeout_s:g} s",
                code="request_timeout",
            ) from None
        except ClientDisconnect:
            log.info("request_cancelled", reason="client disconnected while sending the body")
            raise APIError(499, "the client closed the connection", code="client_closed") from None
        return b"".join(chunks)

    async def parse(self, request: Request, cls: type[_R], *, generates: bool = True) -> _R:
        """The body as a `cls`, validated on a worker thread (a 4 MiB body takes a while).
        A request that `generates` counts as on its way to the engine from here."""
        body = await self.read_body(request)
        if generates:
            self.engine.arriving()  # until it is submitted, or `handle` ends

        def validate() -> _R:
            data = loads_strict(body)
            try:
                return cls.model_validate(data)  # type: ignore[attr-defined]
            except ValidationError as exc:
                raise validation_error(exc) from None

        req = await anyio.to_thread.run_sync(validate)
        req.check_supported()
        if req.model is not None and req.model not in self.served_model_names:
            names = ", ".join(repr(n) for n in self.served_model_names)
            raise APIError(
                404,
                f"The model {req.model!r} does not exist: this server serves {names} "
                "(see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return req

    async def prepare(
        self,
        *,
        prompt: str | list[int] | None = None,
        messages: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        param: str | None = None,  # the request field errors name; default: prompt / messages
    ) -> tuple[list[int], list[int]]:
        """Token ids and chat checkpoints, computed off the event loop."""
        param = param or ("prompt" if messages is None else "messages")
        try:
            return await self.engine.prepare_async(prompt, messages, template_kwargs)
        except PromptTooLongError as exc:
            raise APIError(
                400,
                f"This model's maximum context length is {exc.max_context} tokens, but the "
                f"prompt has at least {exc.num_prompt_tokens} tokens: shorten the prompt",
                param=param,
                code="context_length_exceeded",
            ) from None
        except ValueError as exc:  # a bad token id, or a template that refused the messages
            raise APIError(400, f"{param}: {exc}", param=param) from None

    def max_tokens(
        self,
        requested: int | None,
        num_prompt: int,
        *,
        default: int | None,
        prompt_param: str,
        param: str = "max_tokens",
    ) -> int:
        """The request's token limit: `requested`, or by default the room left in the context
        (within the KV budget). A `requested` past the room is clamped to it (agents such as
        Claude Code cannot be told a local model's context), unless `strict_max_tokens`, where
        it is a 400."""
        max_context = self.engine.max_context
        if num_prompt >= max_context:
            raise context_error(ContextLengthExceededError(num_prompt, max_context), prompt_param)
        context_room = room = max_context - num_prompt
        # No further than the KV budget lets it either: otherwise a plain chat on a
        # long-context model whose budget is below its context would be refused as "can never
        # fit".
        config = self.engine.step_loop.config
        if config.max_kv_tokens is not None:
            fits = config.max_kv_tokens - num_prompt - config.kv_tokens_per_seq
            room = min(room, max(fits, 1))
        if requested is None:
            return min(default or room, room)
        if requested <= room:
            return requested
        if not self.strict_max_tokens:
            log.info("max_tokens_clamped", requested=requested, effective=room, param=param)
            return room
        if requested > context_room:
            raise APIError(
                400,
                f"This model's maximum context length is {max_context} tokens, but "
                f"{num_prompt + requested} tokens were requested ({num_prompt} in the prompt, "
                f"{requested} in the completion): shorten the prompt or lower {param} to at "
                f"most {context_room}",
                param=param,
                code="context_length_exceeded",
            )
        return requested  # past the KV budget: `submit` says by how much

    def sampling(
        self, req: Any, max_tokens: int, logprobs: int | None, grammar: str | None = None
    ) -> SamplingParams:
        """The one parameter builder of every door: `req`'s sampling fields (those of
        `SAMPLING_FIELDS` it has, already range-checked; `stop_strings`, `ignore_eos`) as
        engine parameters, after the checks that need the model: `top_k` and `stop_token_ids`
        within the vocabulary. A temperature below GREEDY_TEMPERATURE is greedy."""
        vocab = self.engine.vocab_size
        top_k = getattr(req, "top_k", None)
        stop_token_ids = getattr(req, "stop_token_ids", None)
        if top_k is not None and top_k > vocab:
            raise RequestError(
                f"top_k must be at most the vocabulary size, {vocab} (0 or -1 = off), got {top_k}",
                param="top_k",
                code="invalid_value",
            )
        for i, t in enumerate(stop_token_ids or ()):
            if not 0 <= t < vocab:
                raise RequestError(
                    f"stop_token_ids[{i}] = {t} is not in the model's vocabulary (0..{vocab - 1})",
                    param="stop_token_ids",
                    code="invalid_value",
                )
        fields: dict[str, Any] = {
            "max_tokens": max_tokens,
            "stop": tuple(getattr(req, "stop_strings", ())),
            "ignore_eos": getattr(req, "ignore_eos", False),
            "logprobs": logprobs,
            "grammar": grammar,
        }
        for name in SAMPLING_FIELDS:
            value = getattr(req, name, None)
            if value is not None:
                fields[name] = value
        temperature = fields.get("temperature")
        if temperature is not None and temperature < GREEDY_TEMPERATURE:
            fields["temperature"] = 0.0
        if top_k is not None:
            fields["top_k"] = max(top_k, 0)
        if stop_token_ids:
            fields["stop_token_ids"] = tuple(stop_token_ids)
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
        grammar_param: str = "response_format",
    ) -> RequestStream:
        try:
            return await self.engine.submit(
                prompt=ids, params=params, request_id=rid, checkpoints=checkpoints
            )
        except ContextLengthExceededError as exc:
            raise context_error(exc, prompt_param) from None
        except QueueFullError as exc:
            retry_after = max(1, math.ceil(exc.retry_after_s))
            err = APIError(
                429,
                f"the server is busy ({exc.num_waiting} requests waiting, at most "
                f"{exc.max_waiting}): retry after {retry_after} s",
                type="rate_limit_error",
                code="queue_full",
            )
            err.headers["retry-after"] = str(retry_after)
            raise err from None
        except EngineDeadError as exc:
            log.error("request_refused", reason=str(exc))
            raise APIError(
                503,
                "the engine is unavailable: it failed and must be restarted",
                code="engine_unhealthy",
            ) from None
        except GrammarError as exc:  # a schema llguidance cannot compile
            raise APIError(400, str(exc), param=grammar_param, code="invalid_schema") from None
        except ValueError as exc:  # AdmissionError (empty prompt, KV too small), bad token ids
            raise APIError(400, str(exc), param=prompt_param) from None
        except RuntimeError:  # the engine is closed: the server is shutting down
            raise APIError(503, "the server is shutting down", code="shutting_down") from None

    # -- response side --

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.engine.tokenizer.decode([token_id])
        return text

    def failure(self, out: RequestOutput) -> APIError:
        """The client's error for a request that ended without stop or length; what went wrong
        goes to the log, under the request id the client's message names."""
        rid = out.request_id
        if out.finish_reason == "cancelled":
            return APIError(
                503, "the request was cancelled: the server is shutting down", code="shutting_down"
            )
        log.error("request_failed", request_id=rid, error=out.error)
        if not self.engine.healthy:
            return APIError(
                503,
                f"the engine failed and can serve no request until it is restarted "
                f"(request id {rid})",
                code="engine_unhealthy",
            )
        return APIError(500, f"internal error (request id {rid})", code="engine_error")

    async def attached(self, request: Request, run: Callable[[], Awaitable[None]]) -> None:
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
            raise APIError(499, "the client closed the connection", code="client_closed")

    async def collect(self, request: Request, stream: RequestStream) -> list[RequestOutput]:
        """Every output of a non-streaming request; a client disconnect cancels it."""
        outs: list[RequestOutput] = []

        async def read() -> None:
            async with stream:
                outs.extend([out async for out in stream if not out.is_progress])

        await self.attached(request, read)
        if not outs or outs[-1].finish_reason is None:
            raise APIError(499, "the client closed the connection", code="client_closed")
        if outs[-1].finish_reason not in ("stop", "length"):
            raise self.failure(outs[-1])
        return outs

    def stream_response(
        self,
        started: Started,
        produce: Callable[[Emit], Awaitable[None]],
        *,
        resumable_from: Request | None = None,
        wire: Wire = OPENAI,
    ) -> Response:
        """The one stream writer: `produce`'s frames, numbered (`id: N`), with pings while
        nothing is sent; an error it raises (a failed request, a bug) ends the stream with
        `wire`'s error frames, never a traceback. `resumable_from`: the HTTP request, when
        it asked for a resumable stream (see `resume`)."""
        rid, stream = started.rid, started.stream

        async def guarded(emit: Emit) -> None:
            try:
                await produce(emit)
            except APIError as err:
                await emit(wire.error_frames(err))
            except Exception:  # a bug here must still end the stream the API's way
                log.exception("stream_failed", request_id=rid)
                err = APIError(500, f"internal error (request id {rid})", code="server_error")
                await emit(wire.error_frames(err))

        if resumable_from is not None:
            record = self.resume.open(rid, key_of(resumable_from.headers), wire=wire)
            return ResumableStreamResponse(
                record,
                lambda: run_producer(record, guarded, stream.aclose),
                headers=started.headers,
                heartbeat_s=self.heartbeat_s,
            )
        return EventStreamResponse(
            lambda emit: guarded(FrameCounter().wrap(emit) if wire.numbered else emit),
            headers=started.headers,
            heartbeat_s=self.heartbeat_s,
            on_close=stream.aclose,
            wire=wire,
        )

    @staticmethod
    def asks_resumable(request: Request, in_body: bool) -> Request | None:
        """`request` if it asked for a resumable stream (in its body or by header)."""
        return request if in_body or wants_resumable(request.headers) else None

    async def handle(
        self, request: Request, rid: str, handler: Callable, wire: Wire = OPENAI
    ) -> Response:
        """The one error wrapper: run `handler` with the request id bound to every log line;
        an error is answered in `wire`'s shape and carries the request id. A bug is a 500 that
        names the request id, and its traceback goes to the log."""
        # Bound for the rest of this request's task (uvicorn runs each request in a task of its
        # own), so that its access-log line, written after this returns, carries the id too.
        structlog.contextvars.bind_contextvars(request_id=rid)
        try:
            return await handler(request, rid)
        except RequestError as exc:
            err = APIError(400, exc.message, param=exc.param, code=exc.code)
        except APIError as exc:
            err = exc
        except Exception:
            log.exception("request_failed", request_id=rid)
            err = APIError(500, f"internal error (request id {rid})", code="server_error")
        finally:
            self.engine.arrived()  # a request that failed before it was submitted
        err.request_id = rid
        log.info(
            "request_error",
            status=err.status_code,
            code=err.detail.code,
            param=err.detail.param,
            message=err.detail.message,
        )
        return wire.error_response(err)

    # -- the pipeline every door shares --

    async def start(self, call: Call) -> Started:
        """`call` into an engine request, up to its admission: the prompt's tokens (off the
        event loop), its token limit, the think budget, its sampling parameters, and the
        submission. Raises APIError (or RequestError) for what cannot be served."""
        agent = call.agent
        ids, checkpoints = await self.prepare(
            prompt=call.prompt,
            messages=call.messages,
            template_kwargs=agent.template_kwargs,
            param=call.prompt_param,
        )
        max_tokens = self.max_tokens(
            call.max_tokens,
            len(ids),
            default=call.default_max_tokens,
            prompt_param=call.prompt_param,
            param=call.max_tokens_param,
        )
        tokenizer = self.engine.tokenizer
        prompt_text = tokenizer.decode(ids[-8:])
        if call.think_budget is not None:
            agent = agent.with_think_budget(tokenizer, call.think_budget, prompt_text)
        params = self.sampling(call.sampling, max_tokens, call.logprobs, agent.grammar)
        stream = await self.submit(
            call.rid,
            ids,
            params,
            call.prompt_param,
            checkpoints,
            grammar_param=agent.grammar_param,
        )
        fmt = agent.output_format(tokenizer, reasoning=call.reasoning, prompt_text=prompt_text)
        headers = {"x-request-id": call.rid, **call.headers}
        if agent.dropped_tools:
            # Tools the model cannot use: hosted ones (Responses), or any offered, not forced,
            # to a model that cannot show or read tool calls; it answers in text.
            log.info("tools_dropped", request_id=call.rid, tools=agent.dropped_tools)
            headers[DROPPED_TOOLS_HEADER] = ", ".join(agent.dropped_tools)
        if call.max_tokens is not None and max_tokens < call.max_tokens:
            headers[EFFECTIVE_MAX_TOKENS_HEADER] = str(max_tokens)
        return Started(call.rid, stream, fmt, agent.openai_tools or None, max_tokens, headers)

    async def pieces(self, started: Started, splitter: OutputSplitter) -> AsyncIterator[Piece]:
        """The one read loop of every door: the request's outputs as typed pieces (content,
        reasoning, tool-call deltas and calls, split by `splitter`), a progress piece (no
        output) while a long prompt prefills, the last one with the finish reason. Raises
        APIError for a request that failed or ended without a finish reason."""
        async for out in started.stream:
            if out.is_progress:
                yield Piece(OutputDelta(), out)
                continue
            if out.finish_reason not in (None, "stop", "length"):
                raise RequestFailed(self.failure(out), out)
            delta = splitter.feed(out.text)
            if out.finish_reason is not None:
                delta.extend(splitter.finish())
            yield Piece(delta, out)
            if out.finish_reason is not None:
                return
        log.error("request_unfinished", request_id=started.rid, error="no finish reason")
        raise APIError(500, f"internal error (request id {started.rid})", code="engine_error")


EFFECTIVE_MAX_TOKENS_HEADER = "x-stepline-max-tokens"  # set when a max_tokens was clamped
# The tools a request's `tools` lost: hosted ones (Responses), or all of them when the model's
# chat template cannot show or read tool calls.
DROPPED_TOOLS_HEADER = "x-stepline-dropped-tools"


class RequestFailed(APIError):
    """The error of a request that ended with an error or was cancelled; `out` is its last
    output (its finish reason)."""

    def __init__(self, err: APIError, out: RequestOutput):
        super().__init__(
            err.status_code, err.detail.message, type=err.detail.type, code=err.detail.code
        )
        self.out = out


@dataclass
class Call:
    """One door's request in engine terms: what every API asks of the engine."""

    rid: str
    sampling: Any  # the request: its sampling fields by their engine names (`Serving.sampling`)
    agent: AgentPlan  # tools, output constraints, template arguments
    prompt_param: str  # the request field that holds the prompt (for errors)
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None  # as requested
    max_tokens_param: str = "max_tokens"
    default_max_tokens: int | None = None  # None: the room left in the context
    logprobs: int | None = None
    reasoning: bool = False  # split think blocks into reasoning
    think_budget: int | None = None  # most tokens the think block may take
    headers: dict[str, str] = field(default_factory=dict)  # for the response


@dataclass
class Started:
    """An admitted request, and how to read its output."""

    rid: str
    stream: RequestStream
    fmt: OutputFormat
    tools: list[dict[str, Any]] | None  # the tool definitions (some parsers read them)
    max_tokens: int  # the effective limit
    headers: dict[str, str]  # the response's: the request id, a clamped max_tokens, ...

    def splitter(self) -> OutputSplitter:
        """A streaming splitter of this request's output (non-streamed answers split the whole
        text at once, `split_output`)."""
        return OutputSplitter(self.fmt, self.tools, stream=True)


@dataclass
class Piece:
    """One step of a request's output, split."""

    delta: OutputDelta
    out: RequestOutput  # `is_progress`: no output yet, a long prompt is prefilling

    @property
    def is_progress(self) -> bool:
        return self.out.is_progress
