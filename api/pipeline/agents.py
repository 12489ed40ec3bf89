"""What an agent's request asks beyond plain chat, made into engine terms. No MLX.

`AgentPlan` is built from the request's tools, tool choice, structured-output format and
chat-template options (OpenAI's or Anthropic's, already in neutral form) and the served
tokenizer; it holds what the engine needs: the chat template's extra arguments, the grammar
that forces the output (a JSON schema, or a tool call for `required` / a named tool), and how
to split the output (`OutputFormat`). Everything the model cannot honour is an APIError (400),
with one exception: tools offered (not forced) to a model whose chat template cannot show
or read tool calls are left out and named (`AgentPlan.dropped_tools`), so that an agent
that always sends its tools (Claude Code, Codex) still gets its answer in text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from stepline.api.pipeline.errors import APIError
from stepline.api.pipeline.model_output import OutputFormat
from stepline.engine.grammar import (
    CallFormat,
    GrammarError,
    ThinkFormat,
    answer_grammar,
    json_schema_grammar,
    markup,
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
    # What the grammar is made of (kept so that a think budget can be added once the prompt
    # is known): the calls the answer may make, whether it must, the answer's JSON schema.
    calls: CallFormat | None = None
    must_call: bool = False
    schema: dict[str, Any] | None = None
    # Tools left out of the prompt and the grammar, named to the client (the dropped-tools
    # header): offered to a model whose chat template cannot show or read tool calls, or
    # hosted ones a Responses request named.
    dropped_tools: tuple[str, ...] = ()

    def output_format(self, tokenizer: Any, *, reasoning: bool, prompt_text: str) -> OutputFormat:
        return OutputFormat.of(
            tokenizer, reasoning=reasoning, tools=self.parse_tools, prompt_text=prompt_text
        )

    @property
    def openai_tools(self) -> list[dict[str, Any]]:
        return [t.openai() for t in self.tools]

    def with_think_budget(self, tokenizer: Any, budget: int, prompt_text: str) -> AgentPlan:
        """This plan, with the model's think block cut at `budget` tokens: after that many
        the grammar allows only the closing tag. Unchanged for a model without single-token
        think tags (it has no think block to bound)."""
        start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
        if not start or not end:
            return self
        open_tag, close_tag = markup(tokenizer, start), markup(tokenizer, end)
        if not (open_tag.startswith("<[") and close_tag.startswith("<[")):
            return self
        opened = prompt_text.rstrip().endswith(start)
        think = ThinkFormat(open_tag, close_tag, budget, opened=opened)
        try:
            grammar = answer_grammar(
                self.calls if self.parse_tools else None,
                must_call=self.must_call,
                schema=self.schema,
                think=think,
            )
        except GrammarError as exc:
            raise APIError(400, str(exc), param=self.grammar_param) from None
        return replace(self, grammar=grammar)


def closed_schema(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that lists
    `properties` and says nothing of other keys, as vLLM's default grammar backend reads
    such schemas: the everyday ones (pydantic's, LangChain's, Anthropic `input_schema`s) leave
    it out, and a grammar that allowed any other key would let a weak model add keys until
    its token limit."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        key: (
            {k: closed_schema(v) for k, v in value.items()}
            if key in _SCHEMA_MAPS and isinstance(value, dict)
            else closed_schema(value)
            if key in _SCHEMA_KEYS
            else value
        )
        for key, value in schema.items()
    }
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        if "patternProperties" not in out and "unevaluatedProperties" not in out:
            out["additionalProperties"] = False
    return out


# Keywords whose value is a map of name -> schema, and those whose value is a schema or a list
# of schemas (where `closed_schema` recurses).
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
_SCHEMA_KEYS = frozenset(
    {
        "items",
        "prefixItems",
        "additionalProperties",
        "anyOf",
        "oneOf",
        "allOf",
        "not",
        "if",
        "then",
        "else",
        "contains",
    }
)


def openai_tools(tools: Any, param: str = "tools") -> tuple[ToolSpec, ...]:
    """OpenAI `tools` (function tools) as ToolSpecs. Raises APIError if malformed."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise APIError(400, f"{param} must be a list of tools", param=param)
    specs = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(
                400,
                f'{param}[{i}] must be {{"type": "function", "function": {{"name": ...}}}}: '
                "only function tools are supported",
                param=f"{param}.{i}",
            )
        specs.append(
            tool_spec(fn.get("name"), fn.get("description"), fn.get("parameters"), i, param)
        )
    return unique_tools(specs, param)


def tool_spec(name: Any, description: Any, parameters: Any, i: int, param: str) -> ToolSpec:
    """Tool `i` of request field `param`, checked. Raises APIError if malformed."""
    if not isinstance(name, str) or not name:
        raise APIError(400, f"{param}[{i}] needs a non-empty string name", param=f"{param}.{i}")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise APIError(
            400, f"{param}[{i}].parameters must be a JSON schema object", param=f"{param}.{i}"
        )
    return ToolSpec(name, description if isinstance(description, str) else None, parameters)


def tools_unusable(tokenizer: Any, parse: bool) -> str | None:
    """Why this model cannot be offered tools (`parse`: and have its calls read back), or
    None if it can."""
    if parse and getattr(tokenizer, "tool_parser", None) is None:
        return "this model's chat template has no tool-call format that mlx-lm can parse"
    if "tools" not in _template_source(tokenizer):
        return "this model's chat template does not render tools"
    return None


