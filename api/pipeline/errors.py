"""Errors at the HTTP edge: `APIError`, answered in the shape of the API that was called (a
`Wire`: OpenAI's by default) with its status code, and the conversions from the errors
beneath it (pydantic validation, context length)."""

from __future__ import annotations

from typing import Protocol

from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from stepline.api.openai.schema import ErrorDetail, ErrorResponse
from stepline.engine.policy import ContextLengthExceededError


class APIError(Exception):
    """An error the server answers with an OpenAI-style body and `status_code`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.detail = ErrorDetail(
            message=message,
            type=type or ("invalid_request_error" if status_code < 500 else "server_error"),
            param=param,
            code=code,
        )
        self.request_id: str | None = None
        self.headers: dict[str, str] = {}  # e.g. Retry-After

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.request_id:
            headers["x-request-id"] = self.request_id
        body = ErrorResponse(error=self.detail).model_dump()
        return JSONResponse(body, status_code=self.status_code, headers=headers)


class Wire(Protocol):
    """How one API writes an error: as a whole response, and as a stream's last frames (the
    one error wrapper, `Serving.handle`, and every stream writer use it)."""

    numbered: bool  # its streams' frames carry `id: N` even when not resumable

    def error_response(self, err: APIError) -> Response: ...

    def error_frames(self, err: APIError) -> bytes: ...


def _is_type_tag(part: str) -> bool:
    # pydantic puts union branches in `loc` ("str", "list[ContentPart]"); they are no param.
    return "[" in part or part in {"str", "int", "float", "bool", "none"} or "-" in part


def validation_error(exc: ValidationError) -> APIError:
    """The 400 for a body that fails validation, naming the first bad field."""
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json")
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and _is_type_tag(p))]
    param = ".".join(loc) or None
    where = f"{param}: " if param else "the body: "
    return APIError(400, f"{where}{err['msg']}", param=param, code="invalid_value")


def context_error(exc: ContextLengthExceededError, param: str) -> APIError:
    """The 400 for a prompt that does not fit the model's context."""
    return APIError(
        400,
        f"This model's maximum context length is {exc.max_context} tokens, but the prompt has "
        f"{exc.num_prompt_tokens} tokens: shorten the prompt (at most {exc.max_context - 1} "
        "tokens, so one token can be generated)",
        param=param,
        code="context_length_exceeded",
    )
