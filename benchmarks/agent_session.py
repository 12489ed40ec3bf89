"""A coding agent's session, built to the shape Claude Code sends, through the Anthropic and
OpenAI chat doors: prompt tokens computed per turn against the only-new ideal, and why each
turn's prefix-cache hit stopped where it did (issue 52).

    python -m benchmarks.agent_session --model SmolLM2-135M-Instruct
    python -m benchmarks.agent_session --model stepline-demo-hybrid --context 8192

The session (deterministic): a long system prompt with tools; each turn the assistant calls
a tool and the client sends its result (`--result-tokens`, 200-2,000 by default scaled to the
context) and a short user line; the quirks of the real client are switchable:
  --reminder   a `<system-reminder>` appended to the newest user message, different every turn
               (older user messages keep none: it moves)
  --env-line   a line near the end of the system prompt that changes every turn (a clock)
Each request asks for a few tokens (`--max-tokens`). Per turn it prints the prompt's tokens,
those served from the prefix cache, those computed, the ideal (what is new since the previous
turn's prompt and answer), and the event log's reason for the miss
(`ChunkPrefilled.prefix_miss`, `prefix_shared`). Token counts do not depend on the machine's
load; the TTFT column does (run it on a quiet machine for that).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from stepline.api import Engine
from stepline.api.http.app import create_app
from stepline.api.http.serve import serve_in_process
from stepline.api.pipeline.served import OneModel
from stepline.events.log import read_events
from stepline.events.models import ChunkPrefilled

WORDS = (
    "file function class module import return value error test build path line change "
    "read write list search edit run command output status branch commit diff patch"
).split()

TOOLS = [
    ("Bash", "Run a shell command and return its output."),
    ("Read", "Read a file from the working tree."),
    ("Edit", "Replace a string in a file."),
    ("Write", "Write a whole file."),
    ("Grep", "Search files for a pattern."),
    ("Glob", "List files matching a glob."),
    ("TodoWrite", "Update the task list."),
    ("WebFetch", "Fetch a URL."),
]


def prose(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def reminder(turn: int) -> str:
    """What the client appends to the newest user message: different every turn."""
    return f"<system-reminder>turn {turn}: {prose(random.Random(turn), 12)}</system-reminder>"


def system_prompt(rng: random.Random, n_words: int, turn: int, env_line: bool) -> str:
    body = prose(rng, n_words)
    env = f"\nCurrent time: 2026-12-02 10:{turn:02d}:00 UTC" if env_line else ""
    return f"You are a coding agent. {body}{env}\nAnswer briefly."


def anthropic_tools() -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "description": desc,
            "input_schema": {
                "type": "object",
                "properties": {"arg": {"type": "string"}},
                "required": ["arg"],
            },
        }
        for name, desc in TOOLS
    ]


def openai_tools() -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t["description"],
                "parameters": t["input_schema"],
            },
        }
        for t in anthropic_tools()
    ]


class Session:
    """The conversation so far, door-neutral: (role, text, tool call or result) turns."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(0)
        self.system_words = args.system_words
        self.history: list[dict[str, Any]] = []  # {"kind": "user"|"call"|"result", ...}
        self.history.append({"kind": "user", "text": "Fix the failing test in the repo."})

    def add_turn(self, turn: int, answer: str) -> None:
        lo, hi = self.args.result_words
        self.history.append(
            {
                "kind": "call",
                "id": f"call_{turn}",
                "tool": TOOLS[turn % len(TOOLS)][0],
                "arg": f"step {turn}",
                "text": answer,
            }
        )
        self.history.append(
            {
                "kind": "result",
                "id": f"call_{turn}",
                "text": prose(self.rng, self.rng.randint(lo, hi)),
            }
        )
        self.history.append({"kind": "user", "text": f"Go on with step {turn + 1}."})

    def anthropic_body(self, turn: int) -> dict[str, Any]:
        a = self.args
        messages: list[dict[str, Any]] = []
        last_user = max(i for i, h in enumerate(self.history) if h["kind"] in ("user", "result"))
        for i, h in enumerate(self.history):
            if h["kind"] == "call":
                messages.append(
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "text", "text": h["text"]},
                            {
                                "type": "tool_use",
                                "id": h["id"],
                                "name": h["tool"],
                                "input": {"arg": h["arg"]},
                            },
                        ],
                    }
                )
                continue
            block = (
                {"type": "tool_result", "tool_use_id": h["id"], "content": h["text"]}
                if h["kind"] == "result"
                else {"type": "text", "text": h["text"]}
            )
            if messages and messages[-1]["role"] == "user":
                messages[-1]["content"].append(block)
            else:
                messages.append({"role": "user", "content": [block]})
            if i == last_user and a.reminder:
                messages[-1]["content"].append(
                    {
                        "type": "text",
                        "text": reminder(turn),
                    }
                )
        return {
            "model": a.served_name,
            "max_tokens": a.max_tokens,
            "system": system_prompt(random.Random(1), self.system_words, turn, a.env_line),
            "tools": anthropic_tools(),
            "messages": messages,
            "temperature": 0,
        }

    def openai_body(self, turn: int) -> dict[str, Any]:
        a = self.args
        messages: list[dict[str, Any]] = [
            {
                "role": "system",
                "content": system_prompt(random.Random(1), self.system_words, turn, a.env_line),
            }
        ]
        last_user = max(i for i, h in enumerate(self.history) if h["kind"] == "user")
        for i, h in enumerate(self.history):
            if h["kind"] == "call":
                messages.append(
                    {
                        "role": "assistant",
                        "content": h["text"],
                        "tool_calls": [
                            {
                                "id": h["id"],
                                "type": "function",
                                "function": {
                                    "name": h["tool"],
                                    "arguments": f'{{"arg": "{h["arg"]}"}}',
                                },
                            }
                        ],
                    }
                )
            elif h["kind"] == "result":
                messages.append({"role": "tool", "tool_call_id": h["id"], "content": h["text"]})
            else:
                text = h["text"]
                if i == last_user and a.reminder:
                    text += "\n" + reminder(turn)
                messages.append({"role": "user", "content": text})
        return {
            "model": a.served_name,
            "max_tokens": a.max_tokens,
            "messages": messages,
            "tools": openai_tools(),
            "temperature": 0,
        }