def unique_tools(specs: list[ToolSpec], param: str) -> tuple[ToolSpec, ...]:
    """`specs`, if no two share a name. Raises APIError otherwise."""
    counts: dict[str, int] = {}  # linear: `list.count` per name was quadratic
    for spec in specs:
        counts[spec.name] = counts.get(spec.name, 0) + 1
    dupes = sorted(n for n, c in counts.items() if c > 1)
    if dupes:
        raise APIError(400, f"{param}: duplicate tool names {dupes}", param=param)
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
    schema_param: str = "response_format",
) -> AgentPlan:
    """The engine-side plan of a request. Raises APIError for what cannot be honoured."""
    kwargs = dict(template_kwargs or {})
    check_template_kwargs(tokenizer, kwargs)
    if tool_choice is not None and not tools and tool_choice != "none":
        raise APIError(
            400, f"{tool_choice_param} is set but no tools are given", param=tool_choice_param
        )
    forced = tool_choice not in (None, "auto", "none")
    if forced and tool_choice != "required" and tool_choice not in {t.name for t in tools}:
        raise APIError(
            400,
            f"{tool_choice_param} names {tool_choice!r}, which is not one of the tools",
            param=tool_choice_param,
        )
    unusable = tools_unusable(tokenizer, parse=tool_choice != "none") if tools else None
    if unusable is not None:
        if forced:
            raise APIError(
                400,
                f"{unusable}, so the forced tool call cannot be made: remove `{tool_choice_param}`",
                param=tool_choice_param,
                code="unsupported_parameter",
            )
        dropped = tuple(t.name for t in tools)
        rest = plan(
            tokenizer,
            parallel_tool_calls=parallel_tool_calls,
            schema=schema,
            json_object=json_object,
            template_kwargs=template_kwargs,
            schema_param=schema_param,
        )
        return replace(rest, dropped_tools=dropped)
    parse_tools = bool(tools) and tool_choice != "none"
    if tools:
        kwargs["tools"] = [t.openai() for t in tools]
    if json_object:
        schema = {"type": "object"}
    elif schema is not None:
        schema = closed_schema(schema)
    calls = None
    if parse_tools:
        chosen = [t for t in tools if not forced or tool_choice in ("required", t.name)]
        calls = CallFormat(
            tuple((t.name, closed_schema(t.parameters)) for t in chosen),
            start=markup(tokenizer, tokenizer.tool_call_start),
            end=markup(tokenizer, tokenizer.tool_call_end),
            # One call when a tool is named (or parallel calls are off).
            parallel=parallel_tool_calls and tool_choice in (None, "auto", "required"),
        )
    grammar = None
    grammar_param = schema_param
    try:
        if forced:
            # A forced call wins its turn, whatever format the final answer must have.
            assert calls is not None
            grammar_param = "tools"
            grammar = answer_grammar(calls, must_call=True)
        elif schema is not None and calls is not None:
            # Tools offered and a format asked for (the Agents SDK's `output_type`): the
            # answer is tool call(s) or the JSON document.
            grammar_param = "tools"
            grammar = answer_grammar(calls, schema=schema)
        elif schema is not None:
            grammar = json_schema_grammar(schema)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=grammar_param) from None
    return AgentPlan(
        template_kwargs=kwargs,
        grammar=grammar,
        parse_tools=parse_tools,
        tools=tools,
        grammar_param=grammar_param,
        calls=calls,
        must_call=forced,
        schema=schema,
    )


def reads_template_kwarg(tokenizer: Any, key: str) -> bool:
    """Whether the chat template reads `key` (`enable_thinking` under mlx-lm's name for it)."""
    name = getattr(tokenizer, "_thinking_kwarg", key) if key == "enable_thinking" else key
    return name in _template_source(tokenizer)


def check_template_kwargs(tokenizer: Any, kwargs: dict[str, Any]) -> None:
    """Refuse chat-template arguments the template never reads (they would be ignored).

    mlx-lm passes `enable_thinking` under the name the template uses for it.
    """
    for key in kwargs:
        if key in ("tools", "add_generation_prompt", "messages", "tokenize"):
            raise APIError(
                400,
                f"chat_template_kwargs may not set {key!r}: it is set from the request",
                param="chat_template_kwargs",
            )
        if not reads_template_kwarg(tokenizer, key):
            raise APIError(
                400,
                f"this model's chat template does not read {key!r}, so it would be ignored: "
                "remove it",
                param="chat_template_kwargs" if key != "reasoning_effort" else key,
                code="unsupported_parameter",
            )


def _template_source(tokenizer: Any) -> str:
    source = getattr(tokenizer, "chat_template", None)
    return source if isinstance(source, str) else json.dumps(source or "")


def configure(
    tokenizer: Any,
    *,
    reasoning_parser: str | None,
    chat_template: str | None,
    default_chat_template_kwargs: dict[str, Any] | None,
) -> tuple[bool, dict[str, Any]]:
    """The server-wide agent options (`ServerConfig`), checked against the served model at
    start-up: apply the chat template to `tokenizer`; return (split reasoning, default
    template kwargs). Raises ValueError naming the flag when the model cannot honour it."""
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if reasoning_parser is not None and not getattr(tokenizer, "think_start", None):
        raise ValueError(
            f"--reasoning-parser {reasoning_parser}: this model's vocabulary has no think tags "
            "that mlx-lm recognises, so there is no reasoning to split"
        )
    defaults = dict(default_chat_template_kwargs or {})
    try:
        check_template_kwargs(tokenizer, defaults)
    except APIError as exc:
        raise ValueError(f"--default-chat-template-kwargs: {exc.message}") from None
    return reasoning_parser is not None, defaults
