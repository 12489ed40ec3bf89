"""Anthropic Messages API bodies (`POST /v1/messages`, `/v1/messages/count_tokens`), as pydantic
models, and their translation to the neutral chat messages the chat template renders. No MLX.

Requests are strict (a string is not a number); unknown top-level fields are ignored as
Anthropic adds them, but a known feature the engine cannot honour (documents, server tools)
is an APIError (400) naming it. `image` blocks (a `base64` or `url` source) are served in
user turns and in their `tool_result`s, to a model that reads images
(`images.resolve_images`). A `system` message mid-conversation (Claude Code sends them) is a
system turn; `thinking` (`enabled` with its `budget_tokens`, `adaptive`) turns the template's
thinking on, and a budget is enforced by the grammar; `output_config.format` constrains the
answer to a JSON schema.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stepline.api.pipeline.agents import ToolSpec, tool_spec, unique_tools
from stepline.api.pipeline.chat import joined_text, template_call, unsupported_part
from stepline.api.pipeline.errors import APIError
from stepline.api.pipeline.images import ImageSource, content_of, image_part, text_part
from stepline.engine.sampling_limits import MAX_INT32


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class Block(BaseModel):
    """One content block; which fields matter depends on `type`."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None  # tool_result
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking (an earlier turn's, sent back)
    source: dict[str, Any] | None = None  # image: {"type": "base64" | "url", ...}


class Message(_Request):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(_Request):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; server tools (web_search, ...) are refused


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Request):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)  # `enabled`: most tokens the thinking takes

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class OutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    format: OutputFormat | None = None
    effort: str | None = None  # how hard to think: nothing to honour on a local model


class _Base(_Request):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's spelling

    def check_supported(self) -> None:
        pass

    @property
    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow (structured outputs), if any."""
        fmt = self.output_config.format if self.output_config else None
        fmt = fmt or self.output_format
        return None if fmt is None else fmt.schema_

    @property
    def schema_param(self) -> str:
        return "output_format.schema" if self.output_format else "output_config.format.schema"

    @property
    def think_budget(self) -> int | None:
        t = self.thinking
        return t.budget_tokens if t is not None and t.type == "enabled" else None


class CountTokensRequest(_Base):
    pass


class MessagesRequest(_Base):
    max_tokens: int = Field(ge=1, le=MAX_INT32)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # stepline: reproducible sampling
    stream: bool = False
    metadata: dict[str, Any] | None = None  # user_id only: who the end user is

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop_sequences or ())

    @property
    def user_id(self) -> str | None:
        """`metadata.user_id`, the end user (fair share between clients), if a string."""
        value = (self.metadata or {}).get("user_id")
        return value if isinstance(value, str) else None


def tool_specs(req: _Base) -> tuple[ToolSpec, ...]:
    specs = []
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise APIError(
                400,
                f"tools[{i}] is a server tool ({tool.type}): only custom tools are supported",
                param=f"tools.{i}",
            )
        specs.append(tool_spec(tool.name, tool.description, tool.input_schema, i, "tools"))
    return unique_tools(specs, "tools")


def tool_choice(req: _Base) -> tuple[str | None, bool]:
    """(choice as "auto" / "none" / "required" / a name, parallel calls allowed)."""
    c = req.tool_choice
    if c is None:
        return None, True
    if c.type == "tool":
        if not c.name:
            raise APIError(400, 'tool_choice {"type": "tool"} needs a name', param="tool_choice")
        return c.name, False
    choice = {"auto": "auto", "any": "required", "none": "none"}[c.type]
    return choice, not c.disable_parallel_tool_use


def template_kwargs(req: _Base) -> dict[str, Any]:
    if req.thinking is None:
        return {}
    return {"enable_thinking": req.thinking.on}


def engine_messages(req: _Base) -> list[dict[str, Any]]:
    """The conversation as OpenAI-style chat messages (what chat templates render): the
    system prompt first, `tool_result` blocks as `tool` messages, `tool_use` blocks as the
    assistant's `tool_calls`, earlier `thinking` blocks as its `reasoning_content`. A user
    turn's (or tool result's) content with `image` blocks is its parts in order, each image a
    placeholder until `resolve_images` (`images.content_of`)."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if m.role == "system":  # a system turn mid-conversation
            out.append({"role": "system", "content": _text(m.content, where)})
            continue
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        parts: list[dict[str, Any]] = []
        calls, reasoning = [], []
        for j, b in enumerate(m.content):
            if b.type == "text" and b.text is not None:
                parts.append(text_part(b.text))
            elif b.type == "image" and m.role == "user":
                parts.append(_image(b, f"{where}.{j}"))
            elif b.type == "tool_result" and m.role == "user":
                content = _result(b.content, f"{where}.{j}.content")
                if b.is_error:
                    content = _error(content)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
            elif b.type == "tool_use" and m.role == "assistant" and b.name:
                calls.append(template_call(b.id, b.name, b.input or {}))
            elif b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                reasoning.append(b.thinking or "")
            elif b.type in _AUDIO_BLOCKS:
                raise _no_audio_block(f"{where}.{j}", b.type)
            else:
                raise APIError(
                    400,
                    f"{where}[{j}] is a {b.type!r} block, which this server does not serve on "
                    f"a {m.role} turn (text, image, tool_use, tool_result and thinking are "
                    "served)",
                    param=f"{where}.{j}",
                    code="unsupported_content_type",
                )
        if m.role == "user" and not parts:
            continue  # only tool results: they are the tool messages above
        message: dict[str, Any] = {"role": m.role, "content": content_of(parts)}
        if calls:
            message["tool_calls"] = calls
        if reasoning and any(reasoning):
            message["reasoning_content"] = "\n".join(reasoning)
        out.append(message)
    return out


