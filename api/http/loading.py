"""What `stepline serve` answers before its engine is ready, and each API's error shape
by path: light modules only (the Anthropic SDK, the HTTP app's heaviest import at ~0.9 s,
is imported while the model loads; `serve_cmd`)."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from stepline.api.anthropic.schema import ANTHROPIC
from stepline.api.pipeline.errors import APIError, Wire
from stepline.api.pipeline.sse import OPENAI

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a 128k-token conversation is well under 1 MiB


def wire_of(path: str) -> Wire:
    """The API whose error shape a request to `path` gets, routed or not: Anthropic's under
    /v1/messages (its clients read no other), else OpenAI's."""
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI


def loading_app(what: str) -> ASGIApp:
    """The app that answers while the model loads: /health says 503 `{"status": "loading"}`
    at once, every other route 503 with an error in its API's shape (OpenAI's, Anthropic's
    under /v1/messages)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            response: Response = JSONResponse({"status": "loading", "model": what}, status_code=503)
        else:
            error = APIError(
                503, f"the model is loading ({what}): retry shortly", code="model_loading"
            )
            error.headers["retry-after"] = "1"
            response = wire_of(scope["path"]).error_response(error)
        await response(scope, receive, send)

    return app
