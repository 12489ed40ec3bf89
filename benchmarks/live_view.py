"""The live view's cost to the engine (issue 57's targets), over HTTP, in one run.

    python -m benchmarks.live_view --model SmolLM2-135M-Instruct --rounds 3 --stall-s 60

A burst of `--requests` streamed chats of `--tokens` tokens, sent at once to a real server
(127.0.0.1), alternately alone and watched by `--pages` dashboard pages (headless Chromium,
where a `chromium` binary is installed) and `--readers` raw `/v1/events` readers; prints the
burst's throughput (output tokens a second) and median TTFT both ways, medians of `--rounds`.
Then, with `--stall-s`, a reader that opens `/v1/events` and stops reading for that long while
bursts run, against none: the server's RSS and the steps' median and p99 time both ways.
Keep it short on a busy machine (the figures are noisy there: say so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import tempfile
import time
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx

from stepline.api import Engine
from stepline.api.http.app import create_app
from stepline.api.http.serve import serve_in_process
from stepline.api.pipeline.served import OneModel


async def one_chat(http: httpx.AsyncClient, i: int, tokens: int) -> tuple[float, int]:
    """(TTFT, tokens) of one streamed chat."""
    body = {
        "messages": [{"role": "user", "content": f"Tell a short story, number {i}."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft, n = None, 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                n += 1
    return ttft if ttft is not None else float("nan"), n


async def burst(http: httpx.AsyncClient, args: argparse.Namespace) -> tuple[float, float]:
    """(output tokens a second, median TTFT) of one burst."""
    t0 = time.perf_counter()
    got = await asyncio.gather(*(one_chat(http, i, args.tokens) for i in range(args.requests)))
    wall = time.perf_counter() - t0
    return sum(n for _, n in got) / wall, statistics.median(t for t, _ in got)


async def raw_reader(url: str) -> None:
    async with (
        httpx.AsyncClient(base_url=url, timeout=None) as http,
        http.stream("GET", "/v1/events", params={"after": "now"}) as r,
    ):
        async for _ in r.aiter_bytes():
            pass


@asynccontextmanager
async def watchers(url: str, args: argparse.Namespace) -> Any:
    """`--pages` headless Chromium pages on /dashboard/ and `--readers` raw readers."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    async with AsyncExitStack() as stack:
        procs = []
        if chromium is not None:
            for _ in range(args.pages):
                profile = stack.enter_context(
                    tempfile.TemporaryDirectory(ignore_cleanup_errors=True)
                )
                procs.append(
                    await asyncio.create_subprocess_exec(
                        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        f"--user-data-dir={profile}", "--remote-debugging-port=0",
                        f"{url}/dashboard/",
                        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                    )
                )  # fmt: skip
        tasks = [asyncio.create_task(raw_reader(url)) for _ in range(args.readers)]
        await asyncio.sleep(args.settle_s)  # the pages load and connect
        try:
            yield len(procs)
        finally:
            for t in tasks:
                t.cancel()
            for p in procs:
                p.terminate()
                await p.wait()


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def step_times(engine: Any, after: int) -> list[float]:
    feed = engine.step_loop.feed
    out = []
    for n in range(max(after + 1, feed.first), feed.last + 1):
        e = feed._events[n % feed.capacity]
        if e.type == "step-finished":
            out.append(e.seconds)
    return out


async def stalled(url: str, engine: Any, http: httpx.AsyncClient, args, stall: bool) -> dict:
    """RSS and steps' times over `--stall-s` of bursts, with a reader that stopped reading."""
    sock = None
    if stall:
        host, port = url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /v1/events?after=now HTTP/1.1\r\nHost: x\r\n\r\n")  # never read
    start, peak = engine.step_loop.feed.last, rss_mb()
    end = time.monotonic() + args.stall_s
    while time.monotonic() < end:
        await burst(http, args)
        peak = max(peak, rss_mb())
    times = sorted(step_times(engine, start))
    if sock is not None:
        sock.close()
    return {
        "rss_mb": round(peak, 1),
        "step_p50_ms": round(1000 * statistics.median(times), 2),
        "step_p99_ms": round(1000 * times[int(0.99 * (len(times) - 1))], 2),
        "steps": len(times),
    }


async def main(args: argparse.Namespace) -> None:
    async with (
        Engine.open(args.model, max_num_seqs=args.max_num_seqs) as engine,
        serve_in_process(create_app(OneModel(engine))) as url,
        httpx.AsyncClient(base_url=url, timeout=600) as http,
    ):
        await burst(http, args)  # warm
        alone, watched = [], []
        for _ in range(args.rounds):
            alone.append(await burst(http, args))
            async with watchers(url, args) as num_pages:
                watched.append(await burst(http, args))
        med = statistics.median
        print(f"model {args.model}: bursts of {args.requests} chats x {args.tokens} tokens, "
              f"medians of {args.rounds} (a busy machine: noisy)")  # fmt: skip
        for name, runs in (
            ("alone", alone),
            (f"{num_pages} pages + {args.readers} readers", watched),
        ):
            print(f"  {name:24} {med(r[0] for r in runs):8.1f} tok/s   "
                  f"TTFT {1000 * med(r[1] for r in runs):8.1f} ms")  # fmt: skip
        if args.stall_s > 0:
            none = await stalled(url, engine, http, args, stall=False)
            one = await stalled(url, engine, http, args, stall=True)
            print(f"  {args.stall_s:.0f} s of bursts, no reader:          {json.dumps(none)}")
            print(f"  {args.stall_s:.0f} s of bursts, one stalled reader: {json.dumps(one)}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pages", type=int, default=4)
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--settle-s", type=float, default=3.0)
    p.add_argument("--stall-s", type=float, default=0.0)
    asyncio.run(main(p.parse_args()))
