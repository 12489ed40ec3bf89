"""The OpenAI Responses API's bodies: the create request (`ResponsesRequest`), the response
object (`ResponseObject`) and the stream's events (`event_frame`).

Text in, text out: `input` is a string or a list of messages (`content` a string or
`input_text`/`output_text` parts); structured output with `text.format` (`json_schema`,
`json_object`); `tools` are refused with a 400 that says so.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_json

from stepline.api.openai_schema import RequestError

Status = Literal["queued", "in_progress", "completed", "failed", "cancelled", "incomplete"]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


class InputPart(_Request):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Request):
    format: TextFormat = Field(default_factory=lambda: TextFormat.model_validate({}))


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None  # stepline: reproducible sampling
    ignore_eos: bool = False  # stepline: generate max_output_tokens whatever the model says
    stream: bool = False
    background: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    tools: list[dict[str, Any]] | None = None
    text: TextOptions | None = None

    def check_supported(self) -> None:
        """Raises RequestError for what this server does not do."""
        if self.tools:
            raise RequestError(
                "tools are not supported on /v1/responses by this server yet: use "
                "/v1/chat/completions for function calling",
                param="tools",
                code="unsupported_parameter",
            )
        fmt = self.text_format
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise RequestError(
                "text.format.schema must be a JSON schema object, as in "
                '{"type": "json_schema", "name": ..., "schema": {...}}',
                param="text.format.schema",
            )
        if self.background and not self.store:
            raise RequestError(
                "a background response must be stored: drop `store: false`",
                param="store",
                code="invalid_value",
            )

    @property
    def text_format(self) -> TextFormat | None:
        return None if self.text is None else self.text.format

    def messages(self) -> list[dict[str, str]]:
        """`input` as chat messages (developer messages become system ones)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.input
        ]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    content: list[OutputText] = []


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int

    @classmethod
    def of(cls, num_prompt: int, num_output: int, num_cached: int) -> ResponseUsage:
        return cls(
            input_tokens=num_prompt,
            input_tokens_details=InputTokensDetails(cached_tokens=num_cached),
            output_tokens=num_output,
            total_tokens=num_prompt + num_output,
        )


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """The response as `retrieve` returns it and the stream's lifecycle events carry it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Status
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage] = []
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str = "auto"
    tools: list[Any] = []
    text: dict[str, Any] = {"format": {"type": "text"}}
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = {}
    store: bool = True

    @property
    def output_text(self) -> str:
        return "".join(c.text for m in self.output for c in m.content)


def event_frame(event_type: str, sequence_number: int, **fields: Any) -> bytes:
    """One stream event: `event: <type>` and its JSON (its `sequence_number` included)."""
    body = {"type": event_type, "sequence_number": sequence_number}
    for name, value in fields.items():
        body[name] = value.model_dump() if isinstance(value, BaseModel) else value
    return b"event: " + event_type.encode() + b"\ndata: " + to_json(body) + b"\n\n"
