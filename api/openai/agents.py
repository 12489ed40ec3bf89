"""OpenAI's agent fields (`tools`, `tool_choice`, `parallel_tool_calls`, `response_format`,
`chat_template_kwargs`, `reasoning_effort`) to an AgentPlan, and split output back to OpenAI's
message and delta shapes (the `openai` package's types). No MLX."""

from __future__ import annotations

from typing import Any

from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion_chunk import (
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
)
from openai.types.chat.chat_completion_message_function_tool_call import (
    ChatCompletionMessageFunctionToolCall,
    Function,
)

from stepline.api.openai.schema import ChatCompletionRequest, CompletionRequest
from stepline.api.pipeline.agents import AgentPlan, openai_tools, plan
from stepline.api.pipeline.errors import APIError
from stepline.api.pipeline.model_output import OutputDelta


def response_format_schema(rf: Any) -> tuple[dict[str, Any] | None, bool]:
    """(JSON schema, any-JSON-object) of an OpenAI `response_format`. Raises APIError."""
    if rf is None:
        return None, False
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None, False
    if kind == "json_object":
        return None, True
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                400,
                "response_format.json_schema.schema must be a JSON schema object, as in "
                '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                param="response_format.json_schema.schema",
            )
        return schema, False
    raise APIError(
        400,
        "response_format.type must be 'text', 'json_object' or 'json_schema'",
        param="response_format.type",
    )


def tool_choice_name(choice: Any) -> str | None:
    """OpenAI `tool_choice` as "auto" / "none" / "required" / a tool's name."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if isinstance(name, str):
            return name
    raise APIError(
        400,
        'tool_choice must be "auto", "none", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def chat_plan(
    req: ChatCompletionRequest, tokenizer: Any, defaults: dict[str, Any] | None = None
) -> AgentPlan:
    """The plan of a chat request; `defaults` are the server's template kwargs."""
    schema, json_object = response_format_schema(req.response_format)
    kwargs = {**(defaults or {}), **(req.chat_template_kwargs or {})}
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
    return plan(
        tokenizer,
        tools=openai_tools(req.tools),
        tool_choice=tool_choice_name(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        schema=schema,
        json_object=json_object,
        template_kwargs=kwargs,
    )


def completion_plan(req: CompletionRequest, tokenizer: Any) -> AgentPlan:
    """/v1/completions takes `response_format` only (there is no chat template for tools)."""
    for name in ("tools", "tool_choice", "chat_template_kwargs", "reasoning_effort"):
        if getattr(req, name) is not None:
            raise APIError(
                400,
                f"{name} is for /v1/chat/completions: /v1/completions has no chat template",
                param=name,
                code="unsupported_parameter",
            )
    schema, json_object = response_format_schema(req.response_format)
    return plan(tokenizer, schema=schema, json_object=json_object)


def message(out: OutputDelta, *, parallel: bool = True) -> ChatCompletionMessage:
    """The assistant message of a whole answer; without `parallel`, only its first call.
    `content` is null when the answer is only tool calls; `tool_calls` and
    `reasoning_content` (vLLM's extension) appear only when there are some."""
    calls = [
        ChatCompletionMessageFunctionToolCall(
            id=c.id, type="function", function=Function(name=c.name, arguments=c.arguments)
        )
        for c in out.tool_calls[: None if parallel else 1]
    ]
    fields: dict[str, Any] = {"content": out.content if out.content or not calls else None}
    if calls:
        fields["tool_calls"] = calls
    if out.reasoning:
        fields["reasoning_content"] = out.reasoning
    return ChatCompletionMessage(role="assistant", **fields)


def finish_reason(reason: str, num_tool_calls: int) -> str:
    """OpenAI says `tool_calls` when the answer ended by calling tools."""
    return "tool_calls" if reason == "stop" and num_tool_calls else reason


def deltas(out: OutputDelta, *, parallel: bool = True) -> list[ChoiceDelta]:
    """The stream deltas of one split piece: reasoning, then content, then the tool calls'
    pieces (the first of a call has its id, type and name; the rest add arguments text);
    without `parallel`, those of the first call only. Each holds only the keys it changes."""
    found = []
    if out.reasoning:
        found.append(ChoiceDelta(**{"reasoning_content": out.reasoning}))  # vLLM's extension
    if out.content:
        found.append(ChoiceDelta(content=out.content))
    for d in out.tool_call_deltas:
        if d.index > 0 and not parallel:
            continue
        if d.id is not None:
            head = ChoiceDeltaToolCall(
                index=d.index,
                id=d.id,
                type="function",
                function=ChoiceDeltaToolCallFunction(name=d.name, arguments=""),
            )
            found.append(ChoiceDelta(tool_calls=[head]))
        if d.arguments:
            args = ChoiceDeltaToolCall(
                index=d.index, function=ChoiceDeltaToolCallFunction(arguments=d.arguments)
            )
            found.append(ChoiceDelta(tool_calls=[args]))
    return found
