"""The one pipeline under every HTTP door (chat, completions, Messages, Responses, Ollama's):
each door translates its request into a `Call` and renders `Piece`s in its wire format; the
rest is here, once.

    body = await serving.parse(request, Model)        read and validate a body
    started = await serving.start(Call(...))           the engine request, admitted
    async for piece in serving.pieces(started, ...)     its output, split (reasoning, tool calls)
    serving.stream(started, renderer, ...)             the one stream writer: frames, pings,
                                                        numbering, disconnects, resume, kept
                                                        streams
    await serving.collect(request, started)            a whole answer, cancelled on disconnect
    await serving.handle(request, rid, handler, wire)  the one error wrapper

Clients get stable messages and codes plus the request id, never an exception's text; the
detail goes to the server log under the same id.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import structlog
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect

from stepline.actors.scheduler.policy import max_output_tokens
from stepline.actors.scheduler.work import GRAMMAR_FAILED
from stepline.api.config import ServerConfig
from stepline.api.json_limits import parse_body
from stepline.api.params import SamplingParams
from stepline.api.pipeline.agents import AgentPlan
from stepline.api.pipeline.errors import (
    APIError,
    Wire,
    body_too_large,
    client_closed,
    context_exceeded,
    engine_unhealthy,
    grammar_failed,
    internal_error,
    known_error,
    shutting_down,
)
from stepline.api.pipeline.images import ImageOptions, ImagesBusyError, resolve_images
from stepline.api.pipeline.model_output import OutputDelta, OutputFormat, OutputSplitter
from stepline.api.pipeline.resume import (
    FrameCounter,
    ResumableStreamResponse,
    ResumeRegistry,
    StreamRecord,
    key_of,
    presented_key,
    wants_resumable,
)
from stepline.api.pipeline.served import (
    ServedModel,
    ServedModels,
    adopt_binding,
    watch_loading,
)
from stepline.api.pipeline.writer import Emit, StreamResponse
from stepline.api.prompts import Prepared
from stepline.engine.images import ImageError
from stepline.engine.sampling_limits import GREEDY_TEMPERATURE

if TYPE_CHECKING:
    from stepline.actors.request import RequestOutput
    from stepline.api.engine import Engine, RequestStream
    from stepline.api.pool import ModelPool

log = structlog.get_logger(__name__)

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
# The statuses of a request refused before it reaches the engine (bad parameters, an unknown
# model, a body too large, a full queue), which the event log records (`Serving.handle`);
# the engine records its own (a full queue: it refused it, and the log has it already).
REFUSALS = frozenset({400, 404, 413, 422, 429})
EFFECTIVE_MAX_TOKENS_HEADER = "x-stepline-max-tokens"  # set when a max_tokens was clamped
# The tools a request's `tools` lost: hosted ones (Responses), or all of them when the model's
# chat template cannot show or read tool calls.
DROPPED_TOOLS_HEADER = "x-stepline-dropped-tools"


class ServedRequest(Protocol):
    """What `Serving.parse` needs of a request model."""

    model: str | None

    def check_supported(self) -> None: ...


_R = TypeVar("_R", bound=ServedRequest)


def json_response(
    body: BaseModel, status_code: int = 200, headers: dict | None = None, **dump: Any
) -> Response:
    """`body` as JSON. pydantic's encoder, not json.dumps: a -inf logprob becomes null."""
    return Response(
        body.model_dump_json(**dump),
        status_code=status_code,
        headers=headers,
        media_type="application/json",
    )


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
    client: str | None = None  # who sends it (`client_of`); None: the anonymous client


def client_of(headers: Headers, user: str | None = None) -> str | None:
    """Who sends a request, for fair share between clients (`Engine.submit`'s `client`): the
    API key it carries and, within a key, the end user its body names (`user`, ...). A
    server has one `--api-key`, which every client then carries: `user` is what tells them
    apart. Each as a fingerprint, since the event log records the client (a key, or a
    user's e-mail, must not reach it); None for a request with neither (every such request
    is one anonymous client)."""
    key = presented_key(headers)
    parts = [f"key:{_fingerprint(key)}"] if key else []
    if user:
        parts.append(f"user:{_fingerprint(user)}")
    return " ".join(parts) or None


def _fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


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


