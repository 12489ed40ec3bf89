"""What an agent's request asks beyond plain chat, made into engine terms. No MLX.

`AgentPlan` is built from the request's tools, tool choice, structured-output format and
chat-template options (OpenAI's or Anthropic's, already in neutral form) and the served
tokenizer; it holds what the engine needs: the chat template's extra arguments, the grammar
that forces the output (a JSON schema, or a tool call for `required` / a named tool), and how
to split the output (`OutputFormat`). Everything the model cannot honour is a RequestError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from stepline.api.model_output import OutputFormat
from stepline.api.openai_schema import RequestError
from stepline.engine.grammar import (
    GrammarError,
    json_object_grammar,
    json_schema_grammar,
    markup,
    tool_call_grammar,
)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The OpenAI tool definition, which chat templates render."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class AgentPlan:
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # tools, enable_thinking, ...
    grammar: str | None = None
    parse_tools: bool = False  # split tool-call blocks out of the output
    tools: tuple[ToolSpec, ...] = ()
    grammar_param: str = "response_format"  # the request field the grammar comes from

    def output_format(self, tokenizer: Any, *, reasoning: bool, prompt_text: str) -> OutputFormat:
        return OutputFormat.of(
            tokenizer, reasoning=reasoning, tools=self.parse_tools, prompt_text=prompt_text
        )

    @property
    def openai_tools(self) -> list[dict[str, Any]]:
        return [t.openai() for t in self.tools]


def openai_tools(tools: Any, param: str = "tools") -> tuple[ToolSpec, ...]:
    """OpenAI `tools` (function tools) as ToolSpecs. Raises RequestError if malformed."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise RequestError(f"{param} must be a list of tools", param=param)
    specs = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(
                f'{param}[{i}] must be {{"type": "function", "function": {{"name": ...}}}}: '
                "only function tools are supported",
                param=f"{param}.{i}",
            )
        specs.append(
            tool_spec(fn.get("name"), fn.get("description"), fn.get("parameters"), i, param)
        )
    return unique_tools(specs, param)


def tool_spec(name: Any, description: Any, parameters: Any, i: int, param: str) -> ToolSpec:
    """Tool `i` of request field `param`, checked. Raises RequestError if malformed."""
    if not isinstance(name, str) or not name:
        raise RequestError(f"{param}[{i}] needs a non-empty string name", param=f"{param}.{i}")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise RequestError(
            f"{param}[{i}].parameters must be a JSON schema object", param=f"{param}.{i}"
        )
    return ToolSpec(name, description if isinstance(description, str) else None, parameters)


def unique_tools(specs: list[ToolSpec], param: str) -> tuple[ToolSpec, ...]:
    """`specs`, if no two share a name. Raises RequestError otherwise."""
    counts: dict[str, int] = {}  # linear: `list.count` per name was quadratic
    for spec in specs:
        counts[spec.name] = counts.get(spec.name, 0) + 1
    dupes = sorted(n for n, c in counts.items() if c > 1)
    if dupes:
        raise RequestError(f"{param}: duplicate tool names {dupes}", param=param)
    return tuple(specs)


def plan(
    tokenizer: Any,
    *,
    tools: tuple[ToolSpec, ...] = (),
    tool_choice: str | None = None,  # "auto", "none", "required", or a tool's name
    parallel_tool_calls: bool = True,
    schema: dict[str, Any] | None = None,  # structured output: a JSON schema
    json_object: bool = False,  # structured output: any JSON object
    template_kwargs: dict[str, Any] | None = None,
    tool_choice_param: str = "tool_choice",
) -> AgentPlan:
    """The engine-side plan of a request. Raises RequestError for what cannot be honoured."""
    kwargs = dict(template_kwargs or {})
    check_template_kwargs(tokenizer, kwargs)
    if tool_choice is not None and not tools and tool_choice != "none":
        raise RequestError(
            f"{tool_choice_param} is set but no tools are given", param=tool_choice_param
        )
    forced = tool_choice not in (None, "auto", "none")
    if forced and tool_choice != "required" and tool_choice not in {t.name for t in tools}:
        raise RequestError(
            f"{tool_choice_param} names {tool_choice!r}, which is not one of the tools",
            param=tool_choice_param,
        )
    parse_tools = bool(tools) and tool_choice != "none"
    if parse_tools and getattr(tokenizer, "tool_parser", None) is None:
        raise RequestError(
            "this model's chat template has no tool-call format that mlx-lm can parse, so "
            "tool calls cannot be read back: remove `tools`",
            param="tools",
            code="unsupported_parameter",
        )
    if tools:
        if "tools" not in _template_source(tokenizer):
            raise RequestError(
                "this model's chat template does not render tools, so the model would never "
                "see them: remove `tools`",
                param="tools",
                code="unsupported_parameter",
            )
        kwargs["tools"] = [t.openai() for t in tools]
    grammar = None
    if forced:
        if schema is not None or json_object:
            raise RequestError(
                f"a forced {tool_choice_param} and a structured response format cannot both "
                "constrain one answer: send one of them",
                param=tool_choice_param,
            )
        chosen = [t for t in tools if tool_choice == "required" or t.name == tool_choice]
        try:
            grammar = tool_call_grammar(
                [(t.name, t.parameters) for t in chosen],
                start=markup(tokenizer, tokenizer.tool_call_start),
                end=markup(tokenizer, tokenizer.tool_call_end),
                parallel=parallel_tool_calls and tool_choice == "required",
            )
        except GrammarError as exc:
            raise RequestError(str(exc), param="tools") from None
    elif schema is not None:
        try:
            grammar = json_schema_grammar(schema)
        except GrammarError as exc:
            raise RequestError(str(exc), param="response_format") from None
    elif json_object:
        grammar = json_object_grammar()
    return AgentPlan(template_kwargs=kwargs, grammar=grammar, parse_tools=parse_tools, tools=tools)


def check_template_kwargs(tokenizer: Any, kwargs: dict[str, Any]) -> None:
    """Refuse chat-template arguments the template never reads (they would be ignored).

    mlx-lm passes `enable_thinking` under the name the template uses for it.
    """
    source = _template_source(tokenizer)
    for key in kwargs:
        if key in ("tools", "add_generation_prompt", "messages", "tokenize"):
            raise RequestError(
                f"chat_template_kwargs may not set {key!r}: it is set from the request",
                param="chat_template_kwargs",
            )
        name = getattr(tokenizer, "_thinking_kwarg", key) if key == "enable_thinking" else key
        if name not in source:
            raise RequestError(
                f"this model's chat template does not read {key!r}, so it would be ignored: "
                "remove it",
                param="chat_template_kwargs" if key != "reasoning_effort" else key,
                code="unsupported_parameter",
            )


def _template_source(tokenizer: Any) -> str:
    source = getattr(tokenizer, "chat_template", None)
    return source if isinstance(source, str) else json.dumps(source or "")
