"""OpenAI's request bodies (/v1/chat/completions, /v1/completions), as pydantic models. No MLX,
no engine; responses are built from the `openai` package's own types (`serving`).

Requests are validated in strict mode (a string is not a number, a bool is not an int), as
OpenAI's own API does; fields this server does not know are ignored, so clients that send
newer optional fields keep working. Features the engine cannot honour (n > 1, logit_bias,
...) are refused with an APIError (400) that says so, never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stepline.api.pipeline.audio import audio_url_part, input_audio_part
from stepline.api.pipeline.chat import call_arguments, template_call, unsupported_part
from stepline.api.pipeline.errors import APIError
from stepline.api.pipeline.images import (
    ImageSource,
    content_of,
    image_part,
    joined_content,
    text_part,
)
from stepline.engine.sampling_limits import MAX_INT32

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
    resumable: bool = False  # stepline: a dropped connection may reconnect (api/resume.py)


class ContentPart(BaseModel):
    """One part of a message's content: `text`, `image_url` (its `image_url` an object
    with a `url`, or the URL itself), or `input_audio` (base64 data and its format)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    type: str
    text: str | None = None
    image_url: Any = None  # {"url": ..., "detail": ...}, or the URL (`_image_url`)
    input_audio: Any = None  # {"data": BASE64, "format": "wav"} (`input_audio_part`)
    audio_url: Any = None  # {"url": "data:audio/wav;base64,..."} (`audio_url_part`)


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: OpenAI tool calls
    tool_call_id: str | None = None  # tool: the call this answers
    reasoning_content: str | None = None  # assistant: earlier reasoning (vLLM's extension)


class _SamplingFields(_Request):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None  # None: the model this server serves
    # Every numeric field is bounded here (non-finite numbers are refused by the model config);
    # the bounds that need the model (top_k, stop_token_ids within the vocabulary) are checked
    # where a request becomes SamplingParams (start.Starter.sampling).
    # At most the context's room: clamped to it later (or refused, --strict-max-tokens).
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
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
    # extension (llama.cpp's): the penalties look at the last n tokens; 0 none, -1 all
    repeat_last_n: int | None = Field(None, ge=-1, le=MAX_INT32)
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
    parallel_tool_calls: bool = True
    functions: Any = None
    function_call: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM's): template arguments
    reasoning_effort: str | None = None  # passed to templates that read it, refused otherwise

    def check_supported(self) -> None:
        """Raise APIError for a feature this server does not implement."""
        if self.n is not None and self.n > 1:
            raise APIError(
                400,
                f"n={self.n} is not supported: this server returns one choice per request; "
                "send n separate requests (with different seeds) instead",
                param="n",
                code="unsupported_parameter",
            )
        if self.functions or self.function_call is not None:
            raise APIError(
                400,
                "the legacy `functions`/`function_call` are not supported: send `tools` and "
                "`tool_choice` instead",
                param="functions" if self.functions else "function_call",
                code="unsupported_parameter",
            )
        if self.logit_bias:
            raise APIError(
                400,
                "logit_bias is not supported by this server: remove it",
                param="logit_bias",
                code="unsupported_parameter",
            )
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400,
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

    @property
    def resumable(self) -> bool:
        return self.stream_options is not None and self.stream_options.resumable


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token for the engine: None = no logprobs at all."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def engine_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template wants them: `developer` as `system`,
        consecutive same-role messages merged (strict templates demand alternation),
        assistant `tool_calls` and `tool` messages (with their `tool_call_id`) kept as they
        are. Content is a string, or where a message has images its parts in order
        (`images.content_of`), each image a placeholder until `resolve_images`.

        Raises APIError for content parts that are neither text nor images, and missing
        content.
        """
        merged: list[dict[str, Any]] = []
        contents: dict[int, list[Any]] = {}  # merged message index -> the contents it merges
        for i, m in enumerate(self.messages):
            if m.role == "function":
                raise APIError(
                    400,
                    f"messages[{i}]: legacy `function` messages are not supported: send `tool` "
                    "messages with a tool_call_id",
                    param=f"messages.{i}",
                    code="unsupported_parameter",
                )
            role = "system" if m.role == "developer" else m.role
            if m.role == "assistant" and (m.tool_calls or m.reasoning_content):
                message: dict[str, Any] = {"role": role, "content": _optional_content(m.content, i)}
                if m.tool_calls:
                    message["tool_calls"] = _tool_calls(m.tool_calls, i)
                if m.reasoning_content:
                    message["reasoning_content"] = m.reasoning_content
                merged.append(message)
                continue
            content = _content(m.content, i)
            if m.role == "tool":
                merged.append({"role": "tool", "content": content, "tool_call_id": m.tool_call_id})
            elif merged and merged[-1]["role"] == role and set(merged[-1]) == {"role", "content"}:
                contents.setdefault(len(merged) - 1, [merged[-1]["content"]]).append(content)
            else:
                merged.append({"role": role, "content": content})
        for at, parts in contents.items():  # joined once: appending in the loop was quadratic
            merged[at]["content"] = joined_content(parts, "\n\n")
        return merged


def _optional_content(content: str | list[ContentPart] | None, index: int) -> Any:
    return "" if content is None else _content(content, index)


def _tool_calls(calls: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """Assistant tool calls with their arguments parsed, as chat templates render them."""
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(
                400,
                f"messages[{index}].tool_calls[{j}] needs function.name and function.arguments",
                param=f"messages.{index}.tool_calls.{j}",
            )
        param = f"messages.{index}.tool_calls.{j}.function.arguments"
        args = call_arguments(fn.get("arguments", "{}"), param)
        out.append(template_call(call.get("id"), fn["name"], args))
    return out


def _content(content: str | list[ContentPart] | None, index: int) -> Any:
    where = f"messages.{index}.content"
    if content is None:
        raise APIError(
            400,
            f"messages[{index}].content is missing: send a string or a list of text parts",
            param=where,
        )
    if isinstance(content, str):
        return content
    return content_of([_part(part, f"{where}.{j}") for j, part in enumerate(content)])


def _part(part: ContentPart, where: str) -> dict[str, Any]:
    """A content part in neutral form: text, or an image's placeholder."""
    if part.type == "text" and part.text is not None:
        return text_part(part.text)
    if part.type == "image_url":
        return image_part(ImageSource(where, url=_image_url(part.image_url, where)))
    if part.type == "input_audio":
        return input_audio_part(part.input_audio, where)
    if part.type == "audio_url":  # mlx-vlm's and vLLM's servers take these too
        return audio_url_part(part.audio_url, where)
    raise unsupported_part(
        where, part.type, "'text' (with a 'text'), 'image_url', 'input_audio' and 'audio_url'"
    )


