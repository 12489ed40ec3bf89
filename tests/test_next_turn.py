"""An agent's next turn starts where its new message begins: when a chat ends, the server
prefills the conversation as the next request sends it back (api/pipeline/next_turn.py), so
that request finds it cached — through the OpenAI and Anthropic doors, on a dense and a
hybrid model, with a client that moves its `<system-reminder>`; real HTTP, the event log's
first chunks as the evidence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from helpers import replay, wait_until

from stepline.actors.scheduler.background import STALE
from stepline.api import Engine, SamplingParams
from stepline.api.http.app import create_app
from stepline.api.http.serve import serve_in_process
from stepline.api.pipeline.next_turn import as_resent
from stepline.api.pipeline.served import OneModel
from stepline.api.resent import common_prefix
from stepline.events.log import read_events
from stepline.events.models import Admitted, ChunkPrefilled, Terminal

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "Bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"arg": {"type": "string"}},
                "required": ["arg"],
            },
        },
    }
]
REMINDER = "<system-reminder>the date is {}</system-reminder>"


def test_a_reminder_the_client_moves_is_left_off_the_resent_history():
    older = {"role": "user", "content": "Fix the test."}
    newest = {"role": "user", "content": "Go on.\n" + REMINDER.format(1)}
    assistant = {"role": "assistant", "content": "ok"}
    resent = as_resent([older, assistant, newest])
    assert resent[-1] == {"role": "user", "content": "Go on."}
    # a client that keeps its reminders in the history keeps them here too
    kept = {"role": "user", "content": "Fix the test.\n" + REMINDER.format(0)}
    assert as_resent([kept, assistant, newest]) == [kept, assistant, newest]
    # a message that was only the reminder is gone
    parts = [{"type": "text", "text": REMINDER.format(2)}]
    assert as_resent([older, assistant, {"role": "user", "content": parts}]) == [older, assistant]


def _chat(messages: list[dict[str, Any]], model: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "Bash"}},
        "max_tokens": 40,
        "temperature": 0,
    }


async def _two_turns(model: str, path: Path, *, next_turn: bool) -> tuple[int, int, int]:
    """Two turns of an agent that echoes its answer and moves its reminder: (the second
    turn's prompt tokens, those it found cached, the tokens of the prefix the server
    prefilled for it; 0 where none)."""
    options = {} if next_turn else {"next_turn_prefill": False}  # on by default
    async with (
        Engine.open(model, event_log=path, max_num_seqs=4) as engine,
        serve_in_process(create_app(OneModel(engine), **options)) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        name = engine.model_name
        history: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent. Be brief."},
            {"role": "user", "content": "Fix the failing test."},
        ]
        sent = [
            *history[:-1],
            {**history[-1], "content": history[-1]["content"] + "\n" + REMINDER.format(1)},
        ]
        r = await http.post("/v1/chat/completions", json=_chat(sent, name))
        assert r.status_code == 200, r.text
        first = r.headers["x-request-id"]
        message = r.json()["choices"][0]["message"]
        loop = engine.step_loop
        if next_turn:  # the client runs its tool meanwhile
            await wait_until(
                loop, lambda: (s := loop.state_of(f"next-{first}")) is not None and s.is_finished
            )
        call = message["tool_calls"][0]
        history += [
            {"role": "assistant", "content": message.get("content") or "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "1 failed, 3 passed"},
            {"role": "user", "content": "Go on.\n" + REMINDER.format(2)},
        ]
        r = await http.post("/v1/chat/completions", json=_chat(history, name))
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
    events = list(read_events(path))
    predicted = [e for e in events if isinstance(e, Admitted) and e.request_id == f"next-{first}"]
    return (
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
        predicted[0].num_prompt_tokens if predicted else 0,
    )


@pytest.mark.parametrize("model", ["stepline-demo", "stepline-demo-hybrid"])
async def test_the_next_turn_finds_its_history_cached_up_to_its_new_messages(
    model, model_cache_dir, tmp_path: Path
):
    prompt, cached, predicted = await _two_turns(model, tmp_path / "on.jsonl", next_turn=True)
    assert predicted and cached == predicted  # the whole prediction was its prefix
    # the rest is the tool's result and the new user message, no more
    events = list(read_events(tmp_path / "on.jsonl"))
    real = [
        e.request_id
        for e in events
        if isinstance(e, Admitted) and not e.request_id.startswith("next-")
    ]
    second = next(e for e in events if isinstance(e, ChunkPrefilled) and e.request_id == real[1])
    assert second.prefix_shared == predicted
    # the second turn computes only what is new: well within 1.1x of it
    assert prompt - cached <= 1.1 * (prompt - predicted)
    # the log, and replay, tell the engine's own request from the clients'
    ours = [e for e in events if isinstance(e, Admitted) and e.origin == "next-turn"]
    assert ours[0].request_id == f"next-{real[0]}"  # (the second turn's may follow)
    status, summary = replay(str(tmp_path / "on.jsonl"))
    assert status == 0 and "requests: 2 (" in summary
    assert "next turns prefilled by the engine: " in summary
    status, verified = replay(str(tmp_path / "on.jsonl"), "--verify")
    assert status == 0, verified
    # without it, the turn recomputes from the reminder the client moved
    _, cached_off, _ = await _two_turns(model, tmp_path / "off.jsonl", next_turn=False)
    assert cached_off < cached
    assert prompt > cached


async def test_a_next_turn_prefill_its_clients_next_request_outran_is_ended(
    model_cache_dir, tmp_path: Path
):
    """One seat, held by a chat; a next turn's prefill waits for it; the client's next
    request arrives, and differs: the prefill is cancelled at once (it frees its place in
    the queue, and would hold a seat and KV for nothing), not run once the seat is free."""
    path = tmp_path / "events.jsonl"
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    async with Engine.open("stepline-demo", event_log=path, max_num_seqs=1) as engine:
        holder = await engine.submit(
            list(range(5, 25)),
            params=greedy.model_copy(update={"max_tokens": 1000}),
            client="x",
        )
        history = [5 + i % 300 for i in range(120)]
        prefill = await engine.submit(
            history, params=greedy, request_id="next-a", client="x", origin="next-turn"
        )
        turn = await engine.submit(
            [*history[:100], 400, 401], params=greedy, request_id="turn-2", client="x"
        )
        with anyio.fail_after(60):
            outs = [out async for out in prefill]
            await holder.aclose()  # the seat is the client's next request's now
            answer = [out async for out in turn]
    assert outs[-1].finish_reason == "cancelled" and not any(o.token_ids for o in outs)
    assert answer[-1].finish_reason == "length"
    events = list(read_events(path))
    ended = next(e for e in events if isinstance(e, Terminal) and e.request_id == "next-a")
    assert ended.message == STALE
    assert not any(isinstance(e, ChunkPrefilled) and e.request_id == "next-a" for e in events)


@pytest.mark.parametrize("model", ["stepline-demo-hybrid", "stepline-demo-sliding"])
async def test_a_next_turn_not_prefilled_still_starts_where_the_moved_reminder_began(
    model, model_cache_dir
):
    """No next-turn prefill (the Python API makes none; over HTTP: the client's tools were
    quicker than it): on a cache served only where it was snapshotted, the next turn still
    reuses the history up to where the client took its reminder off, not only up to the
    newest user message's start (before the tool's result it carried)."""
    result = "1 failed, 3 passed: test_parse fails on an empty line. " * 3 + "Done."
    first = [
        {"role": "system", "content": "You are a coding agent. Be brief."},
        {"role": "user", "content": "Fix the failing test."},
        {"role": "assistant", "content": "Running the tests."},
        {"role": "user", "content": result + "\n" + REMINDER.format(1)},
    ]
    second = [
        *first[:3],
        {"role": "user", "content": result},
        {"role": "assistant", "content": "Reading the parser."},
        {"role": "user", "content": "Go on.\n" + REMINDER.format(2)},
    ]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    async with Engine.open(model, max_step_tokens=64, max_num_seqs=4) as engine:
        a, b = engine.prepare(messages=first), engine.prepare(messages=second)
        shared = common_prefix(a.ids, b.ids)
        assert max(c for c in a.checkpoints if c < shared) > 0  # the newest user message's
        for messages in (first, second):
            stream = await engine.submit(messages=messages, params=greedy)
            outs = [out async for out in stream]
    assert outs[-1].num_cached_tokens == shared  # everything the client did not rewrite
