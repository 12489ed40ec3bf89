"""The error catalogue: what went wrong with a request, as its client is told.

`APIError` is the one exception a door, the pipeline or a schema raises for a request it
cannot serve: an HTTP status, a message that says what to change, the request field it
concerns (`param`) and a stable `code`. What the engine raises (a prompt past the context, a
full queue, a dead executor, a grammar that does not compile, ...) becomes one in one place,
`api_error`; the messages that more than one place needs are written once, below.

A `Wire` is how one API writes an error: a whole response (`response`) or a stream's last
frames (`frames`). Each wire format does that in exactly one place; OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, is the server's default (probes, unknown
routes, the OpenAI and Responses doors). No engine here: light enough for the app that
answers while the model loads.
"""

from __future__ import annotations

import math
from typing import Protocol

import structlog
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from pydantic_core import to_json

log = structlog.get_logger(__name__)


class APIError(Exception):
    """A request the server refuses or could not finish: `status_code` and what to tell the
    client. `type` is OpenAI's error type (by default from the status)."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status_code < 500 else "server_error")
        self.headers: dict[str, str] = dict(headers or {})  # e.g. Retry-After
        self.request_id: str | None = None


class Wire(Protocol):
    """How one API writes an error (see the module docstring)."""

    numbered: bool  # its streams' frames carry `id: N` even when not resumable
    media_type: str  # of its streams
    ping: bytes | None  # what keeps an idle stream alive (None: nothing can)

    def response(self, err: APIError) -> Response: ...

    def frames(self, err: APIError) -> bytes: ...


# -- the catalogue ---------------------------------------------------------------------------


def internal_error(rid: str | None, code: str = "server_error") -> APIError:
    """A bug or an engine fault: the client gets the request id; the detail is in the log."""
    where = f" (request id {rid})" if rid else ""
    return APIError(500, f"internal error{where}", code=code)


def client_closed() -> APIError:
    return APIError(499, "the client closed the connection", code="client_closed")


def body_too_large(limit: int) -> APIError:
    """A body past the server's limit (`max_body_bytes`): by its length, or as it arrives."""
    return APIError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes",
        code="request_too_large",
    )


def shutting_down(what: str = "the server is shutting down") -> APIError:
    return APIError(503, what, code="shutting_down")


def cut_by_shutdown() -> APIError:
    """The server stopped while the request ran: its stream's last frames say so."""
    return shutting_down("the server shut down before the request finished")


def engine_unhealthy(rid: str | None = None) -> APIError:
    where = f" (request id {rid})" if rid else ""
    return APIError(
        503,
        f"the engine failed and can serve no request until it is restarted{where}",
        code="engine_unhealthy",
    )


def grammar_failed(error: str, rid: str | None) -> APIError:
    """A request whose structured output's grammar failed mid-generation (`error`: what the
    engine said, the limit its schema hit): its output so far is no whole document."""
    where = f" (request id {rid})" if rid else ""
    return APIError(
        400,
        f"{error}; the output was cut there: simplify the schema (fewer alternatives, shorter "
        f"counted repetitions){where}",
        code="grammar_failed",
    )


SHOWN_NAME_CHARS = 256  # of a name a client sent, quoted back in an error (and in the logs)


def shown_name(name: str) -> str:
    """`name` quoted, cut to `SHOWN_NAME_CHARS` characters: a name echoed whole would make a
    3 MB reply of a 3 MB name, and 3 MB lines in the logs."""
    if len(name) <= SHOWN_NAME_CHARS:
        return repr(name)
    return f"{name[:SHOWN_NAME_CHARS]!r}... ({len(name):,} characters)"


def model_not_found(name: str, served: str | None = None) -> APIError:
    """404 for a `model` no served model is called (`served`: the names there are)."""
    there = f": this server serves {served} (see GET /v1/models)" if served else ""
    return APIError(
        404,
        f"The model {shown_name(name)} does not exist{there}",
        param="model",
        code="model_not_found",
    )


def context_exceeded(num_prompt: int, max_context: int, param: str, *, at_least: bool) -> APIError:
    """A prompt that does not fit the model's context (`at_least`: a lower bound, counted
    without tokenizing it)."""
    count = f"at least {num_prompt}" if at_least else str(num_prompt)
    return APIError(
        400,
        f"This model's maximum context length is {max_context} tokens, but the prompt has "
        f"{count} tokens: shorten the prompt (at most {max_context - 1} tokens, so one token "
        "can be generated)",
        param=param,
        code="context_length_exceeded",
    )


