"""The OpenAI Responses API's create request (`ResponsesRequest`); the response object and
its stream events are the `openai` package's own types (`output`).

`input` is a string or a list of items: messages (`content` a string or
`input_text`/`output_text` parts, and `input_image` parts with an `image_url`: a data URL, or
an http(s) URL the server fetches if allowed), the model's earlier `function_call`s and their
`function_call_output`s. Function `tools` (with `tool_choice`, `parallel_tool_calls`; the
functions of `namespace` tools flattened; hosted tools dropped) and structured output with
`text.format` (`json_schema`, `json_object`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from stepline.api.pipeline.agents import ToolSpec, tool_spec, unique_tools
from stepline.api.pipeline.audio import input_audio_part
from stepline.api.pipeline.chat import call_arguments, template_call
from stepline.api.pipeline.errors import APIError
from stepline.api.pipeline.images import ImageSource, content_of, image_part, text_part
from stepline.engine.sampling_limits import MAX_INT32

# OpenAI's limits on `metadata`: a stored response keeps it as long as the response.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
Metadata = Annotated[
    dict[
        Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
        Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)],
    ],
    Field(max_length=MAX_METADATA_PAIRS),
]

Status = Literal["queued", "in_progress", "completed", "failed", "cancelled", "incomplete"]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


class InputPart(_Request):
    type: Literal["input_text", "output_text", "text"]
    text: str

    def part(self, where: str) -> dict[str, Any]:
        return text_part(self.text)


class InputImage(_Request):
    type: Literal["input_image"]
    image_url: str | None = None  # a data URL, or an http(s) URL
    file_id: str | None = None  # a file uploaded to OpenAI's Files API: none here
    detail: str | None = None  # low / high / auto: accepted, the model sees the image it has

    def part(self, where: str) -> dict[str, Any]:
        """The image's placeholder (`images.image_part`). Raises APIError for a `file_id`."""
        if self.image_url is not None:
            return image_part(ImageSource(where, url=self.image_url))
        if self.file_id is not None:
            raise APIError(
                400,
                f"{where} names file {self.file_id!r}: this server keeps no files; send the "
                "image as an image_url (a data URL: data:image/png;base64,...)",
                param=f"{where}.file_id",
                code="unsupported_content_type",
            )
        raise APIError(400, f"{where} needs an image_url", param=f"{where}.image_url")


class InputAudio(_Request):
    type: Literal["input_audio"]
    input_audio: Any = None  # {"data": BASE64, "format": "wav" | "mp3" | "flac"}

    def part(self, where: str) -> dict[str, Any]:
        """The clip's placeholder (`audio.input_audio_part`)."""
        return input_audio_part(self.input_audio, where)


_PART_TAGS = {"input_image": "image", "input_audio": "audio"}

InputContent = Annotated[
    Annotated[InputPart, Tag("text")]
    | Annotated[InputImage, Tag("image")]
    | Annotated[InputAudio, Tag("audio")],
    Discriminator(
        lambda v: _PART_TAGS.get(_item_type(v), "text"),
        custom_error_type="invalid_content_part",
        custom_error_message="a content part is an input_text, output_text, input_image or "
        "input_audio",
    ),
]


def _content(content: str | list[InputContent], where: str) -> Any:
    """Content as chat templates render it: text (the parts' joined), or where it has
    images its parts in order (`images.content_of`)."""
    if isinstance(content, str):
        return content
    return content_of([p.part(f"{where}.{j}") for j, p in enumerate(content)], sep="")


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputContent]


class FunctionCallInput(_Request):
    """A call the model made earlier (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None  # of a function in a `namespace` tool


class FunctionCallOutputInput(_Request):
    """What the caller's function returned for call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputContent]


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutputInput, Tag("function_call_output")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_input_item",
        custom_error_message="an input item is a message, a function_call or a "
        "function_call_output",
    ),
]


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Request):
    format: TextFormat = Field(default_factory=lambda: TextFormat.model_validate({}))


