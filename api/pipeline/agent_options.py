"""Server-wide agent options: `--strict-max-tokens`, `--reasoning-parser`, `--chat-template
FILE` and `--default-chat-template-kwargs JSON`, checked against the served model at start-up.
No MLX."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from stepline.api.openai.schema import RequestError
from stepline.api.pipeline.agents import check_template_kwargs

# Names people know them by; each means "the think tags mlx-lm found in the vocabulary".
REASONING_PARSERS = ("auto", "qwen3", "deepseek_r1", "think")


def add_agent_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--strict-max-tokens",
        action="store_true",
        help="refuse (400) a max_tokens larger than the room left in the context; by default "
        "it is clamped to that room and the response's x-stepline-max-tokens header says so "
        "(agents such as Claude Code ask for 32000 whatever the model)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split the model's think block into `reasoning_content` (OpenAI) / thinking "
        "blocks (Anthropic); the tags are those mlx-lm finds in the vocabulary "
        "(<think>...</think> for Qwen3 and DeepSeek-R1)",
    )
    p.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        metavar="FILE",
        help="a Jinja chat template to use instead of the model's own",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="template arguments for every request, e.g. '{\"enable_thinking\": false}'; "
        "a request's chat_template_kwargs override them",
    )


def agent_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `create_app` keyword arguments of the flags above."""
    template = args.chat_template.read_text(encoding="utf-8") if args.chat_template else None
    return {
        "strict_max_tokens": args.strict_max_tokens,
        "reasoning_parser": args.reasoning_parser,
        "chat_template": template,
        "default_chat_template_kwargs": args.default_chat_template_kwargs,
    }


def configure(
    tokenizer: Any,
    *,
    reasoning_parser: str | None,
    chat_template: str | None,
    default_chat_template_kwargs: dict[str, Any] | None,
) -> tuple[bool, dict[str, Any]]:
    """Apply the chat template to `tokenizer`; return (split reasoning, default template
    kwargs). Raises ValueError naming the flag when the model cannot honour it."""
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
    except RequestError as exc:
        raise ValueError(f"--default-chat-template-kwargs: {exc.message}") from None
    return reasoning_parser is not None, defaults
