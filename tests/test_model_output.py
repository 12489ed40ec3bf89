"""Splitting model output into content, reasoning and tool calls, as it streams."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tool_parsers import json_tools

from stepline.api.pipeline.model_output import OutputFormat, OutputSplitter, split_output

QWEN = OutputFormat(
    think=("<think>", "</think>"),
    tools=("<tool_call>", "</tool_call>"),
    tool_parser=json_tools.parse_tool_call,
    json_calls=True,
)
ANSWER = (
    "<think>I should look it up.</think>Let me check."
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def feed_in_pieces(text: str, size: int, fmt: OutputFormat = QWEN):
    splitter = OutputSplitter(fmt, stream=True)
    pieces = [splitter.feed(text[i : i + size]) for i in range(0, len(text), size)]
    return [*pieces, splitter.finish()]


def test_a_whole_answer_splits_into_reasoning_content_and_tool_calls():
    out = split_output(ANSWER, QWEN)

    assert out.reasoning == "I should look it up."
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in out.tool_calls}) == 2


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11])
def test_streamed_pieces_add_up_to_the_whole_and_never_show_half_a_marker(size):
    pieces = feed_in_pieces(ANSWER, size)

    assert "".join(p.content for p in pieces) == "Let me check."
    assert "".join(p.reasoning for p in pieces) == "I should look it up."
    assert [c.name for p in pieces for c in p.tool_calls] == ["get_weather", "get_time"]
    for p in pieces:
        assert "<" not in p.content + p.reasoning


def test_text_that_only_looks_like_a_marker_start_is_released_when_it_is_not_one():
    pieces = feed_in_pieces("a <b and <tool maybe", 3)

    assert "".join(p.content for p in pieces) == "a <b and <tool maybe"


def test_without_a_reasoning_parser_think_tags_stay_in_the_content():
    fmt = OutputFormat(tools=QWEN.tools, tool_parser=QWEN.tool_parser)

    out = split_output("<think>hmm</think>hi", fmt)

    assert (out.content, out.reasoning) == ("<think>hmm</think>hi", "")


def test_a_prompt_that_opened_the_think_block_starts_the_answer_in_reasoning():
    fmt = OutputFormat(think=QWEN.think, starts_in_reasoning=True)

    out = split_output("step one</think>The answer.", fmt)

    assert (out.reasoning, out.content) == ("step one", "The answer.")


CUT = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'


@pytest.mark.parametrize("size", [None, 1, 3, 8])
def test_a_tool_call_cut_by_the_token_limit_is_a_call_streamed_or_not(size):
    if size is None:
        out = split_output(CUT, QWEN)
        calls, content, arguments = out.tool_calls, out.content, out.tool_calls[0].arguments
    else:
        pieces = feed_in_pieces(CUT, size)
        calls = [c for p in pieces for c in p.tool_calls]
        content = "".join(p.content for p in pieces)
        deltas = [d for p in pieces for d in p.tool_call_deltas]
        arguments = "".join(d.arguments for d in deltas)
        assert deltas[0].name == "get_weather" and not any(d.done for d in deltas)

    [call] = calls
    assert call.name == "get_weather"
    assert call.arguments == arguments == '{"city": "Par'
    assert call.input == {}  # not JSON: Anthropic's tool_use gets an empty input
    assert content == "Sure."  # no markup in the content


def test_a_call_cut_before_its_name_is_whole_leaves_no_markup():
    out = split_output('Sure.\n<tool_call>\n{"name": "get_wea', QWEN)

    assert (out.content, out.tool_calls) == ("Sure.", [])


@pytest.mark.parametrize("size", [None, 1, 2, 5])
def test_whitespace_around_tool_calls_and_after_thinking_is_not_content(size):
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    text = f"<think>hm</think>\n\n{call}\n{call}\n"
    if size is None:
        out = split_output(text, QWEN)
        content, num_calls = out.content, len(out.tool_calls)
    else:
        pieces = feed_in_pieces(text, size)
        content = "".join(p.content for p in pieces)
        num_calls = len([c for p in pieces for c in p.tool_calls])

    assert (content, num_calls) == ("", 2)
    # text between calls keeps its inner whitespace, and a plain answer its own
    between = split_output(f"{call}\n\nI called it. Now:\n{call}", QWEN)
    assert between.content == "I called it. Now:"
    assert split_output("Hi.\n", QWEN).content == "Hi.\n"


@pytest.mark.parametrize("size", [1, 4, 9])
def test_streamed_tool_arguments_grow_piece_by_piece_and_add_up_to_the_call(size):
    pieces = feed_in_pieces(ANSWER, size)
    deltas = [d for p in pieces for d in p.tool_call_deltas]
    calls = [c for p in pieces for c in p.tool_calls]

    for index, call in enumerate(calls):
        mine = [d for d in deltas if d.index == index]
        assert (mine[0].id, mine[0].name) == (call.id, call.name)
        assert "".join(d.arguments for d in mine) == call.arguments
        assert [d.done for d in mine] == [False] * (len(mine) - 1) + [True]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    # the weather call's arguments came in several pieces, before its block closed
    assert size > 4 or len([d for d in deltas if d.index == 0 and d.arguments]) > 2


def test_a_block_in_another_key_order_is_sent_whole_when_it_closes():
    text = '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>'

    deltas = [d for p in feed_in_pieces(text, 2) for d in p.tool_call_deltas]

    assert [(d.name, d.arguments, d.done) for d in deltas] == [
        ("f", "", False),
        (None, '{"x": 1}', True),
    ]


def test_without_parallel_tool_calls_only_the_first_call_is_returned():
    from stepline.api.openai import agents as openai_agents
    from stepline.api.pipeline.model_output import OutputDelta, ToolCall, ToolCallDelta

    two = OutputDelta(
        tool_calls=[ToolCall("call_a", "f", "{}"), ToolCall("call_b", "g", "{}")],
        tool_call_deltas=[
            ToolCallDelta(0, id="call_a", name="f"),
            ToolCallDelta(0, arguments="{}", done=True),
            ToolCallDelta(1, id="call_b", name="g"),
            ToolCallDelta(1, arguments="{}", done=True),
        ],
    )

    [call] = openai_agents.message(two, parallel=False).tool_calls or []
    assert call.id == "call_a"
    streamed = openai_agents.deltas(two, parallel=False)
    assert {d.tool_calls[0].index for d in streamed if d.tool_calls} == {0}
    assert len(openai_agents.message(two).tool_calls or []) == 2
