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
        """The arguments as an object (Anthropic's `tool_use.input`); empty for arguments cut
        short by the token limit."""
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {"value": value}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed tool call: the first names it (`id`, `name`), later ones add
    `arguments` text; the last one of a call has `done`."""

    index: int  # the call's position in the answer, from 0
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    done: bool = False


@dataclass
class OutputDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls completed in this piece
    tool_call_deltas: list[ToolCallDelta] = field(default_factory=list)  # for streams

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.tool_call_deltas)

    def extend(self, other: OutputDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)
        self.tool_call_deltas.extend(other.tool_call_deltas)


@dataclass
class _OpenCall:
    """A tool call whose arguments are being streamed while its block is still open."""

    index: int
    id: str
    name: str
    args_start: int  # where the arguments begin in the block's text
    num_sent: int = 0  # characters of the arguments sent so far


@dataclass(frozen=True)
class OutputFormat:
    """Which blocks to split out of a model's text; a None pair is not split (left as content)."""

    think: tuple[str, str] | None = None
    tools: tuple[str, str] | None = None
    tool_parser: Callable[[str, Any], Any] | None = None
    starts_in_reasoning: bool = False  # the prompt ended inside an open think block
    # A block is one JSON object {"name": ..., "arguments": {...}} (mlx-lm's json_tools
    # format): its arguments can be streamed as they are written.
    json_calls: bool = False

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
        kind = (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_parser_type")
        return cls(
            think=think,
            tools=tool_markers,
            tool_parser=parser,
            starts_in_reasoning=opened,
            json_calls=kind == "json_tools",
        )


class OutputSplitter:
    """Feed the text of one response as it streams; get content, reasoning and whole tool calls.

    A tool call is returned when its block closes, or at `finish` for a block cut short by
    the token limit: a call with the arguments written so far (its deltas end without `done`),
    the same streamed or not; a block cut before its name is complete is dropped. Whitespace
    before or after a tool-call block, and right after a think block, is not content.

    `tools` are the request's tool definitions, which some mlx-lm parsers read to type the
    arguments. With `stream`, `tool_call_deltas` also describe each call as it is written: its
    name as soon as it is known and, for the json_tools format, its arguments as they grow
    (other formats: whole, when it closes).
    """

    def __init__(self, fmt: OutputFormat, tools: Any = None, *, stream: bool = False) -> None:
        self._fmt = fmt
        self._tools = tools
        self._stream = stream
        self._state = "reasoning" if fmt.starts_in_reasoning else "normal"
        self._held = ""  # text not yet classified: a possible marker prefix, or a tool block
        self._call: _OpenCall | None = None
        self._blank = ""  # trailing whitespace of the content, held until more content comes
        self._strip = False  # drop the whitespace that starts the next content (after a block)
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
            if nxt == "tool":
                self._blank = ""  # the whitespace before a call
            self._strip = self._state != "normal"  # and after a call or a think block
            self._state = nxt
        if self._state == "tool":
            if self._stream and self._fmt.json_calls:
                out.tool_call_deltas.extend(self._progress())
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
            self._finish_cut(out, held)
        else:
            self._emit(out, held, closing=False)
            if not self.num_tool_calls:
                out.content += self._blank  # a plain answer keeps its own whitespace
        self._blank = ""
        return out

    def _finish_cut(self, out: OutputDelta, body: str) -> None:
        """A tool-call block cut short by the token limit: the call as far as it came."""
        calls = self._parse(body) if self._call is None else None
        if calls is not None:  # complete but for its closing tag
            self._add(out, calls)
            return
        if self._call is None and self._fmt.json_calls:
            head = _json_call_head(body)
            if head is not None:
                self._call = _OpenCall(self.num_tool_calls, new_call_id(), head[0], head[1])
                if self._stream:
                    out.tool_call_deltas.append(
                        ToolCallDelta(self._call.index, id=self._call.id, name=head[0])
                    )
        call, self._call = self._call, None
        if call is None:
            self.parse_errors.append("a tool call cut short before its name")
            return
        args = body[call.args_start :].rstrip()
        try:
            json.loads(body)  # the call's object is whole: its last brace is not the arguments'
            args = args[:-1].rstrip()
        except ValueError:
            pass
        if self._stream and len(args) > call.num_sent:
            out.tool_call_deltas.append(ToolCallDelta(call.index, arguments=args[call.num_sent :]))
        self.num_tool_calls += 1
        out.tool_calls.append(ToolCall(id=call.id, name=call.name, arguments=args))

    def _emit(self, out: OutputDelta, text: str, *, closing: bool) -> None:
        if self._state == "tool":
            if closing and self._call is not None:
                self._close_streamed(out, text)
            elif closing:
                calls = self._parse(text)
                if calls is None:
                    assert self._fmt.tools is not None
                    out.content += self._fmt.tools[0] + text + self._fmt.tools[1]
                else:
                    self._add(out, calls)
        elif self._state == "reasoning":
            out.reasoning += text
        else:
            self._content(out, text)

    def _content(self, out: OutputDelta, text: str) -> None:
        """Content, less the whitespace around blocks: a trailing run of whitespace is held
        until more content follows it (a block after it drops it)."""
        if self._strip:
            text = text.lstrip()
            if not text:
                return
            self._strip = False
        if self._fmt.tools is None:
            out.content += text
            return
        text = self._blank + text
        kept = text.rstrip()
        self._blank = text[len(kept) :]
        out.content += kept

    def _add(self, out: OutputDelta, calls: list[ToolCall]) -> None:
        """Complete calls: counted, and (for streams) sent whole as two deltas each."""
        for call in calls:
            index = self.num_tool_calls
            self.num_tool_calls += 1
            out.tool_calls.append(call)
            if self._stream:
                out.tool_call_deltas.append(ToolCallDelta(index, id=call.id, name=call.name))
                out.tool_call_deltas.append(
                    ToolCallDelta(index, arguments=call.arguments, done=True)
                )

    def _progress(self) -> list[ToolCallDelta]:
        """Deltas for the open json_tools block in `_held`: its name once whole, then the
        arguments written since, less a trailing run of `}` and blanks (the last `}` closes
        the block's object, not the arguments)."""
        assert self._fmt.tools is not None
        body = self._held[: len(self._held) - _partial_suffix(self._held, self._fmt.tools[1])]
        deltas = []
        if self._call is None:
            head = _json_call_head(body)
            if head is None:
                return []
            name, start = head
            self._call = _OpenCall(self.num_tool_calls, new_call_id(), name, start)
            deltas.append(ToolCallDelta(self._call.index, id=self._call.id, name=name))
        call = self._call
        args = body[call.args_start :]
        ready = len(args.rstrip("} \t\r\n"))
        if ready > call.num_sent:
            deltas.append(ToolCallDelta(call.index, arguments=args[call.num_sent : ready]))
            call.num_sent = ready
        return deltas

    def _close_streamed(self, out: OutputDelta, text: str) -> None:
        """The end of a block whose arguments were streamed: the rest of them, less the
        block object's closing brace."""
        call, self._call = self._call, None
        assert call is not None
        args = text[call.args_start :].rstrip()
        args = args[:-1].rstrip() if args.endswith("}") else args
        out.tool_call_deltas.append(
            ToolCallDelta(call.index, arguments=args[call.num_sent :], done=True)
        )
        self._parse(text)  # mlx-lm's reading of the block; a failure lands in parse_errors
        self.num_tool_calls += 1
        out.tool_calls.append(ToolCall(id=call.id, name=call.name, arguments=args))

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
        return calls


def split_output(text: str, fmt: OutputFormat, tools: Any = None) -> OutputDelta:
    """A whole response's text, split."""
    splitter = OutputSplitter(fmt, tools)
    out = splitter.feed(text)
    out.extend(splitter.finish())
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _json_call_head(body: str) -> tuple[str, int] | None:
    """(name, where the arguments start) of a block that so far reads
    `{"name": "...", "arguments": ` and at least one more character; None until it does."""
    decoder = json.JSONDecoder()
    i = _skip_blank(body, 0)
    if body[i : i + 1] != "{":
        return None
    values = []
    i += 1
    for expect_key in ("name", "arguments"):
        i = _skip_blank(body, i)
        try:
            key, i = decoder.raw_decode(body, i)
        except ValueError:
            return None
        i = _skip_blank(body, i)
        if key != expect_key or body[i : i + 1] != ":":
            return None
        i = _skip_blank(body, i + 1)
        if expect_key == "arguments":
            break
        try:
            name, i = decoder.raw_decode(body, i)
        except ValueError:
            return None
        i = _skip_blank(body, i)
        if not isinstance(name, str) or body[i : i + 1] != ",":
            return None
        values.append(name)
        i += 1
    if i >= len(body):
        return None
    return values[0], i


def _skip_blank(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
