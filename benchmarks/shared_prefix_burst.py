"""Sixteen chats sent at once with one never-seen system prompt: how many prompt tokens the
engine computes, and their time to first token (issue 9's "requests that arrive together
share a new prefix").

    .venv/bin/python benchmarks/shared_prefix_burst.py [--model stepline-demo-large]
        [--system-tokens 3600] [--requests 16] [--prefix-cache-gb 1]

Prints the prompt tokens computed (from the event log's chunk-prefilled events) against
what the prompts need when the shared system prompt is computed once, and TTFT p50. Run it
again with `--prefix-cache-gb 0` for the engine without a prefix cache (every request
computes the whole prompt).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from stepline.api import Engine, SamplingParams
from stepline.events.log import read_events
from stepline.events.models import ChunkPrefilled

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]


async def run(args: argparse.Namespace, log: Path) -> None:
    rng = random.Random(0)
    async with Engine.open(args.model, event_log=log, prefix_cache_gb=args.prefix_cache_gb) as e:
        system = " ".join(rng.choice(WORDS) for _ in range(args.system_tokens))
        while len(e.tokenizer.encode(system)) > args.system_tokens:
            system = system[: int(len(system) * 0.95)]
        chats = [
            [
                {"role": "system", "content": system},
                {
                    "role": "user",
                    "content": f"question {i}: " + " ".join(rng.choice(WORDS) for _ in range(20)),
                },
            ]
            for i in range(args.requests)
        ]
        prompts = [e.encode(messages=c) for c in chats]
        shared = min(e.chat_checkpoints(chats[0], prompts[0]))
        ttft: list[float] = []

        async def one(chat: list[dict]) -> None:
            t0 = time.perf_counter()
            params = SamplingParams(max_tokens=2, temperature=0)
            async for out in e.generate(messages=chat, params=params):
                if out.token_ids:
                    ttft.append(time.perf_counter() - t0)
                    break

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for chat in chats:
                tg.start_soon(one, chat)
        wall = time.perf_counter() - t0
    computed = sum(ev.end - ev.start for ev in read_events(log) if isinstance(ev, ChunkPrefilled))
    needed = len(prompts[0]) + sum(len(p) - shared for p in prompts[1:])
    print(
        f"model {args.model}, {args.requests} prompts of ~{len(prompts[0])} tokens sharing "
        f"{shared}; prefix cache {args.prefix_cache_gb} GB"
    )
    print(
        f"prompt tokens computed: {computed} (the shared prefix once: {needed}; "
        f"ratio {computed / needed:.2f}; every prompt whole: {sum(map(len, prompts))})"
    )
    print(f"TTFT p50 {statistics.median(ttft):.2f} s, max {max(ttft):.2f} s; wall {wall:.1f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="stepline-demo-large")
    p.add_argument("--system-tokens", type=int, default=3600)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prefix-cache-gb", type=float, default=1.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(run, args, Path(tmp) / "run.jsonl")


if __name__ == "__main__":
    main()
