"""Ollama's request bodies (`/api/chat`, `/api/generate`, `/api/show`) as pydantic models, and
their translation to what the pipeline takes. No MLX, no engine.

`options` are mapped to sampling: `num_predict` (-1 or -2: as far as the context goes; left
out: the model's default cap), `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`,
`presence_penalty`, `frequency_penalty`, `repeat_penalty`, `repeat_last_n` (the penalties
look at the context's last n tokens; 0: none, -1: all of `num_ctx`); what a request leaves
out is the model's
default, else Ollama's `DefaultOptions` (api/ollama/serving.py). `num_ctx` is the request's
context (prompt and answer), at most the model's here. The options that tune Ollama's runtime
(`num_gpu`, `num_thread`, ...) change no answer here and are accepted; sampling this engine
does not do (`mirostat`,
`typical_p`, `tfs_z` past their neutral values) is a 400 naming the option. `format` is
`"json"` (any JSON object) or a JSON schema; `keep_alive` (seconds, or a duration such as
"5m"; negative: forever) is how long the model stays loaded once idle, in a server of several
models (one `--model` is never unloaded); `images` (base64, before the message's text) go
to a model that reads images; a Go `template`, `suffix` and the deprecated `context` are
refused.
`stream` is true unless the request says false, as Ollama's own server does.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stepline.api.pipeline.chat import call_arguments, template_call
from stepline.api.pipeline.errors import APIError
from stepline.api.pipeline.images import ImageSource, content_of, image_part, text_part
from stepline.engine.sampling_limits import MAX_INT32, MAX_REPETITION_PENALTY


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


StopString = Annotated[str, Field(min_length=1)]


class Options(_Request):
    num_predict: int | None = Field(None, ge=-2, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, lt=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: list[StopString] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repeat_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)
    repeat_last_n: int | None = Field(None, ge=-1, le=MAX_INT32)  # 0: none, -1: num_ctx
    num_ctx: int | None = Field(None, ge=1, le=MAX_INT32)
    # Sampling this engine does not do: refused past their neutral values (`check`).
    mirostat: int | None = None
    typical_p: float | None = None
    tfs_z: float | None = None

    def check(self) -> None:
        for name, neutral in (("mirostat", 0), ("typical_p", 1.0), ("tfs_z", 1.0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise APIError(
                    400,
                    f"options.{name} is not supported by this server: remove it (or set it to "
                    f"{neutral})",
                    param=f"options.{name}",
                    code="unsupported_parameter",
                )


NO_OPTIONS = Options.model_validate({})


class OllamaRequest(_Request):
    """What /api/chat and /api/generate share."""

    model: str = Field(min_length=1)
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: float | str | None = None  # `kept_for`
    think: bool | str | None = None

    @field_validator("model")
    @classmethod
    def _default_tag(cls, v: str) -> str:
        return v.removesuffix(":latest")  # Ollama's names default to the `latest` tag

    def check_supported(self) -> None:
        if self.options is not None:
            self.options.check()
        self.kept_for()
        if isinstance(self.format, str) and self.format not in ("", "json"):
            raise APIError(400, 'format must be "json" or a JSON schema object', param="format")

    @property
    def opts(self) -> Options:
        return self.options or NO_OPTIONS

    # The sampling fields by their engine names (`Starter.sampling`).
    @property
    def temperature(self) -> float | None:
        return self.opts.temperature

    @property
    def top_p(self) -> float | None:
        return self.opts.top_p

    @property
    def top_k(self) -> int | None:
        return self.opts.top_k

    @property
    def min_p(self) -> float | None:
        return self.opts.min_p

    @property
    def seed(self) -> int | None:
        return self.opts.seed

    @property
    def presence_penalty(self) -> float | None:
        return self.opts.presence_penalty

    @property
    def frequency_penalty(self) -> float | None:
        return self.opts.frequency_penalty

    @property
    def repetition_penalty(self) -> float | None:
        return self.opts.repeat_penalty

    @property
    def repeat_last_n(self) -> int | None:
        return self.opts.repeat_last_n

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.opts.stop or ())

    @property
    def max_tokens(self) -> int | None:
        n = self.opts.num_predict
        return n if n is not None and n > 0 else None

    @property
    def whole_context(self) -> bool:
        """`num_predict` -1 (Ollama: no limit) or -2 (fill the context): as far as the
        context goes."""
        return self.opts.num_predict in (-1, -2)

    def kept_for(self) -> float | None:
        """`keep_alive` in seconds: None when it is not given, math.inf for forever (a negative
        one, as in Ollama). Raises APIError for one that is no duration."""
        value = self.keep_alive
        if value is None:
            return None
        seconds = value if isinstance(value, int | float) else _duration(value)
        if seconds is None:
            raise APIError(
                400,
                f'keep_alive must be seconds or a duration such as "5m" or "1h30m", got {value!r}',
                param="keep_alive",
            )
        return math.inf if seconds < 0 else float(seconds)

    def answer_format(self) -> tuple[dict[str, Any] | None, bool]:
        """(JSON schema, any JSON object) of `format`."""
        if isinstance(self.format, dict):
            return self.format, False
        return None, self.format == "json"

    def thinking(self) -> bool | None:
        """Whether to think (`think`: a bool, or a level such as "high"), None: as the model
        does by default."""
        if self.think is None:
            return None
        return self.think is not False


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def _duration(text: str) -> float | None:
    """A Go duration ("5m", "1h30m", "-1s") or a number of seconds ("300"), in seconds;
    None for anything else."""
    text = text.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    try:
        return sign * float(body)
    except ValueError:
        pass
    parts = _DURATION.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        return None
    return sign * sum(float(n) * _UNITS[u] for n, u in parts)


class ToolCallFunction(_Request):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ToolCall(_Request):
    function: ToolCallFunction


class Message(_Request):
    role: str
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None  # base64
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class ChatRequest(OllamaRequest):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    def engine_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates render them: an assistant's calls with their
        arguments parsed (text that is not JSON kept as it was), a tool's answer with the
        name of its tool, a message's `images` as parts before its text (`with_images`).
        Raises APIError for unknown roles."""
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            if m.role not in ("system", "user", "assistant", "tool"):
                raise APIError(
                    400,
                    f"messages[{i}].role must be system, user, assistant or tool, got {m.role!r}",
                    param=f"messages.{i}.role",
                )
            content = with_images(m.content or "", m.images, f"messages.{i}.images")
            message: dict[str, Any] = {"role": m.role, "content": content}
            if m.role == "assistant" and m.tool_calls:
                message["tool_calls"] = [
                    template_call(
                        None,
                        c.function.name,
                        call_arguments(
                            c.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments"
                        ),
                    )
                    for j, c in enumerate(m.tool_calls)
                ]
            if m.role == "assistant" and m.thinking:
                message["reasoning_content"] = m.thinking
            if m.role == "tool" and m.tool_name:
                message["name"] = m.tool_name
            out.append(message)
        return out


