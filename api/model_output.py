"""Model output as agents want it: content, reasoning and tool calls, split as text streams in.

The markers come from the tokenizer as mlx-lm reads it (`tool_call_start` / `tool_call_end`
and the `tool_parser` it chose from the chat template; `think_start` / `think_end` from the
vocabulary), so any model whose format mlx-lm knows is parsed by mlx-lm's own parser. The
splitter only finds where blocks begin and end; a marker split across two deltas is held back
until it is whole, so no delta ever shows half a marker. No MLX.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)

    @property
    def input(self) -> dict[str, Any]:
        """The arguments as an object (Anthropic's `tool_use.input`)."""
        value = json.loads(self.arguments)
        return value if isinstance(value, dict) else {"value": value}


@dataclass
class OutputDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: OutputDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)


@dataclass(frozen=True)
class OutputFormat:
    """Which blocks to split out of a model's text; a None pair is not split (left as content)."""

    think: tuple[str, str] | None = None
    tools: tuple[str, str] | None = None
    tool_parser: Callable[[str, Any], Any] | None = None
    starts_in_reasoning: bool = False  # the prompt ended inside an open think block

    @classmethod
    def of(
        cls,
        tokenizer: Any,
        *,
        reasoning: bool,
        tools: bool,
        prompt_text: str = "",
    ) -> OutputFormat:
        """The format of `tokenizer`'s model (mlx-lm's TokenizerWrapper): think tags if
        `reasoning` and the model has them, tool-call blocks if `tools` and it has a parser."""
        think = None
        if reasoning and getattr(tokenizer, "think_start", None) and tokenizer.think_end:
            think = (tokenizer.think_start, tokenizer.think_end)
        tool_markers = None
        parser = None
        if tools and getattr(tokenizer, "tool_parser", None) is not None:
            tool_markers = (tokenizer.tool_call_start, tokenizer.tool_call_end)
            parser = tokenizer.tool_parser
        opened = think is not None and prompt_text.rstrip().endswith(think[0])
        return cls(think=think, tools=tool_markers, tool_parser=parser, starts_in_reasoning=opened)


class OutputSplitter:
    """Feed the text of one response as it streams; get content, reasoning and whole tool calls.

    A tool call is returned when its block closes (or at `finish`, for a block cut short by
    the token limit, if what came parses). `tools` are the request's tool definitions, which
    some mlx-lm parsers read to type the arguments.
    """

    def __init__(self, fmt: OutputFormat, tools: Any = None) -> None:
        self._fmt = fmt
        self._tools = tools
        self._state = "reasoning" if fmt.starts_in_reasoning else "normal"
        self._held = ""  # text not yet classified: a possible marker prefix, or a tool block
        self.num_tool_calls = 0
        self.parse_errors: list[str] = []

    def _markers(self) -> list[tuple[str, str]]:
        """(marker, state it leads to) that can appear in the current state."""
        fmt = self._fmt
        if self._state == "reasoning":
            assert fmt.think is not None
            return [(fmt.think[1], "normal")]
        if self._state == "tool":
            assert fmt.tools is not None
            return [(fmt.tools[1], "normal")]
        found = []
        if fmt.think is not None:
            found.append((fmt.think[0], "reasoning"))
        if fmt.tools is not None:
            found.append((fmt.tools[0], "tool"))
        return found

    def feed(self, text: str) -> OutputDelta:
        out = OutputDelta()
        self._held += text
        while True:
            markers = self._markers()
            hits = [(self._held.find(m), m, nxt) for m, nxt in markers]
            hits = [h for h in hits if h[0] >= 0]
            if not hits:
                break
            at, marker, nxt = min(hits)
            before = self._held[:at]
            self._held = self._held[at + len(marker) :]
            self._emit(out, before, closing=self._state == "tool")
            self._state = nxt
        if self._state == "tool":
            return out  # a tool block is parsed whole, when it closes
        keep = max((_partial_suffix(self._held, m) for m, _ in self._markers()), default=0)
        ready = self._held[: len(self._held) - keep]
        self._held = self._held[len(ready) :]
        self._emit(out, ready, closing=False)
        return out

    def finish(self) -> OutputDelta:
        """Whatever is held, at the end of the response."""
        out = OutputDelta()
        held, self._held = self._held, ""
        if self._state == "tool":
            calls = self._parse(held)
            if calls is None:  # cut short: show what came as text rather than lose it
                assert self._fmt.tools is not None
                out.content += self._fmt.tools[0] + held
            else:
                out.tool_calls.extend(calls)
        else:
            self._emit(out, held, closing=False)
        return out

    def _emit(self, out: OutputDelta, text: str, *, closing: bool) -> None:
        if self._state == "tool":
            if closing:
                calls = self._parse(text)
                if calls is None:
                    assert self._fmt.tools is not None
                    out.content += self._fmt.tools[0] + text + self._fmt.tools[1]
                else:
                    out.tool_calls.extend(calls)
        elif self._state == "reasoning":
            out.reasoning += text
        else:
            out.content += text

    def _parse(self, text: str) -> list[ToolCall] | None:
        assert self._fmt.tool_parser is not None
        try:
            parsed = self._fmt.tool_parser(text, self._tools)
        except (ValueError, KeyError, TypeError, IndexError) as exc:  # json errors are ValueErrors
            self.parse_errors.append(f"{type(exc).__name__}: {exc}")
            return None
        calls = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                self.parse_errors.append(f"not a tool call: {call!r}")
                return None
            args = call.get("arguments", {})
            arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            calls.append(ToolCall(id=new_call_id(), name=call["name"], arguments=arguments))
        self.num_tool_calls += len(calls)
        return calls


def split_output(text: str, fmt: OutputFormat, tools: Any = None) -> OutputDelta:
    """A whole response's text, split."""
    splitter = OutputSplitter(fmt, tools)
    out = splitter.feed(text)
    out.extend(splitter.finish())
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