def _image_url(value: Any, where: str) -> str:
    """The URL of an `image_url` part: `{"url": ..., "detail": ...}` (detail accepted: the
    model sees the image it has), or the URL itself. Raises APIError for anything else."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise APIError(
            400,
            f'{where}.image_url must be {{"url": "data:image/png;base64,..."}} (or an http(s) URL)',
            param=f"{where}.image_url",
        )
    return url


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of > 1:
            raise APIError(
                400,
                "best_of > 1 is not supported: send separate requests instead",
                param="best_of",
                code="unsupported_parameter",
            )
        if self.echo:
            raise APIError(
                400,
                "echo is not supported: the prompt is not returned",
                param="echo",
                code="unsupported_parameter",
            )
        if self.suffix:
            raise APIError(
                400,
                "suffix (fill-in-the-middle) is not supported",
                param="suffix",
                code="unsupported_parameter",
            )

    def engine_prompt(self) -> str | list[int]:
        """The one prompt as text or token ids. Raises APIError for a batch of prompts."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise APIError(400, "prompt is empty: send a string or token ids", param="prompt")
        if isinstance(p[0], int):
            return list(p)  # type: ignore[arg-type]
        if len(p) > 1:
            raise APIError(
                400,
                f"prompt is a batch of {len(p)} prompts: send one prompt per request",
                param="prompt",
                code="unsupported_parameter",
            )
        return p[0]  # type: ignore[return-value]


class EmbeddingRequest(_Request):
    """/v1/embeddings: `input` a text, texts, token ids or lists of them; `encoding_format`
    float or base64 (little-endian float32, as the `openai` client decodes it);
    `dimensions`: the vectors cut to that many numbers and normalised again."""

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    def check_supported(self) -> None:
        return None

    def inputs(self) -> list[str | list[int]]:
        """Each input on its own: a text, or one input's token ids."""
        raw = self.input
        if isinstance(raw, str):
            return [raw]
        if raw and all(isinstance(x, int) for x in raw):
            return [list(raw)]  # type: ignore[arg-type]
        return list(raw)  # type: ignore[arg-type]


class RerankDocument(_Request):
    text: str


class RerankRequest(_Request):
    """/v1/rerank and /rerank (Cohere's and Jina's shape): `documents` as texts or objects
    with a `text`; `top_n` (default: all) of them back, most relevant first, with their text
    where `return_documents`; `instruction` (stepline's) replaces the reranker's default
    task description."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = False
    instruction: str | None = None
    user: str | None = None

    def check_supported(self) -> None:
        return None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]
