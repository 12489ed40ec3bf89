"""The HTTP app: `create_app` puts the doors (`doors.DOORS`) over one pipeline, with the
API-key check, the error handlers, resumed streams and the probes.

    POST /v1/chat/completions, /v1/completions, GET /v1/models[/{name}]   (api/openai)
    POST /v1/responses, GET|DELETE /v1/responses/{id}, POST .../cancel     (api/responses)
    POST /v1/messages, /v1/messages/count_tokens                           (api/anthropic)
    GET  /v1/requests/{id}/stream        (resume a stream: api/pipeline/resume.py)
    GET  /v1/events[/about], /v1/events/requests/{id}/timeline, /dashboard/  (api/http/events.py)
    POST /v1/load_lora_adapter           (a LoRA adapter while serving: api/http/adapters.py)
    GET|HEAD /, GET /health, GET /metrics, GET /docs, GET /redoc

Errors are in the shape of the door a path belongs to (OpenAI's
`{"error": {"message", "type", "param", "code"}}` elsewhere), unknown routes included.
`http/serve.py` runs it.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from stepline.api.config import ServerConfig
from stepline.api.http.adapters import adapter_routes
from stepline.api.http.doors import doors, error_response
from stepline.api.http.events import (
    KEY_COOKIE,
    KEY_PATHS,
    KEY_QUERY,
    OPEN_PREFIXES,
    add_dashboard,
    events_routes,
)
from stepline.api.pipeline.errors import APIError, internal_error
from stepline.api.pipeline.resume import presented_key, resume_response
from stepline.api.pipeline.serving import Serving

if TYPE_CHECKING:
    from stepline.api.pipeline.served import Models

log = structlog.get_logger(__name__)


def create_app(
    models: Models[Any],
    *,
    interrupted_responses: Sequence[tuple[str, float]] = (),
    **options: Any,
) -> FastAPI:
    """The HTTP app serving `models`: a pool's (api/pool.py), or a single engine's
    (`OneModel(engine)`, api/pipeline/served.py); `options` are `ServerConfig`'s fields (its
    `api_key`, `max_body_bytes`, `served_model_name`, `strict_max_tokens`, ...; the
    process's, such as `host`, are ignored here). `interrupted_responses`: (id, admitted at)
    of what the event log says a restart cut off (`responses.recovery`), answered as failed.

    With `api_key`, every route but /, /health and the dashboard's static files (and
    /metrics with `metrics_public`) wants `Authorization: Bearer <api_key>` or `x-api-key:
    <api_key>` (401 otherwise): the API, /docs, /redoc and /openapi.json alike; /v1/events
    also takes it as a cookie or a query parameter (api/http/events.py). Raises ValueError
    (pydantic's, naming the option) for a bad option, and for agent options the model
    cannot honour.
    """
    config = ServerConfig(**options)
    serving = Serving(models, config, interrupted_responses)
    app = FastAPI(title="stepline", summary="OpenAI-compatible LLM server", version="0.1.0")
    app.state.serving = serving
    add_error_handlers(app)
    for door in doors():
        app.include_router(door.routes(serving))
    _add_server_routes(app, serving)
    app.include_router(adapter_routes(serving))
    app.include_router(events_routes(models.feed, heartbeat_s=config.heartbeat_s))
    add_dashboard(app)
    # Middleware: the last added runs first.
    if config.api_key is not None:
        open_paths = {"/", "/health", "/metrics"} if config.metrics_public else {"/", "/health"}
        app.add_middleware(
            RequireKey,
            api_key=config.api_key,
            open_paths=frozenset(open_paths),
            open_prefixes=OPEN_PREFIXES,
        )
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
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


def add_error_handlers(app: FastAPI) -> None:
    """Every error as a JSON body in the shape of the door its path belongs to."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(request.url.path, exc)

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
        log.info("request_error", status=err.status_code, code=err.code, route=what)
        return error_response(request.url.path, err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        err = APIError(400, "the request is malformed", code="invalid_value")
        return error_response(request.url.path, err)

    app.add_exception_handler(Exception, _bug)


def _add_server_routes(app: FastAPI, serving: Serving) -> None:
    """The server's own routes: resumed streams, the root probe, /health and /metrics."""
    config, models = serving.config, serving.models
    registry = CollectorRegistry()
    registry.register(_Metrics(models))

    @app.get("/v1/requests/{request_id}/stream")
    async def resume_stream(request: Request, request_id: str) -> Response:
        return resume_response(serving.resume, request_id, request.headers, config.heartbeat_s)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> JSONResponse:
        # Clients probe it before their first request (Claude Code sends `HEAD /`).
        return JSONResponse({"status": "ok", "model": serving.model_name})

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        # /health is open to all: the detail of what broke only for those with the key.
        key = config.api_key
        detail = key is None or has_key(request.headers, key.encode())
        body = models.health(detail=detail)
        return JSONResponse(body, status_code=503 if body["status"] == "unhealthy" else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class _Metrics(Collector):
    """The server's models' metrics (`Models.collect`), as a prometheus_client collector."""

    def __init__(self, models: Models[Any]):
        self.models = models

    def collect(self) -> Iterable[Metric]:
        return self.models.collect()


async def _bug(request: Request, exc: Exception) -> Response:
    """A bug outside the doors' own wrapper (`Serving.handle`): a JSON 500 in the path's shape
    naming an id that its logged traceback carries; no traceback reaches the client."""
    rid = f"err-{uuid.uuid4().hex}"
    log.error("request_failed", request_id=rid, route=request.url.path, exc_info=exc)
    err = internal_error(rid)
    err.request_id = rid
    return error_response(request.url.path, err)


class RequireKey:
    """ASGI middleware: every HTTP request but those to `open_paths` (and paths under
    `open_prefixes`) must carry the key, as `Authorization: Bearer <key>` (OpenAI) or
    `x-api-key: <key>` (Anthropic); 401 otherwise. Under `KEY_PATHS` (/v1/events, which a
    browser's EventSource reads without headers) also as the `stepline_api_key` cookie or
    the `api_key` query parameter. A middleware, not a check in each route, so that no route
    (/docs included) is forgotten."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str,
        open_paths: frozenset[str],
        open_prefixes: tuple[str, ...] = (),
    ):
        self.app = app
        self.key = api_key.encode()
        self.open_paths = open_paths
        self.open_prefixes = open_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_open(scope["path"]) or self._has_key(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(
            401,
            "missing or incorrect API key: send the key the server was started with as "
            "`Authorization: Bearer <key>`",
            code="invalid_api_key",
        )
        await error_response(scope["path"], error)(scope, receive, send)

    def _is_open(self, path: str) -> bool:
        return path in self.open_paths or path.startswith(self.open_prefixes)

    def _has_key(self, scope: Scope) -> bool:
        if has_key(Headers(scope=scope), self.key):
            return True
        if not scope["path"].startswith(KEY_PATHS):
            return False
        request = Request(scope)
        for given in (request.cookies.get(KEY_COOKIE), request.query_params.get(KEY_QUERY)):
            if given and hmac.compare_digest(given.encode(), self.key):
                return True
        return False


def has_key(headers: Headers, key: bytes) -> bool:
    """Whether `headers` carry `key` (`presented_key`)."""
    return hmac.compare_digest(presented_key(headers).encode(), key)
