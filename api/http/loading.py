"""What `stepline serve` answers before its engine is ready: light modules only (the HTTP
app's own, the Anthropic and OpenAI SDKs among them, import while the model loads;
`serve`)."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from stepline.api.http.doors import error_response
from stepline.api.pipeline.errors import APIError


def loading_app(what: str) -> ASGIApp:
    """The app that answers while the model loads: /health says 503 `{"status": "loading"}`
    at once, every other route 503 with an error in its door's shape."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            response: Response = JSONResponse({"status": "loading", "model": what}, status_code=503)
        else:
            error = APIError(
                503,
                f"the model is loading ({what}): retry shortly",
                code="model_loading",
                headers={"retry-after": "1"},
            )
            response = error_response(scope["path"], error)
        await response(scope, receive, send)

    return app
