"""One client's unread streams against another client's chats (issue 51's attack), over HTTP.

    python -m benchmarks.unread_streams --model SmolLM2-135M-Instruct --streams 64

Key A opens `--streams` streamed chats of `--stream-tokens` tokens each and never reads
them (an answer that size fits in the loopback socket's buffers: nothing pushes back); then
key B sends `--chats` 8-token chats one after another. Prints B's latency alone, beside A's
streams with fair share while running (parking, actors/scheduler/seats.py), and beside them
with parking turned off (the scheduler as it was: fair share only orders who starts), in
the same run, medians of each. Bounded: A's streams are closed after B's chats; 127.0.0.1
only.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from contextlib import AsyncExitStack

import httpx

from stepline.actors.scheduler import policy
from stepline.actors.scheduler.seats import NO_MOVES
from stepline.api import Engine
from stepline.api.http.app import create_app
from stepline.api.http.serve import serve_in_process
from stepline.api.pipeline.served import OneModel


def chat(text: str, max_tokens: int, *, stream: bool = False) -> dict:
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


async def b_latencies(http: httpx.AsyncClient, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        r = await http.post(
            "/v1/chat/completions",
            json=chat(f"Name a color, please ({i}).", 8),
            headers={"authorization": "Bearer sk-b"},
        )
        r.raise_for_status()
        out.append(time.perf_counter() - t0)
    return out


async def beside_unread(http: httpx.AsyncClient, args: argparse.Namespace) -> list[float]:
    async with AsyncExitStack() as streams:
        for i in range(args.streams):
            r = await streams.enter_async_context(
                http.stream(
                    "POST",
                    "/v1/chat/completions",
                    json=chat(f"Tell a long tale number {i}.", args.stream_tokens, stream=True),
                    headers={"authorization": "Bearer sk-a"},
                )
            )
            r.raise_for_status()
        await asyncio.sleep(args.settle_s)  # A's streams decode, unread
        return await b_latencies(http, args.chats)


async def main(args: argparse.Namespace) -> None:
    async with (
        Engine.open(args.model, max_num_seqs=args.max_num_seqs) as engine,
        serve_in_process(create_app(OneModel(engine))) as url,
        httpx.AsyncClient(base_url=url, timeout=600) as http,
    ):
        await b_latencies(http, 2)  # warm
        alone = await b_latencies(http, args.chats)
        parked = await beside_unread(http, args)
        loop = engine.step_loop
        await loop.wait_until(lambda: not loop.states)  # A's cancelled streams end
        seat_moves = policy.seat_moves
        policy.seat_moves = lambda live, n: NO_MOVES  # the scheduler before parking
        try:
            unparked = await beside_unread(http, args)
        finally:
            policy.seat_moves = seat_moves
    med = statistics.median
    print(f"model {args.model}, {args.streams} unread streams of {args.stream_tokens} tokens")
    print(f"B's 8-token chat alone:                     median {med(alone):.2f} s")
    print(f"beside A's unread streams, parking on:      median {med(parked):.2f} s")
    print(f"beside A's unread streams, parking off:     median {med(unparked):.2f} s")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="stepline-demo")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=2000)
    p.add_argument("--chats", type=int, default=5)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--settle-s", type=float, default=3.0)
    asyncio.run(main(p.parse_args()))
