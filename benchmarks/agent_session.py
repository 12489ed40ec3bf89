"""A coding agent's session, built to the shape Claude Code sends, through the Anthropic and
OpenAI chat doors: prompt tokens computed per turn against the only-new ideal, TTFT per turn,
and why each turn's prefix-cache hit stopped where it did (issue 52); with `--peer`, the same
session against mlx_lm.server and vllm-mlx on the same weights.

    python -m benchmarks.agent_session --model stepline-demo-hybrid-mid --peer mlx_lm vllm_mlx \\
        --vllm-mlx-bin /tmp/vm/bin/vllm-mlx
    python -m benchmarks.agent_session --no-tool-choice --peer   # SmolLM2: no tool format

The session (deterministic): a long system prompt with tools; each turn the assistant calls
a tool and the client sends its result (`--result-words`) and a short user line; the quirks
of the real client are switchable:
  --reminder   a `<system-reminder>` appended to the newest user message, different every turn
               (older user messages keep none: it moves)
  --env-line   a line near the end of the system prompt that changes every turn (a clock)
Each turn forces a tool call (`tool_choice`; `--no-tool-choice` for a template with no
tool-call format) of at most `--max-tokens`, and the client takes `--think-s` to run it. A
server that makes no tool call (mlx_lm.server ignores `tool_choice`) gets the tool's result
as text in the next user message, so its session is the same size. Every request streams:
TTFT is the time to its first generated delta. Per turn it prints the prompt's tokens, those
served from the prefix cache (the usage's cached count, mlx_lm.server's too), those computed,
the ideal (what is new since the previous turn's prompt and answer: this prompt's tokens less
that prompt's and answer's, plus the reminder the client took off the previous user
message), TTFT, and the event log's reason for the miss (`ChunkPrefilled.prefix_miss`,
`prefix_shared`; stepline only). Token counts do not depend on the machine's load; the TTFT
columns do (compare them within one run, on a quiet machine if you can).

A peer runs in its best configuration for one agent session (`one_peer`): mlx_lm.server's
prompt cache (always on in mlx-lm 0.32) with `--prompt-cache-size 64` (`--peer-cache-size`)
and no byte limit, vllm-mlx's prefix cache (on by default). mlx_lm.server has no Anthropic
door, so every peer is compared through OpenAI chat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from stepline.engine.models import read_tokenizer
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
            body = {
                "model": a.served_name,
                "max_tokens": a.max_tokens,
                "system": system,
                "tools": anthropic_tools(),
                "tool_choice": {"type": "tool", "name": self.tool(turn)},
                "messages": messages,
                "temperature": 0,
            }
        else:
            body = {
                "model": a.served_name,
                "max_tokens": a.max_tokens,
                "messages": [{"role": "system", "content": system}, *messages],
                "tools": openai_tools(),
                "tool_choice": {"type": "function", "function": {"name": self.tool(turn)}},
                "temperature": 0,
            }
        if not a.tool_choice:  # a template with no tool-call format (SmolLM2's)
            del body["tool_choice"]
        return body

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
            if not results:  # a server that ignores `tool_choice`: its result as text
                nxt = f"Output:\n{result}\n\n{nxt}"
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
        if not message.get("tool_calls"):  # a server that ignores `tool_choice`
            nxt = f"Output:\n{result}\n\n{nxt}"
        self.messages.append({"role": "user", "content": nxt})


async def _events(response: httpx.Response) -> Any:
    async for line in response.aiter_lines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            yield json.loads(line[5:])


async def streamed(
    http: httpx.AsyncClient, door: str, body: dict[str, Any]
) -> tuple[dict[str, Any], str | None, float, float]:
    """`body` sent streaming: the response as the non-streaming door gives it (rebuilt from
    the frames), the request id header, the seconds to the first generated delta (text,
    reasoning or a tool call: TTFT) and to the end."""
    path = "/v1/messages" if door == "anthropic" else "/v1/chat/completions"
    extra = {} if door == "anthropic" else {"stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    async with http.stream("POST", path, json={**body, **extra, "stream": True}) as r:
        if r.is_error:
            await r.aread()
            raise SystemExit(f"{r.status_code} {r.text[:500]}")
        rid = r.headers.get("x-request-id")
        if door == "anthropic":
            blocks: list[dict[str, Any]] = []
            usage: dict[str, Any] = {}
            async for e in _events(r):
                if e["type"] == "message_start":
                    usage.update(e["message"]["usage"])
                elif e["type"] == "content_block_start":
                    blocks.append({**e["content_block"], "_json": ""})
                elif e["type"] == "content_block_delta":
                    first = first or time.perf_counter()
                    d, b = e["delta"], blocks[e["index"]]
                    if d["type"] == "text_delta":
                        b["text"] += d["text"]
                    elif d["type"] == "thinking_delta":
                        b["thinking"] += d["thinking"]
                    elif d["type"] == "signature_delta":
                        b["signature"] = d["signature"]
                    elif d["type"] == "input_json_delta":
                        b["_json"] += d["partial_json"]
                elif e["type"] == "message_delta":
                    usage.update({k: v for k, v in e["usage"].items() if v is not None})
            for b in blocks:
                text = b.pop("_json")
                if b["type"] == "tool_use" and text:
                    try:
                        b["input"] = json.loads(text)
                    except json.JSONDecodeError:  # cut by max_tokens: kept as it started
                        pass
            out: dict[str, Any] = {"content": blocks, "usage": usage}
        else:
            message: dict[str, Any] = {"role": "assistant", "content": ""}
            calls: dict[int, dict[str, Any]] = {}
            usage = {}
            async for e in _events(r):
                usage = e.get("usage") or usage
                for choice in e.get("choices") or []:
                    d = choice.get("delta") or {}
                    if d.get("content") or d.get("tool_calls") or d.get("reasoning"):
                        first = first or time.perf_counter()
                    message["content"] += d.get("content") or ""
                    for c in d.get("tool_calls") or []:
                        call = calls.setdefault(
                            c.get("index", len(calls)),
                            {
                                "id": "",
                                "type": "function",
                                "function": {"name": "", "arguments": ""},
                            },
                        )
                        call["id"] = c.get("id") or call["id"]
                        fn = c.get("function") or {}
                        call["function"]["name"] += fn.get("name") or ""
                        call["function"]["arguments"] += fn.get("arguments") or ""
            if calls:
                message["tool_calls"] = [calls[i] for i in sorted(calls)]
            out = {"choices": [{"message": message}], "usage": usage}
    end = time.perf_counter()
    return out, rid, (first or end) - t0, end - t0


async def run_door(
    door: str, args: argparse.Namespace, http: httpx.AsyncClient, count: Any
) -> list[dict]:
    session = Session(door, args)
    rows = []
    prev_prompt = prev_out = 0
    for turn in range(args.turns):
        try:
            body, rid, ttft, seconds = await streamed(http, door, session.body(turn))
        except SystemExit as exc:
            raise SystemExit(f"turn {turn}: {exc}") from None
        usage = body["usage"]
        if door == "anthropic":
            cached = usage.get("cache_read_input_tokens") or 0
            prompt, out = usage["input_tokens"] + cached, usage["output_tokens"]
        else:
            prompt, out = usage["prompt_tokens"], usage["completion_tokens"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        moved = count(reminder(turn - 1)) if turn and args.reminder else 0
        ideal = prompt if turn == 0 else max(1, prompt - prev_prompt - prev_out + moved)
        rows.append(
            {
                "turn": turn,
                "id": rid,
                "prompt": prompt,
                "cached": cached,
                "computed": prompt - cached,
                "ideal": ideal,
                "ttft": ttft,
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


PEER_NAMES = {"mlx_lm": "mlx_lm.server", "vllm_mlx": "vllm-mlx"}


async def one_peer(kind: str, args: argparse.Namespace) -> list[dict]:
    """The session through a peer's OpenAI chat door (mlx_lm.server has no Anthropic one), on
    the same weights (`served_model.served_dir`: the default model's GGUF in float32, as
    `stepline serve` holds it on the CPU backend, not the 4-bit directory, whose CPU quantized
    matmul is ~17x slower and would lose it the race for a reason that is not its cache), in
    its best configuration for one agent session:
    - mlx_lm.server: its prompt cache (always on in mlx-lm 0.32) holding `--peer-cache-size`
      prompts and no byte limit;
    - vllm-mlx: its prefix cache (on by default), `--vllm-mlx-args` added.
    Each is spawned as `benchmarks/http_load.py` spawns it (OpenBLAS loaded as stepline loads
    it). Its usage's `cached_tokens` says what it reused, where it says it."""
    from benchmarks.http_load import Spawned

    if kind == "mlx_lm":
        extra = [
            "--prompt-cache-size",
            str(args.peer_cache_size),
            "--max-tokens",
            str(args.max_tokens),
        ]
    else:
        extra = args.vllm_mlx_args.split()
    server = Spawned(kind, args.model, Path(tempfile.mkdtemp()), [], extra, args.vllm_mlx_bin)
    print(f"peer: {kind} {' '.join(server.proc.args[1:])} (log {server.log_path})")
    try:
        await server.wait_ready(limit_s=300)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as http:
            args.served_name = server.model  # a peer loads the model a request names
            tokenizer = read_tokenizer(Path(server.model))
            count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
            return await run_door("openai", args, http, count)
    finally:
        server.stop()