class GenerateRequest(OllamaRequest):
    prompt: str = ""
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None  # base64, for the prompt (not with `raw`)

    def check_supported(self) -> None:
        super().check_supported()
        refused = (
            ("images", bool(self.images) and self.raw, "a raw prompt holds text only"),
            ("suffix", bool(self.suffix), "fill-in-the-middle is not supported"),
            ("template", bool(self.template), "the model's own (Jinja) chat template is used"),
            ("context", bool(self.context), "send the conversation to /api/chat instead"),
        )
        for name, given, why in refused:
            if given:
                raise APIError(
                    400, f"{name} is not supported: {why}", param=name, code="unsupported_parameter"
                )

    def engine_input(self) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(raw prompt, chat messages): the prompt as is with `raw`, else as a user turn
        after the `system` prompt, rendered by the chat template."""
        if self.raw:
            return self.prompt, None
        system = [{"role": "system", "content": self.system}] if self.system else []
        prompt = with_images(self.prompt, self.images, "images")
        return None, [*system, {"role": "user", "content": prompt}]


def with_images(text: str, images: list[str] | None, where: str) -> Any:
    """A message's content: its `text`, after its base64 `images` (placeholders until
    `resolve_images`) if it has any."""
    if not images:
        return text
    parts = [image_part(ImageSource(f"{where}.{j}", data=data)) for j, data in enumerate(images)]
    return content_of([*parts, text_part(text)])


class _NamedModel(_Request):
    """A body that names a model: `model` (`name` in older clients), ":latest" implied."""

    model: str = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _older_spelling(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model" not in data and "name" in data:
            return {**data, "model": data["name"]}
        return data

    @field_validator("model")
    @classmethod
    def _default_tag(cls, v: str) -> str:
        return v.removesuffix(":latest")

    def check_supported(self) -> None:
        pass


class ModelRequest(_NamedModel):
    """/api/pull's and /api/delete's body: the model (`name` in older clients)."""

    stream: bool = True


class ShowRequest(_NamedModel):
    verbose: bool = False


class EmbedRequest(_Request):
    """/api/embed: `input` a text or texts; `truncate` (true unless false): a text past the
    context is cut to fit, else refused; `dimensions`: the vectors cut to that many numbers
    and normalised again. `options` and `keep_alive` are accepted and change nothing here."""

    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    options: dict[str, Any] | None = None
    keep_alive: Any = None

    def check_supported(self) -> None:
        return None

    @field_validator("model")
    @classmethod
    def _default_tag(cls, v: str) -> str:
        return v.removesuffix(":latest")

    def inputs(self) -> list[str | list[int]]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class EmbeddingsRequest(_Request):
    """/api/embeddings, the older one: one `prompt`, cut to the context if it is longer."""

    model: str = Field(min_length=1)
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: Any = None

    def check_supported(self) -> None:
        return None

    @field_validator("model")
    @classmethod
    def _default_tag(cls, v: str) -> str:
        return v.removesuffix(":latest")
