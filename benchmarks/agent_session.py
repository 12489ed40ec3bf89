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
Each turn forces a tool call (`tool_choice`) of at most `--max-tokens`, and the client takes
`--think-s` to run it. Per turn it prints the prompt's tokens, those served from the prefix
cache, those computed, the ideal (what is new since the previous turn's prompt and answer:
this prompt's tokens less that prompt's and answer's, plus the reminder the client took off
the previous user message), and the event log's reason for the miss
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
    """The conversation so far, as one door sends it: the model's answers echoed back as it
    gave them (its text and tool calls: a tool call is forced every turn), each followed by
    that tool's result and a short user line."""

    def __init__(self, door: str, args: argparse.Namespace) -> None:
        self.door, self.args = door, args
        self.rng = random.Random(0)
        self.messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Fix the failing test in the repo."}
        ]

    def tool(self, turn: int) -> str:
        return TOOLS[turn % len(TOOLS)][0]

    def body(self, turn: int) -> dict[str, Any]:
        a = self.args
        system = system_prompt(random.Random(1), a.system_words, turn, a.env_line)
        messages = [dict(m) for m in self.messages]
        last = messages[-1]
        if a.reminder:  # on the newest user message only: it moves
            if self.door == "anthropic":
                content = last["content"]
                blocks = (
                    content if isinstance(content, list) else [{"type": "text", "text": content}]
                )
                last["content"] = [*blocks, {"type": "text", "text": reminder(turn)}]
            else:
                last["content"] = f"{last['content']}\n{reminder(turn)}"
        if self.door == "anthropic":
            return {
                "model": a.served_name,
                "max_tokens": a.max_tokens,
                "system": system,
                "tools": anthropic_tools(),
                "tool_choice": {"type": "tool", "name": self.tool(turn)},
                "messages": messages,
                "temperature": 0,
            }
        return {
            "model": a.served_name,
            "max_tokens": a.max_tokens,
            "messages": [{"role": "system", "content": system}, *messages],
            "tools": openai_tools(),
            "tool_choice": {"type": "function", "function": {"name": self.tool(turn)}},
            "temperature": 0,
        }

    def answered(self, turn: int, body: dict[str, Any]) -> None:
        """The answer goes back as it came; then its tools' results and the next user line."""
        lo, hi = self.args.result_words
        result = prose(self.rng, self.rng.randint(lo, hi))
        nxt = f"Go on with step {turn + 1}."
        if self.door == "anthropic":
            blocks = [b for b in body["content"] if b["type"] in ("text", "tool_use", "thinking")]
            self.messages.append({"role": "assistant", "content": blocks})
            results = [
                {"type": "tool_result", "tool_use_id": b["id"], "content": result}
                for b in blocks
                if b["type"] == "tool_use"
            ]
            self.messages.append(
                {"role": "user", "content": [*results, {"type": "text", "text": nxt}]}
            )
            return
        message = body["choices"][0]["message"]
        echo = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            echo["tool_calls"] = message["tool_calls"]
        self.messages.append(echo)
        for call in message.get("tool_calls") or []:
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        self.messages.append({"role": "user", "content": nxt})


async def run_door(
    door: str, args: argparse.Namespace, http: httpx.AsyncClient, count: Any
) -> list[dict]:
    session = Session(door, args)
    rows = []
    prev_prompt = prev_out = 0
    for turn in range(args.turns):
        t0 = time.perf_counter()
        path = "/v1/messages" if door == "anthropic" else "/v1/chat/completions"
        r = await http.post(path, json=session.body(turn))
        if r.is_error:
            raise SystemExit(f"turn {turn}: {r.status_code} {r.text[:500]}")
        body = r.json()
        usage = body["usage"]
        if door == "anthropic":
            cached = usage.get("cache_read_input_tokens") or 0
            prompt, out = usage["input_tokens"] + cached, usage["output_tokens"]
        else:
            prompt, out = usage["prompt_tokens"], usage["completion_tokens"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        seconds = time.perf_counter() - t0
        moved = count(reminder(turn - 1)) if turn and args.reminder else 0
        ideal = prompt if turn == 0 else max(1, prompt - prev_prompt - prev_out + moved)
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
        session.answered(turn, body)
        await asyncio.sleep(args.think_s)  # the client runs its tool
    return rows


async def one_door(door: str, args: argparse.Namespace) -> tuple[list[dict], dict, int]:
    """The session through `door`, on an engine of its own (nothing cached from another
    door's run): its rows, each request's miss from the event log, the model's context."""
    log = Path(tempfile.mkdtemp()) / "events.jsonl"
    async with (
        Engine.open(args.model, event_log=log, max_num_seqs=4) as engine,
        serve_in_process(create_app(OneModel(engine), next_turn_prefill=args.next_turn)) as url,
        httpx.AsyncClient(base_url=url, timeout=600) as http,
    ):
        args.served_name = engine.model_name
        tokenizer = engine.tokenizer
        count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        rows = await run_door(door, args, http, count)
        ctx = engine.max_context
    misses = {}
    nexts = 0
    for e in read_events(log):
        if isinstance(e, ChunkPrefilled) and e.request_id.startswith("next-"):
            nexts += e.request_id not in misses
        if isinstance(e, ChunkPrefilled) and e.request_id not in misses:
            misses[e.request_id] = (e.prefix_miss, e.prefix_shared)
    print(f"{door}: {nexts} next-turn prefills (log {log})")
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
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--think-s", type=float, default=1.0, help="the client's tool's time")
    p.add_argument("--system-words", type=int, default=900)
    p.add_argument("--result-words", type=int, nargs=2, default=(60, 220))
    p.add_argument("--doors", nargs="+", default=["anthropic", "openai"])
    p.add_argument("--reminder", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--env-line", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument(
        "--next-turn",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the server prefills each chat's next turn (--next-turn-prefill)",
    )
    asyncio.run(main(p.parse_args()))
