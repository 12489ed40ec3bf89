"""How the Anthropic door writes errors: Anthropic's `{"type": "error", "error": {"type",
"message"}}` body, and in a stream its `error` event (no [DONE]: Anthropic streams have none).
Its streams are numbered only when resumable: unasked, the framing is Anthropic's own."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, Response
from pydantic_core import to_json

from stepline.api.pipeline.errors import APIError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def event(name: str, payload: dict[str, Any]) -> bytes:
    """One Anthropic server-sent event: `event: <name>` and its JSON data."""
    return b"event: " + name.encode() + b"\ndata: " + to_json(payload) + b"\n\n"


def _body(err: APIError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(err.status_code, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


class AnthropicWire:
    numbered = False
    media_type = "text/event-stream"
    ping = b": ping\n\n"

    def response(self, err: APIError) -> Response:
        headers = dict(err.headers)  # e.g. retry-after
        if err.request_id:
            headers["request-id"] = headers["x-request-id"] = err.request_id
        return JSONResponse(_body(err), status_code=err.status_code, headers=headers)

    def frames(self, err: APIError) -> bytes:
        return event("error", _body(err))


ANTHROPIC = AnthropicWire()
