"""The server's agent options, and their checks against the served model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stepline.api.pipeline.agents import configure


def tokenizer(template: str, think: str | None = "<think>"):
    return SimpleNamespace(chat_template=template, think_start=think, think_end="</think>")


def test_configure_installs_the_template_and_keeps_defaults_the_template_reads():
    tok = tokenizer("old")

    split, defaults = configure(
        tok,
        reasoning_parser="qwen3",
        chat_template="{% if enable_thinking %}x{% endif %}",
        default_chat_template_kwargs={"enable_thinking": False},
    )

    assert tok.chat_template == "{% if enable_thinking %}x{% endif %}"
    assert (split, defaults) == (True, {"enable_thinking": False})


def test_options_the_model_cannot_honour_are_refused_at_start_up():
    with pytest.raises(ValueError, match="no think tags"):
        configure(
            tokenizer("t", think=None),
            reasoning_parser="deepseek_r1",
            chat_template=None,
            default_chat_template_kwargs=None,
        )
    with pytest.raises(ValueError, match="does not read 'color'"):
        configure(
            tokenizer("t"),
            reasoning_parser=None,
            chat_template=None,
            default_chat_template_kwargs={"color": "blue"},
        )


def test_tools_a_model_cannot_render_or_parse_are_dropped_unless_forced():
    from stepline.api.pipeline.agents import ToolSpec, plan
    from stepline.api.pipeline.errors import APIError

    tools = (ToolSpec("f", None, {"type": "object"}), ToolSpec("g", None, {"type": "object"}))
    no_tools_template = SimpleNamespace(chat_template="{{ messages }}", tool_parser=print)
    no_parser = SimpleNamespace(chat_template="{{ tools }}", tool_parser=None)

    for tokenizer in (no_tools_template, no_parser):
        offered = plan(tokenizer, tools=tools)  # answered in text, the tools named
        assert offered.dropped_tools == ("f", "g")
        assert not offered.parse_tools and "tools" not in offered.template_kwargs
        assert offered.grammar is None
    with pytest.raises(APIError, match="does not render tools.*remove `tool_choice`"):
        plan(no_tools_template, tools=tools, tool_choice="required")
    with pytest.raises(APIError, match="no tool-call format.*remove `tool_choice`"):
        plan(no_parser, tools=tools, tool_choice="f")
    # tool_choice "none" only shows the tools; nothing is parsed, so no parser is needed
    shown = plan(no_parser, tools=tools, tool_choice="none")
    assert shown.parse_tools is False and shown.dropped_tools == ()
    assert [t["function"]["name"] for t in shown.template_kwargs["tools"]] == ["f", "g"]