class ResponsesRequest(_Request):
    model: str | None = None
    input: Annotated[
        Annotated[str, Tag("text")] | Annotated[list[InputItem], Tag("items")],
        Discriminator(lambda v: "text" if isinstance(v, str) else "items"),
    ]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None  # stepline: reproducible sampling
    ignore_eos: bool = False  # stepline: generate max_output_tokens whatever the model says
    stream: bool = False
    background: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: Metadata | None = None
    # The end user (fair share between clients): `safety_identifier`, or the older `user`.
    safety_identifier: str | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """A flag sent as null takes its default, as OpenAI's API reads it (SGLang's gateway
        re-sends every body with `"stream": null`)."""
        if isinstance(data, dict):
            flags = ("stream", "background", "store", "ignore_eos", "parallel_tool_calls")
            data = {k: v for k, v in data.items() if not (v is None and k in flags)}
        return data

    def check_supported(self) -> None:
        """Raises APIError for what this server does not do."""
        fmt = self.text_format
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise APIError(
                400,
                "text.format.schema must be a JSON schema object, as in "
                '{"type": "json_schema", "name": ..., "schema": {...}}',
                param="text.format.schema",
            )
        if self.background and not self.store:
            raise APIError(
                400,
                "a background response must be stored: drop `store: false`",
                param="store",
                code="invalid_value",
            )

    @property
    def text_format(self) -> TextFormat | None:
        return None if self.text is None else self.text.format

    def messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages, as chat templates render them: developer messages
        become system ones, function calls the assistant's `tool_calls` (consecutive ones
        in one message), their outputs `tool` messages; an image a placeholder until
        `resolve_images`. Raises APIError for a call whose arguments are not JSON, and an
        image sent as a file."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            if isinstance(item, InputMessage):
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": _content(item.content, f"input.{i}.content")})
            elif isinstance(item, FunctionCallOutputInput):
                output = _content(item.output, f"input.{i}.output")
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            else:
                args = call_arguments(item.arguments, f"input.{i}.arguments")
                name = flat_name(item.namespace, item.name)
                call = template_call(item.call_id, name, args)
                if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                    out[-1]["tool_calls"].append(call)
                elif out and out[-1]["role"] == "assistant":
                    out[-1]["tool_calls"] = [call]
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        return out

    def tool_specs(self) -> ToolSet:
        """The function `tools` (Responses' flat shape), with the functions of `namespace`
        tools among them under `flat_name`s. Hosted tools (web search, file search, ...) are
        dropped and named in `dropped`: a local model cannot run them. Raises APIError
        for a malformed tool, or a `tool_choice` that forces a dropped one."""
        specs: list[ToolSpec] = []
        dropped: list[str] = []
        namespaced: dict[str, tuple[str, str]] = {}
        for i, tool in enumerate(self.tools or ()):
            kind = tool.get("type")
            if kind == "function":
                specs.append(_function(tool, i, f"tools.{i}"))
            elif kind == "namespace" and isinstance(tool.get("tools"), list):
                ns = tool.get("name")
                if not isinstance(ns, str) or not ns:
                    raise APIError(400, f"tools[{i}] needs a name", param=f"tools.{i}")
                for j, inner in enumerate(tool["tools"]):
                    if not isinstance(inner, dict) or inner.get("type") != "function":
                        what = inner.get("type") if isinstance(inner, dict) else inner
                        dropped.append(f"{ns}.{what}")
                        continue
                    spec = _function(inner, j, f"tools.{i}.tools")
                    flat = flat_name(ns, spec.name)
                    namespaced[flat] = (ns, spec.name)
                    specs.append(ToolSpec(flat, spec.description, spec.parameters))
            else:
                dropped.append(str(kind))
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") not in (None, "function"):
            raise APIError(
                400,
                f"tool_choice forces a {choice.get('type')!r} tool: this server runs function "
                "tools only, hosted tools (web search, file search, ...) are not available",
                param="tool_choice",
                code="unsupported_parameter",
            )
        return ToolSet(unique_tools(specs, "tools"), tuple(dropped), namespaced)

    def tool_choice_name(self, tools: ToolSet) -> str | None:
        """`tool_choice` as "auto" / "none" / "required" / a tool's (flat) name, given the
        request's `tools` (`tool_specs`)."""
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none", "required"):
            if choice is not None and not tools.specs and tools.dropped:
                return None  # every tool was a hosted one, dropped
            return choice  # type: ignore[return-value]
        if isinstance(choice, dict) and choice.get("type") == "function":
            name = choice.get("name")
            if isinstance(name, str):
                return flat_name(choice.get("namespace"), name)
        raise APIError(
            400,
            'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
            param="tool_choice",
        )


@dataclass(frozen=True)
class ToolSet:
    """A request's tools as the engine serves them."""

    specs: tuple[ToolSpec, ...]  # function tools, those of namespaces under flat names
    dropped: tuple[str, ...]  # the hosted tools left out (their types)
    namespaced: dict[str, tuple[str, str]]  # flat name -> (namespace, function name)


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for function `name` of a `namespace` tool."""
    return f"{namespace}__{name}" if namespace else name


def _function(tool: dict[str, Any], i: int, param: str) -> ToolSpec:
    return tool_spec(tool.get("name"), tool.get("description"), tool.get("parameters"), i, param)
