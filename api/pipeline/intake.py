"""A request's way in, for every door: `Intake.handle` reads and validates its body, acquires
the model it names (a pool's: loaded first, while a stream pings), runs the door's handler
with the request's `RequestContext`, and answers every error in the door's wire shape, with
the request id. A bug is a 500 naming the request id; its traceback goes to the log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
import structlog
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from stepline.api.config import ServerConfig
from stepline.api.json_limits import parse_body
from stepline.api.pipeline.errors import (
    APIError,
    Wire,
    body_too_large,
    client_closed,
    internal_error,
    known_error,
    model_not_found,
)
from stepline.api.pipeline.output import RequestFailed, asks_resumable
from stepline.api.pipeline.served import Models, RequestContext
from stepline.api.pipeline.writer import Emit, StreamResponse

log = structlog.get_logger(__name__)

JSON_MEDIA_TYPES = ("application/json",)
# The statuses of a request refused before it reaches the engine (bad parameters, an unknown
# model, a body too large, a full queue), which the event log records (`Intake.handle`);
# the engine records its own (a full queue: it refused it, and the log has it already).
REFUSALS = frozenset({400, 404, 413, 422, 429})


class ServedRequest(Protocol):
    """What `Intake.parse` needs of a request model."""

    model: str | None

    def check_supported(self) -> None: ...


_R = TypeVar("_R", bound=ServedRequest)
Handler = Callable[[RequestContext[Any]], Awaitable[Response]]


@dataclass(frozen=True)
class _Incoming:
    """A request as it comes to `Intake.handle`, before its body is read."""

    request: Request
    rid: str
    body: type[ServedRequest]  # what its body is parsed as
    generates: bool  # it is on its way to an engine (a refusal of it is logged)
    any_media_type: bool  # `read_body`'s
    at: float = field(default_factory=time.time)


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


class Intake:
    """Requests in, for every door of one app: bodies read and parsed, models acquired and
    released, errors answered (`handle`)."""

    def __init__(self, config: ServerConfig, models: Models[Any]):
        self.config = config
        self.models = models

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

    async def parse(self, raw: bytes, cls: type[_R]) -> _R:
        """`raw` as a `cls`, validated on a worker thread (a 4 MiB body takes a while).
        Raises APIError for a body that is not one."""

        def validate() -> _R:
            return cls.model_validate(parse_body(raw))  # type: ignore[attr-defined]

        try:
            req = await anyio.to_thread.run_sync(validate)
        except ValueError as exc:  # the body's limits, pydantic's validation
            raise known_error(exc) or exc from None
        req.check_supported()
        return req

    async def acquire(self, requested: str | None, loading: asyncio.Future[None] | None) -> Any:
        """The model `requested` names (None: the first), loaded first in a pool (the caller
        waits meanwhile; `loading` is set then, for a stream's pings, see `handle`); it stays
        loaded until `release`, when the request is in its engine. Raises APIError: 400 for
        a model larger than the memory budget, 503 for one whose load failed."""
        from stepline.api.pool import ModelTooLargeError, ModelUnavailableError

        name = requested or self.models.names[0]
        if loading is not None and not loading.done() and self.models.must_wait(name):
            loading.set_result(None)  # the stream starts now, and pings until it is loaded
        try:
            return await self.models.acquire(name)
        except ModelTooLargeError as exc:
            raise APIError(400, str(exc), param="model", code="model_too_large") from None
        except ModelUnavailableError as exc:
            raise APIError(
                503, str(exc), code="model_unavailable", headers={"retry-after": "5"}
            ) from None

    def check(self, model: str | None) -> None:
        """Raises APIError 404 if `model` is given and not a name this server serves."""
        names = self.models.names
        if model is not None and model not in names:
            raise model_not_found(model, ", ".join(repr(n) for n in names))

    async def handle(
        self,
        request: Request,
        rid: str,
        handler: Handler,
        wire: Wire,
        *,
        body: type[ServedRequest],
        generates: bool = True,
        any_media_type: bool = False,
    ) -> Response:
        """The one error wrapper: `request`'s body read and parsed as a `body`, its model
        acquired, then `handler` run with the request's context, the request id bound to
        every log line (`_run`); an error is answered in `wire`'s shape and carries the
        request id. A streamed request whose model must load first gets its stream's headers
        at once and pings while the model loads (`_after_load`)."""
        # Bound for the rest of this request's task (uvicorn runs each request in a task of its
        # own), so that its access-log line, written after this returns, carries the id too.
        structlog.contextvars.bind_contextvars(request_id=rid)
        loop = asyncio.get_running_loop()
        loading: asyncio.Future[None] = loop.create_future()  # set: it waits for its model
        incoming = _Incoming(request, rid, body, generates, any_media_type)
        task = loop.create_task(
            self._run(incoming, handler, loading if wire.ping is not None else None)
        )
        either: set[asyncio.Future[Any]] = {task, loading}
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        if not task.done():
            return self._after_load(task, rid, wire)
        outcome = task.result()
        return outcome if isinstance(outcome, Response) else wire.response(outcome)

    async def _run(
        self, incoming: _Incoming, handler: Handler, loading: asyncio.Future[None] | None
    ) -> Response | APIError:
        """`handler`'s response, or the error to answer (logged, with the request id). A
        request that `generates` counts as on its way to the engine once its body is read;
        refused before it reaches the engine (a 4xx of `REFUSALS`), it is recorded in the
        event log as refused: in a pool, under the model it acquired, else under the run."""
        request, rid, entry = incoming.request, incoming.rid, None
        try:
            try:
                raw = await self.read_body(request, any_media_type=incoming.any_media_type)
                if incoming.generates:
                    entry = self.models.expect()  # a server of one model: arriving from here
                req = await self.parse(raw, incoming.body)
                self.check(req.model)
                if entry is None:
                    # A plain stream pings while its model loads; a resumable one answers
                    # once it is in.
                    resumable = getattr(req, "resumable", False)
                    plain = getattr(req, "stream", False) and not asks_resumable(request, resumable)
                    entry = await self.acquire(req.model, loading if plain else None)
                ctx = RequestContext(request, rid, req, entry, arrived_at=incoming.at)
                return await handler(ctx)
            finally:
                if entry is not None:
                    self.models.release(entry)  # its arrival ends here too
        except APIError as exc:
            err = exc
        except Exception:
            log.exception("request_failed", request_id=rid)
            err = internal_error(rid)
        err.request_id = rid
        log.info(
            "request_error",
            status=err.status_code,
            code=err.code,
            param=err.param,
            message=err.message,
        )
        refused = err.status_code in REFUSALS and not isinstance(err, RequestFailed)
        if incoming.generates and refused:
            # What the client was told (what was wrong, which field); nothing of the body.
            model = entry.name if entry is not None else None
            code, status = err.code or err.type, err.status_code
            self.models.log_refusal(rid, err.message, code=code, status=status, model=model)
        return err

    def _after_load(
        self, task: asyncio.Task[Response | APIError], rid: str, wire: Wire
    ) -> Response:
        """A stream that starts now and pings (`wire.ping`) until `task`, the handler waiting
        for its model to load, is done; then the handler's stream goes on in it (or its error
        in the wire's frames). A client that leaves meanwhile cancels the handler."""

        async def produce(emit: Emit) -> None:
            outcome = await task
            if isinstance(outcome, APIError):
                await emit(wire.frames(outcome))
            elif isinstance(outcome, StreamResponse):
                try:
                    await outcome.produce_into(emit)
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
