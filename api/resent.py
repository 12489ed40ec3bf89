"""What an agent's client rewrites in its history without changing what the model is meant
to see, as far as the conversation itself shows it (issue 52): a `<system-reminder>` that sits
on the newest user message and on no older one is one the client moves (Claude Code) — the
next request sends that message back without it. The next turn's prefill
(api/pipeline/next_turn.py) predicts the history without it; the prompt's checkpoints
(api/prompts.py) snapshot a recurrent or windowed cache where it begins.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

REMINDER = re.compile(r"\s*<system-reminder>.*?</system-reminder>\s*", re.DOTALL)


def as_resent(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as the client will send them back next time: a `<system-reminder>` on the
    newest user message, where no older user message has one, left off (an emptied message
    dropped); otherwise as they are."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return list(messages)
    last = users[-1]
    if not _has_reminder(messages[last]) or any(_has_reminder(messages[i]) for i in users[:-1]):
        return list(messages)
    content = messages[last]["content"]
    if isinstance(content, str):
        stripped: Any = REMINDER.sub("\n", content).strip()
    else:
        stripped = [
            p for p in content if not (p.get("type") == "text" and _is_reminder(p.get("text")))
        ]
    out = list(messages)
    if stripped:
        out[last] = {**messages[last], "content": stripped}
    else:
        del out[last]
    return out


def _has_reminder(message: dict[str, Any]) -> bool:
    content = message.get("content")
    if isinstance(content, str):
        return "<system-reminder>" in content
    if isinstance(content, list):
        return any(p.get("type") == "text" and _is_reminder(p.get("text")) for p in content)
    return False


def _is_reminder(text: Any) -> bool:
    return isinstance(text, str) and REMINDER.fullmatch(text) is not None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
