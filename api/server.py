"""The HTTP app: `create_app` registers every route in one place, with the API-key check,
the OpenAI-style error handlers, and the probes (/health, /metrics).

    POST /v1/chat/completions, POST /v1/completions   (streaming with server-sent events, or not)
    GET  /v1/models, GET /health, GET /metrics

Errors are OpenAI-style `{"error": {"message", "type", "param", "code"}}` bodies. The handlers
live in their own modules (`openai_serving`), running the process in `serve_cmd`.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from stepline.api.errors import APIError
from stepline.api.openai_serving import OpenAIServing

if TYPE_CHECKING:
    from stepline.api.engine import Engine

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a 128k-token conversation is well under 1 MiB
DEFAULT_HEARTBEAT_S = 15.0  # under the 30-60 s idle timeouts of common proxies


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
