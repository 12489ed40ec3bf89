"""Where a server's memory grows: RSS and Python's allocations across a long run.

    .venv/bin/python benchmarks/memory_growth.py [--model stepline-demo-hybrid]
        [--warmup 300] [--requests 600] [--concurrency 16] [--top 15] [--no-trace]
        [--no-heap-trim]

Serves the model in this process (Engine.open + create_app on 127.0.0.1, prefix cache 0.1 GB,
MLX buffer cache 0.1 GB), sends --warmup requests, then --requests more, a seeded mix of chats
(streamed and not, prompts of a few to ~600 tokens, half under one of four shared system
prompts, a few cancelled mid-stream) and completions. It prints RSS after the warm-up and at
the end (each once the engine went idle, when it gives the C heap's free memory back), RSS
after one more malloc_trim (what the heap still kept), MLX's active and cache memory, and the
Python allocation sites that grew most between the two (tracemalloc, started after the
warm-up, 25 frames). RSS growth beyond those is native (MLX, tokenizers, the allocator).
A measurement, not a test; no network beyond 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import random
import sys
import time
import tracemalloc
from pathlib import Path

import anyio
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1].parent))

import stepline.engine  # noqa: E402,F401  (OpenBLAS before MLX)
from stepline.api import Engine  # noqa: E402
from stepline.api.http.app import create_app  # noqa: E402
from stepline.api.http.serve import serve_in_process  # noqa: E402
from stepline.api.pipeline.served import OneModel  # noqa: E402
from stepline.engine import heap  # noqa: E402

WORDS = "bread flour water salt yeast oven crust crumb rye spelt dough knead proof bake".split()
SYSTEMS = [f"You are baker number {i}. " + " ".join(WORDS * (i + 2)) for i in range(4)]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _malloc_trim() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim), where there
    is such a heap."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def body(rng: random.Random, i: int) -> tuple[str, dict]:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 600)))
    if rng.random() < 0.2:
        return "/v1/completions", {"prompt": text, "max_tokens": rng.randint(4, 32)}
    messages = [{"role": "user", "content": text}]
    if rng.random() < 0.5:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
    return "/v1/chat/completions", {
        "messages": messages,
        "max_tokens": rng.randint(4, 48),
        "stream": rng.random() < 0.5,
        "seed": i,
    }


async def one(http: httpx.AsyncClient, rng: random.Random, i: int) -> None:
    path, payload = body(rng, i)
    payload["model"] = "m"
    if payload.get("stream"):
        cut = rng.random() < 0.1  # a client that hangs up mid-stream
        async with http.stream("POST", path, json=payload) as r:
            async for n, _ in aenumerate(r.aiter_lines()):
                if cut and n > 3:
                    break
    else:
        r = await http.post(path, json=payload)
        r.raise_for_status()


async def aenumerate(it):
    n = 0
    async for x in it:
        yield n, x
        n += 1


async def run(http: httpx.AsyncClient, n: int, concurrency: int, seed: int) -> None:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)

    async def guarded(i: int) -> None:
        async with limit:
            await one(http, rng, i)

    await asyncio.gather(*(guarded(i) for i in range(n)))


async def main(args: argparse.Namespace) -> None:
    if not args.heap_trim:
        heap.trim = lambda: False  # the step loop calls it by the module's name
    async with Engine.open(
        args.model, prefix_cache_gb=0.1, mlx_cache_gb=0.1, max_num_seqs=32
    ) as engine:
        app = create_app(OneModel(engine), served_model_name=["m"])
        async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as h:
            start = rss_mb()
            t0 = time.monotonic()
            await run(h, args.warmup, args.concurrency, seed=1)
            await anyio.sleep(1)  # the step loop goes idle: it gives the heap's free memory back
            gc.collect()
            warm = rss_mb()
            warm_mlx = getattr(engine.metrics, "_memory", None)
            if args.trace:
                tracemalloc.start(25)
                before = tracemalloc.take_snapshot()
            await run(h, args.requests, args.concurrency, seed=2)
            await anyio.sleep(1)
            gc.collect()
            end = rss_mb()
            _malloc_trim()
            trimmed = rss_mb()
            if args.trace:
                after = tracemalloc.take_snapshot()
                traced, _ = tracemalloc.get_traced_memory()
                overhead = tracemalloc.get_tracemalloc_memory()
                tracemalloc.stop()
            mem = getattr(engine.metrics, "_memory", None)  # the executor's last report
    print(f"model {args.model}: {time.monotonic() - t0:.0f} s")
    print(
        f"RSS: start {start:.0f} MB, after {args.warmup} requests {warm:.0f} MB, after "
        f"{args.requests} more {end:.0f} MB: +{end - warm:.1f} MB; after malloc_trim "
        f"{trimmed:.0f} MB (the C heap's free memory it had kept: {end - trimmed:.0f} MB)"
    )
    for when, m in (("after the warm-up", warm_mlx), ("at the end", mem)):
        if m is not None:
            print(
                f"MLX {when}: active {m.active / 2**20:.0f} MB, cache {m.cache / 2**20:.0f} MB, "
                f"peak {m.peak / 2**20:.0f} MB"
            )
    if not args.trace:
        return
    print(
        f"Python allocations traced (live) at the end: {traced / 2**20:.1f} MB; tracemalloc's "
        f"own memory (inside the RSS above): {overhead / 2**20:.1f} MB"
    )
    stats = after.compare_to(before, "traceback")
    grown = sum(s.size_diff for s in stats) / 2**20
    print(f"Python allocation growth over the {args.requests}: {grown:+.1f} MB; largest sites:")
    for s in stats[: args.top]:
        frames = [
            f for f in s.traceback if "asyncio" not in f.filename and "anyio" not in f.filename
        ]
        where = " <- ".join(
            f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno}"
            for f in frames[-5:][::-1]
        )
        print(f"  {s.size_diff / 1024:+9.1f} KB {s.count_diff:+7d} blocks  {where}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="stepline-demo-hybrid")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--top", type=int, default=15)
    p.add_argument(
        "--no-trace",
        dest="trace",
        action="store_false",
        help="skip tracemalloc (its own records are counted in RSS)",
    )
    p.add_argument(
        "--no-heap-trim",
        dest="heap_trim",
        action="store_false",
        help="the engine does not trim the C heap when it goes idle (engine/heap.py)",
    )
    asyncio.run(main(p.parse_args()))