async def run_door(door: str, args: argparse.Namespace, http: httpx.AsyncClient) -> list[dict]:
    session = Session(args)
    rows = []
    prev_prompt = prev_out = 0
    for turn in range(args.turns):
        t0 = time.perf_counter()
        if door == "anthropic":
            r = await http.post("/v1/messages", json=session.anthropic_body(turn))
            r.raise_for_status()
            body = r.json()
            usage = body["usage"]
            cached = usage.get("cache_read_input_tokens") or 0
            prompt = usage["input_tokens"] + cached
            out = usage["output_tokens"]
            text = "".join(b.get("text", "") for b in body["content"] if b["type"] == "text")
        else:
            r = await http.post("/v1/chat/completions", json=session.openai_body(turn))
            r.raise_for_status()
            body = r.json()
            usage = body["usage"]
            prompt = usage["prompt_tokens"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            out = usage["completion_tokens"]
            text = body["choices"][0]["message"].get("content") or ""
        seconds = time.perf_counter() - t0
        ideal = prompt if turn == 0 else max(1, prompt - prev_prompt - prev_out)
        rows.append(
            {
                "turn": turn,
                "id": r.headers["x-request-id"],
                "prompt": prompt,
                "cached": cached,
                "computed": prompt - cached,
                "ideal": ideal,
                "seconds": seconds,
            }
        )
        prev_prompt, prev_out = prompt, out
        session.add_turn(turn, text.strip()[:200] or "Working on it.")
    return rows


async def one_door(door: str, args: argparse.Namespace) -> tuple[list[dict], dict, int]:
    """The session through `door`, on an engine of its own (nothing cached from another
    door's run): its rows, each request's miss from the event log, the model's context."""
    log = Path(tempfile.mkdtemp()) / "events.jsonl"
    async with (
        Engine.open(args.model, event_log=log, max_num_seqs=4) as engine,
        serve_in_process(create_app(OneModel(engine))) as url,
        httpx.AsyncClient(base_url=url, timeout=600) as http,
    ):
        args.served_name = engine.model_name
        rows = await run_door(door, args, http)
        ctx = engine.max_context
    misses = {}
    for e in read_events(log):
        if isinstance(e, ChunkPrefilled) and e.request_id not in misses:
            misses[e.request_id] = (e.prefix_miss, e.prefix_shared)
    return rows, misses, ctx


async def main(args: argparse.Namespace) -> None:
    results, misses = {}, {}
    for door in args.doors:
        results[door], found, ctx = await one_door(door, args)
        misses.update(found)
    flags = [f for f, on in (("reminder", args.reminder), ("env-line", args.env_line)) if on]
    print(
        f"model {args.model} (context {ctx}), {args.turns} turns, "
        f"quirks: {', '.join(flags) or 'none'}"
    )
    for door, rows in results.items():
        print(f"\n{door} door:")
        print(
            f"{'turn':>4} {'prompt':>7} {'cached':>7} {'computed':>9} {'ideal':>6} {'s':>7}  miss"
        )
        for row in rows:
            why, shared = misses.get(row["id"], (None, 0))
            note = f"{why} at {shared}" if why else "-"
            print(
                f"{row['turn']:>4} {row['prompt']:>7} {row['cached']:>7} {row['computed']:>9} "
                f"{row['ideal']:>6} {row['seconds']:>7.2f}  {note}"
            )
        computed = sum(r["computed"] for r in rows)
        ideal = sum(r["ideal"] for r in rows)
        print(
            f"computed {computed} / ideal {ideal} = {computed / ideal:.2f}x; "
            f"TTFT sum {sum(r['seconds'] for r in rows):.1f} s"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--turns", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--system-words", type=int, default=900)
    p.add_argument("--result-words", type=int, nargs=2, default=(60, 220))
    p.add_argument("--doors", nargs="+", default=["anthropic", "openai"])
    p.add_argument("--reminder", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--env-line", action=argparse.BooleanOptionalAction, default=False)
    asyncio.run(main(p.parse_args()))