def validation_error(exc: ValidationError) -> APIError:
    """The 400 for a body (or parameters) that fail validation, naming the first bad field."""
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json")
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and _is_type_tag(p))]
    param = ".".join(loc) or None
    where = f"{param}: " if param else "the body: "
    return APIError(400, f"{where}{err['msg']}", param=param, code="invalid_value")


def _is_type_tag(part: str) -> bool:
    # pydantic puts union branches in `loc` ("str", "list[ContentPart]"); they are no param.
    return "[" in part or part in {"str", "int", "float", "bool", "none"} or "-" in part


def known_error(
    exc: BaseException, *, prompt_param: str = "messages", grammar_param: str = "response_format"
) -> APIError | None:
    """`exc`, raised anywhere under a door, as what the client is told; None for what the
    catalogue does not know (a bug: the caller lets it through, and it is a 500 logged with
    its traceback). Only the explicit types below are the client's fault (a 4xx): a plain
    ValueError is not (a client error is raised as `RequestError`).
    `prompt_param` and `grammar_param` name the request's fields that hold its prompt and its
    output format."""
    # Imported here: the engine's modules are not loaded while the model loads.
    from stepline.actors.scheduler.admission import (
        AdmissionError,
        ContextLengthExceededError,
        QueueFullError,
    )
    from stepline.actors.step_loop import EngineDeadError
    from stepline.api.engine import EngineClosedError
    from stepline.api.json_limits import InputLimitError
    from stepline.api.pipeline.images import ImagesBusyError
    from stepline.api.prompts import PromptTooLongError
    from stepline.api.refusals import REFUSAL_STATUS
    from stepline.api.request_error import RequestError
    from stepline.engine.grammar import GrammarError
    from stepline.engine.media import MediaError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthExceededError):
        at_least = isinstance(exc, PromptTooLongError)
        return context_exceeded(
            exc.num_prompt_tokens, exc.max_context, prompt_param, at_least=at_least
        )
    if isinstance(exc, QueueFullError):
        retry_after = max(1, math.ceil(exc.retry_after_s))
        busy = (
            f"you have {exc.num_waiting} requests waiting, the most one client may have: the "
            "rest of the server's queue is kept for other clients"
            if exc.per_client
            else f"the server is busy ({exc.num_waiting} requests waiting, at most "
            f"{exc.max_waiting})"
        )
        return APIError(
            REFUSAL_STATUS[exc.refusal],
            f"{busy}: retry after {retry_after} s",
            type="rate_limit_error",
            code=exc.refusal.value,
            headers={"retry-after": str(retry_after)},
        )
    if isinstance(exc, EngineDeadError):
        log.error("request_refused", reason=str(exc))
        return engine_unhealthy()
    if isinstance(exc, EngineClosedError):
        return shutting_down()
    if isinstance(exc, GrammarError):  # a schema llguidance cannot compile
        return APIError(400, str(exc), param=grammar_param, code="invalid_schema")
    if isinstance(exc, ImagesBusyError):  # the server's pixel budget stayed full
        retry_after = max(1, math.ceil(exc.retry_after_s))
        return APIError(
            429,
            f"{exc}: retry after {retry_after} s",
            param=exc.param,
            type="rate_limit_error",
            code="images_busy",
            headers={"retry-after": str(retry_after)},
        )
    if isinstance(exc, MediaError):  # an image or a clip: corrupt, too large, too many, no encoder
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, InputLimitError):
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, ValidationError):
        return validation_error(exc)
    if isinstance(exc, AdmissionError):  # an empty prompt, KV that can never fit
        return APIError(400, str(exc), param=prompt_param)
    if isinstance(exc, RequestError):  # a bad token id, a template that refused the messages
        param = exc.param or prompt_param
        return APIError(400, f"{param}: {exc}", param=param)
    return None  # any other ValueError too: a bug, not the client's fault


# -- OpenAI's shape, the server's default ----------------------------------------------------


def _openai_body(err: APIError) -> dict:
    return {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }


class OpenAIWire:
    """OpenAI's errors: `{"error": {...}}` bodies; in a stream, an error event then `[DONE]`."""

    numbered = True
    media_type = "text/event-stream"
    ping = b": ping\n\n"

    def response(self, err: APIError) -> Response:
        headers = dict(err.headers)
        if err.request_id:
            headers["x-request-id"] = err.request_id
        return JSONResponse(_openai_body(err), status_code=err.status_code, headers=headers)

    def frames(self, err: APIError) -> bytes:
        return b"data: " + to_json(_openai_body(err)) + b"\n\ndata: [DONE]\n\n"


OPENAI = OpenAIWire()