def print_rows(title: str, rows: list[dict], misses: dict) -> None:
    print(f"\n{title}:")
    print(
        f"{'turn':>4} {'prompt':>7} {'cached':>7} {'computed':>9} {'ideal':>6} "
        f"{'ttft_s':>7} {'s':>7}  miss"
    )
    for row in rows:
        why, shared = misses.get(row["id"], (None, 0))
        note = f"{why} at {shared}" if why else "-"
        print(
            f"{row['turn']:>4} {row['prompt']:>7} {row['cached']:>7} {row['computed']:>9} "
            f"{row['ideal']:>6} {row['ttft']:>7.2f} {row['seconds']:>7.2f}  {note}"
        )
    computed = sum(r["computed"] for r in rows)
    ideal = sum(r["ideal"] for r in rows)
    print(
        f"prompt {sum(r['prompt'] for r in rows)}, computed {computed} / ideal {ideal} = "
        f"{computed / ideal:.2f}x; TTFT sum {sum(r['ttft'] for r in rows):.2f} s"
    )


async def main(args: argparse.Namespace) -> None:
    results, misses = {}, {}
    ctx = None
    for door in args.doors:
        results[door], found, ctx = await one_door(door, args)
        misses.update(found)
    peers = [] if args.peer is None else (args.peer or ["mlx_lm"])
    for kind in peers:
        results[f"{PEER_NAMES[kind]} openai"] = await one_peer(kind, args)
    flags = [f for f, on in (("reminder", args.reminder), ("env-line", args.env_line)) if on]
    print(
        f"model {args.model} (context {ctx}), {args.turns} turns, "
        f"quirks: {', '.join(flags) or 'none'}"
    )
    for door, rows in results.items():
        peer = door.endswith(" openai")
        print_rows(door if peer else f"stepline {door}", rows, misses)
    for kind in peers:
        theirs = sum(r["ttft"] for r in results[f"{PEER_NAMES[kind]} openai"])
        for door in args.doors:
            ours = sum(r["ttft"] for r in results[door])
            print(f"TTFT sum, stepline {door} / {PEER_NAMES[kind]}: {ours / theirs:.2f}x")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--turns", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--think-s", type=float, default=1.0, help="the client's tool's time")
    p.add_argument("--system-words", type=int, default=900)
    p.add_argument("--result-words", type=int, nargs=2, default=(60, 220))
    p.add_argument(
        "--doors", nargs="*", default=["anthropic", "openai"], help="none: the peer alone"
    )
    p.add_argument("--reminder", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--env-line", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument(
        "--tool-choice",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="force a tool call each turn (off for a template with no tool-call format)",
    )
    p.add_argument(
        "--peer",
        nargs="*",
        choices=sorted(PEER_NAMES),
        default=None,
        help="run the same session against peers too (OpenAI chat, their cache on); alone: mlx_lm",
    )
    p.add_argument("--vllm-mlx-bin", default=None, help="the vllm-mlx executable (default: PATH's)")
    p.add_argument("--vllm-mlx-args", default="", help="vllm-mlx's own options")
    p.add_argument("--peer-cache-size", type=int, default=64, help="its --prompt-cache-size")
    p.add_argument(
        "--next-turn",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the server prefills each chat's next turn (--next-turn-prefill)",
    )
    asyncio.run(main(p.parse_args()))
