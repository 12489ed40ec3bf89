"""The HTTP app: `create_app` registers every route in one place, with the API-key check,
the OpenAI-style error handlers, and the probes (/health, /metrics).

    POST /v1/chat/completions, POST /v1/completions   (streaming with server-sent events, or not)
    POST /v1/messages, POST /v1/messages/count_tokens  (Anthropic, in `anthropic_serving`)
    GET  /v1/requests/{id}/stream                      (resume a stream, in `resume`)
    POST /v1/responses, GET|DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel
                                                       (OpenAI Responses, `responses_serving`)
    GET  /v1/models, GET /v1/models/{name}, GET|HEAD /, GET /health, GET /metrics, GET /docs,
    GET  /redoc

Errors are OpenAI-style `{"error": {"message", "type", "param", "code"}}` bodies (Anthropic's
shape under /v1/messages), unknown routes included. The handlers
live in their own modules (`openai_serving`), running the process in `serve_cmd`.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from stepline.api.anthropic.serving import AnthropicServing, anthropic_router
from stepline.api.http.loading import DEFAULT_MAX_BODY_BYTES, wire_of
from stepline.api.openai.serving import OpenAIServing
from stepline.api.pipeline.agent_options import configure
from stepline.api.pipeline.errors import APIError
from stepline.api.pipeline.resume import DEFAULT_GRACE_S, ResumeRegistry, resume_response
from stepline.api.pipeline.serving import DEFAULT_BODY_TIMEOUT_S
from stepline.api.responses.serving import DEFAULT_TTL_S, ResponsesServing, responses_router

if TYPE_CHECKING:
    from stepline.api.engine import Engine

log = structlog.get_logger(__name__)

DEFAULT_HEARTBEAT_S = 15.0  # under the 30-60 s idle timeouts of common proxies


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    served_model_names: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
    metrics_public: bool = False,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    reasoning_parser: str | None = None,
    chat_template: str | None = None,
    default_chat_template_kwargs: dict | None = None,
    resume_grace_s: float = DEFAULT_GRACE_S,
    responses_ttl_s: float = DEFAULT_TTL_S,
    interrupted_responses: Sequence[tuple[str, float]] = (),
    strict_max_tokens: bool = False,
) -> FastAPI:
    """The HTTP app serving `engine`.

    With `api_key`, every route but /health (and /metrics with `metrics_public`) wants
    `Authorization: Bearer <api_key>` or `x-api-key: <api_key>` (401 otherwise): the API,
    /docs, /redoc and /openapi.json alike. `served_model_names`: the names clients may send as
    `model` (the first is listed; default: the engine's model name). `allowed_origins`: the
    web origins allowed to call it from a browser (CORS); none by default. A body must
    arrive whole within `body_timeout_s` (408 otherwise). The last three are the agent
    options (`agent_options.configure`); raises ValueError if the model cannot honour them.
    A resumable stream whose client went away is cancelled if nobody reconnects within
    `resume_grace_s`, and can be resumed until `resume_grace_s` after it ended. A stored
    /v1/responses response is kept `responses_ttl_s` after it ended; `interrupted_responses`
    ((id, admitted at) from `responses_recovery`) are answered as failed by the restart.
    A max_tokens past the room left in the context is clamped to it (the response says so in
    `x-stepline-max-tokens`), or with `strict_max_tokens` refused with a 400.
    """
    serving = OpenAIServing(
        engine,
        max_body_bytes=max_body_bytes,
        heartbeat_s=heartbeat_s,
        served_model_names=served_model_names,
        body_timeout_s=body_timeout_s,
    )
    app = FastAPI(title="stepline", summary="OpenAI-compatible LLM server", version="0.1.0")
    app.state.serving = serving
    serving.resume = ResumeRegistry(resume_grace_s)
    responses = ResponsesServing(
        engine,
        max_body_bytes=max_body_bytes,
        heartbeat_s=heartbeat_s,
        served_model_names=served_model_names,
        body_timeout_s=body_timeout_s,
        ttl_s=responses_ttl_s,
    )
    responses.resume = serving.resume
    for rid, admitted_at in interrupted_responses:
        responses.recover(rid, admitted_at)
    anthropic = AnthropicServing(
        engine,
        max_body_bytes=max_body_bytes,
        heartbeat_s=heartbeat_s,
        served_model_names=served_model_names,
        body_timeout_s=body_timeout_s,
    )
    anthropic.resume = serving.resume
    for front in (serving, anthropic, responses):
        front.strict_max_tokens = strict_max_tokens
        front.reasoning, front.default_template_kwargs = configure(
            engine.tokenizer,
            reasoning_parser=reasoning_parser,
            chat_template=chat_template,
            default_chat_template_kwargs=default_chat_template_kwargs,
        )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # An unknown route (or method): a JSON error with a code, in the caller's API's shape.
        what = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            err = APIError(404, f"no route {what} on this server", code="not_found")
        elif exc.status_code == 405:
            err = APIError(405, f"{what}: method not allowed", code="method_not_allowed")
        else:
            err = APIError(exc.status_code, str(exc.detail), code="http_error")
        err.headers.update(exc.headers or {})
        log.info("request_error", status=err.status_code, code=err.detail.code, route=what)
        return wire_of(request.url.path).error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, "the request is malformed", code="invalid_value").response()

    # -- routes: every one the server has, in one place --

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.get("/v1/requests/{request_id}/stream")
    async def resume_stream(request: Request, request_id: str) -> Response:
        return resume_response(serving.resume, request_id, request.headers, heartbeat_s)

    app.include_router(responses_router(responses))  # /v1/responses[/{id}[/cancel]]
    app.include_router(anthropic_router(anthropic))  # /v1/messages, /v1/messages/count_tokens

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(serving.models().model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id not in serving.served_model_names:
            raise APIError(
                404, f"The model {model_id!r} does not exist", param="model", code="model_not_found"
            )
        card = serving.models().data[0].model_copy(update={"id": model_id})
        return JSONResponse(card.model_dump())

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> JSONResponse:
        # Clients probe it before their first request (Claude Code sends `HEAD /`).
        return JSONResponse({"status": "ok", "model": serving.model_name})

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        if engine.healthy:
            body: dict[str, Any] = {"status": "ok", "model": serving.model_name}
            if engine.warming_up:
                body["warming_up"] = True  # serving; step times learned, not yet measured
            if (problem := engine.event_log_problem) is not None:
                # Still serving (200), but the record of what it serves is lost: say so.
                body.update(status="degraded", event_log=problem)
            return JSONResponse(body)
        reason = engine.unhealthy_reason or "the engine is shut down"
        if api_key is not None and not has_key(request.headers, api_key.encode()):
            # /health is open to all: what broke, but its detail (an exception's text) only
            # for those with the key.
            reason = reason.split(":", 1)[0] + " (send the API key for the detail)"
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- middleware: the last added runs first --

    if api_key is not None:
        open_paths = {"/", "/health", "/metrics"} if metrics_public else {"/", "/health"}
        app.add_middleware(RequireKey, api_key=api_key, open_paths=frozenset(open_paths))
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=[
                "authorization",
                "content-type",
                "x-api-key",
                "last-event-id",
                "x-stepline-resumable",
            ],
            expose_headers=["x-request-id", "retry-after"],
        )
    return app


class RequireKey:
    """ASGI middleware: every HTTP request but those to `open_paths` must carry the key, as
    `Authorization: Bearer <key>` (OpenAI) or `x-api-key: <key>` (Anthropic); 401 otherwise.
    A middleware, not a check in each route, so that no route (/docs included) is forgotten."""

    def __init__(self, app: ASGIApp, *, api_key: str, open_paths: frozenset[str]):
        self.app = app
        self.key = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._has_key(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(
            401,
            "missing or incorrect API key: send the key the server was started with as "
            "`Authorization: Bearer <key>`",
            code="invalid_api_key",
        )
        await wire_of(scope["path"]).error_response(error)(scope, receive, send)

    def _has_key(self, scope: Scope) -> bool:
        return has_key(Headers(scope=scope), self.key)


def has_key(headers: Headers, key: bytes) -> bool:
    """Whether `headers` carry `key` as `Authorization: Bearer` or `x-api-key`."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode(), key)