class RequestFailed(APIError):
    """The error of a request that ended with an error or was cancelled; `out` is its last
    output (its finish reason)."""

    def __init__(self, err: APIError, out: RequestOutput):
        super().__init__(err.status_code, err.message, type=err.type, code=err.code)
        self.out = out


class Renderer(Protocol):
    """A door's rendering of one streamed request: its pieces as frames."""

    splitter: OutputSplitter

    def frames(self, piece: Piece) -> bytes:
        """The frames of one piece (b"" for none); the last piece's include the stream's end."""
        ...

    def failed(self, err: APIError) -> bytes:
        """The stream's last frames after the request failed."""
        ...

    def cancelled(self, err: APIError) -> bytes:
        """The stream's last frames after its producer was cancelled (`err` says why)."""
        ...


class Serving:
    """The pipeline, for every door of one app: the served models, the server's options and
    the resumable streams' records. A request's model is bound to its task when its body is
    parsed (`parse` -> `bind`: loaded first, in a server of several models); `model` (and
    `engine`, `reasoning`, ...) are then that model's."""

    def __init__(
        self,
        engine: Engine | ModelPool,
        config: ServerConfig,
        interrupted: Sequence[tuple[str, float]] = (),
    ):
        self.config = config
        # (request id, admitted at) of what the event log says the last run left unfinished
        # (`responses.recovery`): the Responses door answers those as failed.
        self.interrupted = interrupted
        self.resume = ResumeRegistry(config.resume_grace_s)
        self.models = ServedModels(engine, config)  # which model serves a request

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name a client may send as `model`."""
        return self.models.names

    @property
    def model_name(self) -> str:
        """The name this server lists first and answers with by default."""
        return self.models.names[0]

    def response_model(self, requested: str | None) -> str:
        """The `model` of a response: the name the client asked for (it is a served one)."""
        return requested if requested is not None else self.model.name

    @property
    def model(self) -> ServedModel:
        """The model of the request this task serves (`ServedModels.current`)."""
        return self.models.current

    @property
    def engine(self) -> Engine:
        return self.model.engine

    @property
    def reasoning(self) -> Any:
        return self.model.reasoning

    @property
    def default_template_kwargs(self) -> dict[str, Any]:
        return self.model.default_template_kwargs

    @property
    def images(self) -> ImageOptions:
        return self.model.images

    # -- request side --

    async def read_body(self, request: Request, *, any_media_type: bool = False) -> bytes:
        """The body, if it is sent as JSON (415 otherwise: a page cannot send JSON cross-site
        without a CORS preflight), within the size limit (413), and whole within the body
        timeout (408). `any_media_type`: for an API whose documented clients send JSON with
        no content type (Ollama's `curl -d`), any is taken from a request that comes from no
        web page (it has no `Origin`). A client that hangs up while sending it gets its
        request logged as cancelled and answered 499."""
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        lenient = any_media_type and "origin" not in request.headers
        if media_type not in JSON_MEDIA_TYPES and not lenient:
            raise APIError(
                415,
                f"the body must be JSON sent as `Content-Type: application/json`, not "
                f"{media_type or 'no content type'!r}",
                code="unsupported_media_type",
            )
        limit = self.config.max_body_bytes
        too_large = body_too_large(limit)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        timeout = self.config.timeout_request_body
        try:
            # A body trickled byte by byte would hold its connection and task forever.
            with anyio.fail_after(timeout):
                async for chunk in request.stream():  # also bounds bodies sent without a length
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(
                408, f"the request body did not arrive within {timeout:g} s", code="request_timeout"
            ) from None
        except ClientDisconnect:
            log.info("request_cancelled", reason="client disconnected while sending the body")
            raise client_closed() from None
        return b"".join(chunks)

    async def parse(
        self,
        request: Request,
        cls: type[_R],
        *,
        generates: bool = True,
        any_media_type: bool = False,
    ) -> _R:
        """The body as a `cls`, validated on a worker thread (a 4 MiB body takes a while).
        A request that `generates` counts as on its way to the engine from here.
        `any_media_type`: see `read_body`."""
        body = await self.read_body(request, any_media_type=any_media_type)
        if generates and self.models.one is not None:
            self.models.one.engine.arriving()  # until it is submitted, or `handle` ends

        def validate() -> _R:
            return cls.model_validate(parse_body(body))  # type: ignore[attr-defined]

        try:
            req = await anyio.to_thread.run_sync(validate)
        except ValueError as exc:  # the body's limits, pydantic's validation
            raise known_error(exc) or exc from None
        req.check_supported()
        # A pool's model: loaded first (a plain stream pings meanwhile), arriving from then.
        plain_stream = getattr(req, "stream", False) and not self.asks_resumable(
            request, getattr(req, "resumable", False)
        )
        await self.models.bind(req.model, streams=bool(plain_stream))
        return req

    def check_model(self, model: str | None) -> None:
        """Raises APIError 404 if `model` is given and not a name this server serves."""
        self.models.check(model)

    def max_tokens(
        self,
        requested: int | None,
        num_prompt: int,
        *,
        default: int | None,
        prompt_param: str,
        param: str = "max_tokens",
    ) -> int:
        """The request's token limit (`policy.max_output_tokens`, the engine's one): `requested`,
        or by default `default` or the room left in the context, within the KV budget. A
        `requested` past the room is clamped to it (agents such as Claude Code cannot be told
        a local model's context), unless `strict_max_tokens`, where past the context it is a
        400."""
        max_context = self.engine.max_context
        if num_prompt >= max_context:
            raise context_exceeded(num_prompt, max_context, prompt_param, at_least=False)
        if requested is not None and self.config.strict_max_tokens:
            context_room = max_output_tokens(None, num_prompt, max_context)
            if requested > context_room:
                raise APIError(
                    400,
                    f"This model's maximum context length is {max_context} tokens, but "
                    f"{num_prompt + requested} tokens were requested ({num_prompt} in the "
                    f"prompt, {requested} in the completion): shorten the prompt or lower "
                    f"{param} to at most {context_room}",
                    param=param,
                    code="context_length_exceeded",
                )
            return requested  # past the KV budget: the submission says by how much
        asked = requested if requested is not None else (default or None)
        limit = max_output_tokens(asked, num_prompt, max_context, self.engine.step_loop.config)
        if requested is not None and limit < requested:
            log.info("max_tokens_clamped", requested=requested, effective=limit, param=param)
        return limit

    def sampling(
        self, req: Any, max_tokens: int, logprobs: int | None, grammar: str | None = None
    ) -> SamplingParams:
        """The one parameter builder of every door: `req`'s sampling fields (those of
        `SAMPLING_FIELDS` it has, already range-checked; `stop_strings`, `ignore_eos`,
        `top_k`, `stop_token_ids`) as engine parameters, after the checks that need the
        model: `top_k` and `stop_token_ids` within the vocabulary. A temperature below
        GREEDY_TEMPERATURE is greedy."""
        vocab = self.engine.vocab_size
        top_k = getattr(req, "top_k", None)
        stop_token_ids = getattr(req, "stop_token_ids", None)
        if top_k is not None and top_k > vocab:
            raise APIError(
                400,
                f"top_k must be at most the vocabulary size, {vocab} (0 or -1 = off), got {top_k}",
                param="top_k",
                code="invalid_value",
            )
        for i, t in enumerate(stop_token_ids or ()):
            if not 0 <= t < vocab:
                raise APIError(
                    400,
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
        except ValueError as exc:
            raise known_error(exc) or exc from None

    async def prepare(
        self,
        *,
        prompt: str | list[int] | None = None,
        messages: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        param: str = "messages",  # the request field errors name
    ) -> Prepared:
        """Token ids, chat checkpoints and images, computed off the event loop. Raises APIError
        for a prompt past the context, messages the chat template refuses, or an image the
        model cannot read."""
        try:
            return await self.engine.prepare_async(prompt, messages, template_kwargs)
        except ValueError as exc:
            raise known_error(exc, prompt_param=param) or exc from None

    async def with_images(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` with their image parts fetched and decoded (`resolve_images`). Raises
        APIError (400) for images this server does not take: any, to a text-only model; 429
        when the server's pixel budget stays full."""
        try:
            return await resolve_images(messages, self.images)
        except (ImageError, ImagesBusyError) as exc:
            raise known_error(exc) or exc from None

    async def start(self, call: Call) -> Started:
        """`call` into an engine request, up to its admission: the prompt's tokens (off the
        event loop), its token limit, the think budget, its sampling parameters, and the
        submission. Raises APIError for what cannot be served."""
        try:
            return await self._start(call)
        except Exception as exc:  # what the engine refuses, by the catalogue; else a bug
            err = known_error(
                exc, prompt_param=call.prompt_param, grammar_param=call.agent.grammar_param
            )
            if err is None:
                raise
            raise err from None

    async def _start(self, call: Call) -> Started:
        agent = call.agent
        messages = None if call.messages is None else await self.with_images(call.messages)
        prepared = await self.prepare(
            prompt=call.prompt,
            messages=messages,
            template_kwargs=agent.template_kwargs,
            param=call.prompt_param,
        )
        ids = prepared.ids
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
        stream = await self.engine.submit(
            prompt=ids,
            params=params,
            request_id=call.rid,
            checkpoints=prepared.checkpoints,
            client=call.client,
            images=prepared.images,
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

    # -- response side --

    def failure(self, out: RequestOutput) -> APIError:
        """The client's error for a request that ended without stop or length; what went wrong
        goes to the log, under the request id the client's message names."""
        rid = out.request_id
        if out.finish_reason == "cancelled":
            return shutting_down("the request was cancelled: the server is shutting down")
        if out.error is not None and out.error.startswith(GRAMMAR_FAILED):
            log.info("request_failed", request_id=rid, error=out.error)  # its schema's fault
            return grammar_failed(out.error, rid)
        log.error("request_failed", request_id=rid, error=out.error)
        if not self.engine.healthy:
            return engine_unhealthy(rid)
        return internal_error(rid, code="engine_error")

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
        raise internal_error(started.rid, code="engine_error")

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
            raise client_closed()

    async def collect(self, request: Request, started: Started) -> list[RequestOutput]:
        """Every output of a non-streamed request; a client disconnect cancels it."""
        outs: list[RequestOutput] = []
        stream = started.stream

        async def read() -> None:
            async with stream:
                outs.extend([out async for out in stream if not out.is_progress])

        await self.attached(request, read)
        if not outs or outs[-1].finish_reason is None:
            raise client_closed()
        if outs[-1].finish_reason not in ("stop", "length"):
            raise RequestFailed(self.failure(outs[-1]), outs[-1])
        return outs

    async def produce(self, started: Started, renderer: Renderer, emit: Emit) -> None:
        """The one producer of every stream: the request's pieces through `renderer` into
        `emit`; a failed request (or a bug here) ends the stream with the renderer's failure
        frames, never a traceback."""
        try:
            async for piece in self.pieces(started, renderer.splitter):
                data = renderer.frames(piece)
                if data:
                    await emit(data)
        except APIError as err:
            await emit(renderer.failed(err))
        except Exception:
            log.exception("stream_failed", request_id=started.rid)
            await emit(renderer.failed(internal_error(started.rid)))

    def keep(
        self, request: Request, started: Started, wire: Wire, *, resumable: bool, background=False
    ) -> StreamRecord:
        """A record that keeps `started`'s stream (for a reconnect, a later read): resumable
        by the caller's key at GET /v1/requests/{id}/stream. A foreground one is cancelled
        once nobody follows it for the resume grace (`resumable`) or at once; a background
        one runs to its end."""
        grace = None if background else (self.resume.grace_s if resumable else 0.0)
        return self.resume.open(started.rid, key_of(request.headers), wire, grace_s=grace)

    def run_kept(
        self, record: StreamRecord, started: Started, renderer: Renderer
    ) -> Callable[[], Awaitable[None]]:
        """What writes `started`'s stream into `record` (see `StreamRecord.run`)."""

        async def run() -> None:
            await record.run(
                lambda emit: self.produce(started, renderer, emit),
                on_close=started.stream.aclose,
                on_cancel=renderer.cancelled,
            )

        return run

    def stream(
        self,
        started: Started,
        renderer: Renderer,
        wire: Wire,
        *,
        record: StreamRecord | None = None,
    ) -> Response:
        """The one stream writer: `renderer`'s frames in `wire`'s framing, numbered where the
        wire numbers them, with pings while nothing is sent. Kept in `record` (see `keep`)
        it survives a dropped connection."""
        if record is not None:
            return ResumableStreamResponse(
                record,
                self.run_kept(record, started, renderer),
                headers=started.headers,
                heartbeat_s=self.config.heartbeat_s,
            )
        counter = FrameCounter() if wire.numbered else None
        return StreamResponse(
            lambda emit: self.produce(
                started, renderer, counter.wrap(emit) if counter is not None else emit
            ),
            wire=wire,
            headers=started.headers,
            heartbeat_s=self.config.heartbeat_s,
            on_close=started.stream.aclose,
            on_cancel=renderer.cancelled,
        )

    def in_background(
        self, record: StreamRecord, started: Started, renderer: Renderer, body: Response
    ) -> Response:
        """`body` now; the request runs on into `record` after it is sent."""
        body.background = BackgroundTask(self.run_kept(record, started, renderer))
        return body

    def asks_resumable(self, request: Request, in_body: bool) -> bool:
        """Whether `request` asked for a resumable stream (in its body or by header)."""
        return in_body or wants_resumable(request.headers)

    async def handle(
        self,
        request: Request,
        rid: str,
        handler: Callable,
        wire: Wire,
        *,
        generates: bool = True,
    ) -> Response:
        """The one error wrapper: run `handler` with the request id bound to every log line;
        an error is answered in `wire`'s shape and carries the request id. A bug is a 500 that
        names the request id, and its traceback goes to the log. A request that `generates`
        and is refused before it reaches the engine (a 4xx of `REFUSALS`) is recorded in the
        event log as refused (`ServedModels.log_refusal`). In a server of several models, a
        streamed request whose model must load first gets its stream's headers at once and
        pings while the model loads (`_after_load`)."""
        # Bound for the rest of this request's task (uvicorn runs each request in a task of its
        # own), so that its access-log line, written after this returns, carries the id too.
        structlog.contextvars.bind_contextvars(request_id=rid)
        if self.models.pool is None or wire.ping is None:
            outcome = await self._run(request, rid, handler, generates)
            return outcome if isinstance(outcome, Response) else wire.response(outcome)
        # The handler runs in a task of its own, in a context this task keeps: its model
        # is bound there (`ServedModels.bind`), where its stream is then written.
        ctx = contextvars.copy_context()
        loading = ctx.run(watch_loading)  # set if the request streams and waits for its model
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._run(request, rid, handler, generates), context=ctx)
        signal = loop.create_task(loading.wait())
        try:
            await asyncio.wait({task, signal}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            signal.cancel()
        if not task.done():
            return self._after_load(task, ctx, rid, wire)
        adopt_binding(ctx)  # the response (a stream's renderers) runs in this task
        outcome = task.result()
        return outcome if isinstance(outcome, Response) else wire.response(outcome)

    async def _run(
        self, request: Request, rid: str, handler: Callable, generates: bool
    ) -> Response | APIError:
        """`handler`'s response, or the error to answer (logged, with the request id; a
        refusal of a request that `generates` recorded in the event log too)."""
        try:
            return await handler(request, rid)
        except APIError as exc:
            err = exc
        except Exception:
            log.exception("request_failed", request_id=rid)
            err = internal_error(rid)
        finally:
            self.models.unbind()
        err.request_id = rid
        log.info(
            "request_error",
            status=err.status_code,
            code=err.code,
            param=err.param,
            message=err.message,
        )
        if generates and err.status_code in REFUSALS and not isinstance(err, RequestFailed):
            # What the client was told (what was wrong, which field); nothing of the body.
            code = err.code or err.type
            self.models.log_refusal(rid, err.message, code=code, status=err.status_code)
        return err

    def _after_load(
        self, task: asyncio.Task, ctx: contextvars.Context, rid: str, wire: Wire
    ) -> Response:
        """A stream that starts now and pings (`wire.ping`) until `task`, the handler waiting
        for its model to load, is done; then the handler's stream goes on in it (or its error
        in the wire's frames). A client that leaves meanwhile cancels the handler."""

        async def produce(emit: Emit) -> None:
            outcome = await task
            if isinstance(outcome, APIError):
                await emit(wire.frames(outcome))
            elif isinstance(outcome, StreamResponse):
                try:  # its renderers read the request's model: in the handler's context
                    await asyncio.get_running_loop().create_task(
                        outcome.produce_into(emit), context=ctx
                    )
                finally:
                    await outcome.close()
            else:  # a whole answer after all (a stream asked of an answer that cannot stream)
                await emit(bytes(outcome.body))

        async def on_close() -> None:
            task.cancel()  # a client gone while its model loads: the request is dropped

        return StreamResponse(
            produce,
            wire=wire,
            headers={"x-request-id": rid},
            heartbeat_s=self.config.heartbeat_s,
            on_close=on_close,
        )
