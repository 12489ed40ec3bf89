"""OpenAI's request and response bodies, as pydantic models. No MLX, no engine.

Requests are validated in strict mode (a string is not a number, a bool is not an int), as
OpenAI's own API does; fields this server does not know are ignored, so clients that send
newer optional fields keep working. Features the engine cannot honour (n > 1, tools,
response_format, ...) are refused with a RequestError that says so, never silently ignored.

Responses dump to exactly OpenAI's shapes: `null` where OpenAI sends null, and a streaming
`delta` that holds only the keys that changed.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer


class RequestError(ValueError):
    """A request the server refuses with 400; the message says what to change."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


# -- requests -------------------------------------------------------------------------------


MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_STOP = 64  # stop strings, and stop token ids, per request
# A stop string is never empty: "" would match before every token.
StopString = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]


class _Request(BaseModel):
    # allow_inf_nan=False: a non-finite number is a 400 even if it got past the JSON parser.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(BaseModel):
    """One part of a message's content; only `text` parts are served (text-only models)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any = None


class _SamplingFields(_Request):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None  # None: the model this server serves
    # Every numeric field is bounded here (non-finite numbers are refused by the model config);
    # the bounds that need the model (top_k, stop_token_ids within the vocabulary) are checked
    # where a request becomes SamplingParams (serving.Serving.sampling).
    max_tokens: int | None = Field(None, ge=1)  # and at most the context's room: checked later
    # 0 = greedy, and so is anything below 1e-5 (dividing logits by ~0 overflows).
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extension; -1 or 0 = off (vLLM's convention too)
    min_p: float | None = Field(None, ge=0.0, lt=1.0)  # extension
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None  # ext.
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)  # extension
    ignore_eos: bool = False  # extension: always generate max_tokens (benchmarks)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = Field(None, ge=1)
    # Accepted only at their no-op values, refused otherwise (see `check_supported`).
    logit_bias: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None

    def check_supported(self) -> None:
        """Raise RequestError for a feature this server does not implement."""
        if self.n is not None and self.n > 1:
            raise RequestError(
                f"n={self.n} is not supported: this server returns one choice per request; "
                "send n separate requests (with different seeds) instead",
                param="n",
                code="unsupported_parameter",
            )
        if self.tools or self.functions:
            param = "tools" if self.tools else "functions"
            raise RequestError(
                "tool calling is not supported by this server: remove `tools`/`functions`",
                param=param,
                code="unsupported_parameter",
            )
        for param in ("tool_choice", "function_call"):
            value = getattr(self, param)
            if value is not None and value != "none":
                raise RequestError(
                    f"{param}={value!r} is not supported: this server does no tool calling",
                    param=param,
                    code="unsupported_parameter",
                )
        rf = self.response_format
        if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
            raise RequestError(
                "response_format is not supported (no JSON mode or structured output): "
                'remove it or send {"type": "text"}',
                param="response_format",
                code="unsupported_parameter",
            )
        if self.logit_bias:
            raise RequestError(
                "logit_bias is not supported by this server: remove it",
                param="logit_bias",
                code="unsupported_parameter",
            )
        if self.stream_options is not None and not self.stream:
            raise RequestError(
                "stream_options is only allowed when stream is true",
                param="stream_options",
            )

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token for the engine: None = no logprobs at all."""
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def engine_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template wants them: string content, `developer` as
        `system`, consecutive same-role messages merged (strict templates demand alternation).

        Raises RequestError for tool messages, non-text content parts and empty content.
        """
        merged: list[dict[str, str]] = []
        for i, m in enumerate(self.messages):
            if m.role in ("tool", "function") or m.tool_calls:
                raise RequestError(
                    f"messages[{i}]: tool messages and tool calls are not supported by this "
                    "server (no tool calling)",
                    param=f"messages.{i}",
                    code="unsupported_parameter",
                )
            role = "system" if m.role == "developer" else m.role
            content = _text_content(m.content, i)
            if merged and merged[-1]["role"] == role:
                merged[-1] = {"role": role, "content": merged[-1]["content"] + "\n\n" + content}
            else:
                merged.append({"role": role, "content": content})
        return merged


def _text_content(content: str | list[ContentPart] | None, index: int) -> str:
    if content is None:
        raise RequestError(
            f"messages[{index}].content is missing: send a string or a list of text parts",
            param=f"messages.{index}.content",
        )
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise RequestError(
                f"messages[{index}].content[{j}] has type {part.type!r}: this server serves "
                "a text-only model, send only parts of type 'text' with a 'text' field",
                param=f"messages.{index}.content.{j}",
                code="unsupported_content_type",
            )
        texts.append(part.text)
    return "\n".join(texts)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of > 1:
            raise RequestError(
                "best_of > 1 is not supported: send separate requests instead",
                param="best_of",
                code="unsupported_parameter",
            )
        if self.echo:
            raise RequestError(
                "echo is not supported: the prompt is not returned",
                param="echo",
                code="unsupported_parameter",
            )
        if self.suffix:
            raise RequestError(
                "suffix (fill-in-the-middle) is not supported",
                param="suffix",
                code="unsupported_parameter",
            )

    def engine_prompt(self) -> str | list[int]:
        """The one prompt as text or token ids. Raises RequestError for a batch of prompts."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise RequestError("prompt is empty: send a string or token ids", param="prompt")
        if isinstance(p[0], int):
            return list(p)  # type: ignore[arg-type]
        if len(p) > 1:
            raise RequestError(
                f"prompt is a batch of {len(p)} prompts: send one prompt per request",
                param="prompt",
                code="unsupported_parameter",
            )
        return p[0]  # type: ignore[return-value]


# -- responses ------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(frozen=True)


def now() -> int:
    return int(time.time())


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, num_prompt: int, num_completion: int, num_cached: int) -> Usage:
        return cls(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
        )


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob]


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Response):
    """Only the keys that changed: `{"role": ..., "content": ""}`, `{"content": ...}`, `{}`."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # sent (as null until the last chunk) only with include_usage


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "stepline"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorDetail
