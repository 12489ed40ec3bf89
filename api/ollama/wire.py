"""How the Ollama door writes errors: Ollama's `{"error": "<message>"}` with the status code,
and in a stream (JSON lines) one last line of the same shape, which Ollama's clients raise.
Its streams are JSON lines: no frame numbers, and no keep-alive (an empty line is no JSON)."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response
from pydantic_core import to_json

from stepline.api.pipeline.errors import APIError


class OllamaWire:
    numbered = False
    media_type = "application/x-ndjson"
    ping = None

    def response(self, err: APIError) -> Response:
        headers = dict(err.headers)
        if err.request_id:
            headers["x-request-id"] = err.request_id
        return JSONResponse({"error": err.message}, status_code=err.status_code, headers=headers)

    def frames(self, err: APIError) -> bytes:
        return to_json({"error": err.message}) + b"\n"


OLLAMA = OllamaWire()
