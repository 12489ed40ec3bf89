"""The next turn's prefix, ready before it arrives (issue 52).

An agent's next request sends this conversation back with the answer just given appended,
rendered by the chat template as a turn of the history: without its thinking where the
template drops it, its tool calls as the template writes them. That rendering is not what
the prefix cache holds at the answer's end (the tokens the model generated, the think block
included), so every turn would recompute the last answer and whatever follows its first
difference. So when a chat request ends, its conversation as the next request will render
it — up to where that request's own new message begins — is prefilled at once, while the
client runs its tools or its user reads: a request of its own (`next-…`, one token, its
client's, `Admitted.origin` "next-turn"), whose cache the prefix cache keeps (the next
request then starts from it). It runs only in what no client's request wants: it starts
while none waits, and is cancelled when one needs its seat or its KV
(actors/scheduler/background.py).

What a client rewrites without changing what the model is meant to see is predicted only
where the conversation itself shows it: a `<system-reminder>` that sits on the newest user
message and on no older one is one the client moves (Claude Code): the prediction leaves it
off. Nothing else is guessed; a prediction that misses costs that prefill and nothing else
(the next request's `prefix_miss` says where it broke).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog

from stepline.api.params import SamplingParams
from stepline.api.pipeline.chat import call_arguments, template_call
from stepline.api.pipeline.model_output import OutputFormat, split_output
from stepline.api.resent import as_resent, common_prefix

if TYPE_CHECKING:
    from stepline.api.engine import Engine

log = structlog.get_logger(__name__)

_DUMMIES = ("a", "b")  # two next user messages: where their renderings part is its start
_RUNNING: set[asyncio.Task[None]] = set()  # prefills under way (a task needs a reference)


def answer_message(
    text: str, fmt: OutputFormat, tools: Any, *, calls_as_input: bool = False
) -> dict[str, Any]:
    """The answer `text` as the neutral assistant message a client sends back: its content,
    its tool calls (their arguments as its door's client sends them back: the text the door
    gave, parsed as the door parses it; or with `calls_as_input` the parsed input object, {}
    for text that is not JSON), its reasoning."""
    delta = split_output(text, fmt, tools)
    message: dict[str, Any] = {"role": "assistant", "content": delta.content}
    if delta.tool_calls:
        message["tool_calls"] = [
            template_call(
                c.id,
                c.name,
                c.input if calls_as_input else call_arguments(c.arguments, "tool_calls"),
            )
            for c in delta.tool_calls
        ]
    if delta.reasoning:
        message["reasoning_content"] = delta.reasoning
    return message


class NextTurn:
    """One chat request's next turn, prefilled once it ends (`after`)."""

    def __init__(
        self,
        engine: Engine,
        request_id: str,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None,
        fmt: OutputFormat,
        tools: Any,
        client: str | None,
        prompt_ids: Sequence[int],
        *,
        calls_as_input: bool = False,
    ) -> None:
        self.engine, self.request_id = engine, request_id
        self.messages, self.template_kwargs = messages, template_kwargs
        self.fmt, self.tools, self.client = fmt, tools, client
        self.prompt_ids = prompt_ids  # the request's own: what the cache holds already
        self.calls_as_input = calls_as_input

    def after(self, text: str) -> None:
        """The request ended with `text`: prefill its next turn's prefix in the background."""
        task = asyncio.get_running_loop().create_task(self._prefill(text))
        _RUNNING.add(task)
        task.add_done_callback(_RUNNING.discard)

    async def prompt(self, text: str) -> list[int]:
        """The next request's tokens up to where its own new message begins (none where they
        are a prefix of the request's own prompt: the cache holds them)."""
        answer = answer_message(text, self.fmt, self.tools, calls_as_input=self.calls_as_input)
        history = [*as_resent(self.messages), answer]
        ends = []
        for dummy in _DUMMIES:
            prepared = await self.engine.prepare_async(
                None, [*history, {"role": "user", "content": dummy}], self.template_kwargs
            )
            ends.append(prepared.ids)
        ids = ends[0][: common_prefix(*ends)]
        held = common_prefix(ids, self.prompt_ids) == len(ids)
        return [] if held else list(ids)

    async def _prefill(self, text: str) -> None:
        engine = self.engine
        try:
            ids = await self.prompt(text)
            if not ids:
                return
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            stream = await engine.submit(
                ids,
                params=params,
                request_id=f"next-{self.request_id}",
                client=self.client,
                origin="next-turn",
            )
            async with stream:
                async for _ in stream:
                    pass
        except Exception as exc:  # noqa: BLE001 - an extra: the request it follows is done
            log.info("next_turn_skipped", request_id=self.request_id, reason=repr(exc))