# Block types a client might try for audio (OpenAI's part names among them).
_AUDIO_BLOCKS = ("audio", "input_audio", "audio_url")


def _no_audio_block(where: str, kind: str) -> APIError:
    """Anthropic's Messages API has no audio block: say where audio is taken instead."""
    return APIError(
        400,
        f"{where} is a {kind!r} block: Anthropic's Messages API has no audio content block, "
        "so this door takes no audio; send the clip to /v1/chat/completions as an "
        '`input_audio` part ({"data": BASE64, "format": "wav"}) or to /v1/responses',
        param=where,
        code="unsupported_content_type",
    )


def _image(block: Block, where: str) -> dict[str, Any]:
    """An `image` block's placeholder (`images.image_part`). Raises APIError for a source
    that is neither `base64` nor `url`."""
    source = block.source or {}
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str):
        media_type = source.get("media_type")
        return image_part(
            ImageSource(
                where,
                data=source["data"],
                media_type=media_type if isinstance(media_type, str) else None,
            )
        )
    if kind == "url" and isinstance(source.get("url"), str):
        return image_part(ImageSource(where, url=source["url"]))
    if kind == "file":
        raise APIError(
            400,
            f"{where}.source is a file: this server keeps no files; send the image as a "
            '{"type": "base64", ...} or {"type": "url", ...} source',
            param=f"{where}.source",
            code="unsupported_content_type",
        )
    raise APIError(
        400,
        f"{where}.source must be {{'type': 'base64', 'media_type': ..., 'data': ...}} or "
        "{'type': 'url', 'url': ...}",
        param=f"{where}.source",
    )


def _result(content: str | list[Block] | None, where: str) -> Any:
    """A `tool_result`'s content: its text, or where it has images its parts
    (`images.content_of`)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, b in enumerate(content):
        if b.type == "text" and b.text is not None:
            parts.append(text_part(b.text))
        elif b.type == "image":
            parts.append(_image(b, f"{where}.{j}"))
        else:
            raise unsupported_part(f"{where}.{j}", b.type, "'text' and 'image'")
    return content_of(parts)


def _error(content: Any) -> Any:
    """A failed tool's result, marked as such for the model."""
    if isinstance(content, str):
        return f"Error: {content}"
    return [text_part("Error:"), *content]


def _text(content: str | list[Block], where: str) -> str:
    return content if isinstance(content, str) else joined_text(content, where)
