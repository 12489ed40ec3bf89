"""The live view's cost to the engine (issue 57's targets), over HTTP, in one run.

    python -m benchmarks.live_view --model SmolLM2-135M-Instruct --rounds 3 --stall-s 60
    python -m benchmarks.live_view --pages 0 --light-pages 4 --readers 4 --rounds 5

A burst of `--requests` streamed chats of `--tokens` tokens, sent at once to a real server
(127.0.0.1), alternately alone and watched by `--pages` dashboard pages (headless Chromium,
where a `chromium` binary is installed) and `--readers` raw `/v1/events` readers; prints the
burst's throughput (output tokens a second) and median TTFT both ways, medians of `--rounds`,
and the CPU seconds a watched burst cost: the browsers' (every process of each Chromium), the
raw readers' (`curl` processes, as any client outside the server), and the server's event-loop
thread against an unwatched burst's (what serving the watchers cost it: SSE, /health, the
page's files), which are less noisy than the throughput on a shared machine.

`--light-pages N` also watches with N pages that do not draw (`light_page`, each a process of
its own): the HTTP requests a page makes — its files, /v1/events/about, /v1/events?after=view
held open and read, /health every 3 s — with nothing rendered, so that what a page costs the
server is measured apart from what drawing it costs a browser on the same cores (a page in a
browser on another machine costs the server this).
Then, with `--stall-s`, a reader that opens `/v1/events` and stops reading for that long while
bursts run, against none: the server's RSS and the steps' median and p99 time both ways.
Keep it short on a busy machine (the figures are noisy there: say so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, NamedTuple

import httpx

# (the server's modules are imported where they are used: a light page, a process of this
# module, `--as-page`, imports none of them)


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


class Burst(NamedTuple):
    tok_s: float  # output tokens a second
    ttft_s: float  # median
    loop_cpu_s: float  # the event loop's thread (this one): HTTP, step loop, event streams
    browsers_cpu_s: float = 0.0  # every process of every Chromium
    readers_cpu_s: float = 0.0  # the raw readers' processes
    light_cpu_s: float = 0.0  # the light pages' processes


async def burst(
    http: httpx.AsyncClient, args: argparse.Namespace, watching: Watchers | None = None
) -> Burst:
    """One burst, and the CPU its watchers (if any) and the event loop spent meanwhile."""
    before = watching.cpu_s() if watching else (0.0, 0.0, 0.0)
    loop, t0 = time.thread_time(), time.perf_counter()
    got = await asyncio.gather(*(one_chat(http, i, args.tokens) for i in range(args.requests)))
    wall, loop = time.perf_counter() - t0, time.thread_time() - loop
    after = watching.cpu_s() if watching else (0.0, 0.0, 0.0)
    return Burst(
        sum(n for _, n in got) / wall,
        statistics.median(t for t, _ in got),
        loop,
        *(a - b for a, b in zip(after, before, strict=True)),
    )


def cpu_s(pid: int) -> float:
    """The CPU seconds (user + system) process `pid` has used; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(roots: list[int]) -> float:
    """The CPU seconds of the processes `roots` and all their descendants now alive."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            except OSError:
                pass
    tree, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += [child for child, up in parent.items() if up == pid]
    return sum(cpu_s(pid) for pid in tree)


class Watchers(NamedTuple):
    browsers: list[asyncio.subprocess.Process]
    readers: list[asyncio.subprocess.Process]
    light: list[asyncio.subprocess.Process]

    def cpu_s(self) -> tuple[float, float, float]:
        """The CPU seconds the browsers, the raw readers and the light pages have used."""
        return (
            tree_cpu_s([p.pid for p in self.browsers]),
            tree_cpu_s([p.pid for p in self.readers]),
            tree_cpu_s([p.pid for p in self.light]),
        )


async def light_page(url: str) -> None:
    """What one dashboard page asks the server for, without drawing it (`--light-pages`):
    its files (and the icon a browser asks for), /v1/events/about, then /v1/events?after=view
    held open and read as it comes (not parsed: the page's parsing is the browser's cost),
    and /health every 3 s (dashboard.js's `pollHealth`), until it is stopped."""
    page = "/dashboard/"
    async with httpx.AsyncClient(base_url=url, timeout=None) as http:
        for path in (page, f"{page}dashboard.css", f"{page}dashboard.js", "/favicon.ico"):
            await http.get(path)
        await http.get("/v1/events/about")

        async def health() -> None:
            while True:
                await asyncio.sleep(3.0)
                await http.get("/health")

        poll = asyncio.create_task(health())
        headers = {"accept": "text/event-stream", "cache-control": "no-cache"}
        try:
            async with http.stream("GET", "/v1/events?after=view", headers=headers) as r:
                async for _ in r.aiter_raw():
                    pass
        finally:
            poll.cancel()


@asynccontextmanager
async def watchers(
    url: str, args: argparse.Namespace, page: str = "/dashboard/", *, light: bool = False
) -> AsyncIterator[Watchers]:
    """`--pages` headless Chromium pages on `page` (`light`: `--light-pages` light pages on
    /dashboard/ instead, `light_page`) and `--readers` raw readers (`curl` processes: a reader's own
    parsing is not the server's cost)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    async with AsyncExitStack() as stack:
        procs, readers, lights = [], [], []
        for _ in range(args.light_pages if light else 0):
            lights.append(
                await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "benchmarks.live_view", "--as-page", url,
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                )
            )  # fmt: skip
        if chromium is not None and not light:
            for _ in range(args.pages):
                profile = stack.enter_context(
                    tempfile.TemporaryDirectory(ignore_cleanup_errors=True)
                )
                procs.append(
                    await asyncio.create_subprocess_exec(
                        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        f"--user-data-dir={profile}", "--remote-debugging-port=0",
                        f"{url}{page}",
                        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                    )
                )  # fmt: skip
        for _ in range(args.readers):
            readers.append(
                await asyncio.create_subprocess_exec(
                    "curl", "-sN", "-o", "/dev/null", f"{url}/v1/events?after=now",
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                )
            )  # fmt: skip
        await settled(url, len(procs) + len(readers) + len(lights), args.settle_s)
        try:
            yield Watchers(procs, readers, lights)
        finally:
            for p in procs + readers + lights:
                p.terminate()
                await p.wait()


async def settled(url: str, num_readers: int, within_s: float) -> None:
    """Until `num_readers` follow the events, each caught up (a page has read what memory
    keeps), and a second more (the pages draw it), or `within_s` at most: a page still
    loading would be counted as the burst's watcher."""
    end = time.monotonic() + within_s
    async with httpx.AsyncClient(base_url=url) as http:
        while time.monotonic() < end:
            readers = (await http.get("/v1/events/about")).json()["readers"]
            if len(readers) >= num_readers and all(r["behind"] == 0 for r in readers):
                await asyncio.sleep(min(1.0, max(0.0, end - time.monotonic())))
                return
            await asyncio.sleep(0.2)


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


def watched_app(engine: Any, args: argparse.Namespace) -> Any:
    """The server's app; with `--compare-page DIR`, also DIR's page files at /compare-page/
    (another version of the page, say the one before a change, watched in the same run)."""
    from starlette.staticfiles import StaticFiles

    from stepline.api.http.app import create_app
    from stepline.api.pipeline.served import OneModel

    app = create_app(OneModel(engine))
    if args.compare_page is not None:
        app.mount("/compare-page", StaticFiles(directory=args.compare_page, html=True))
    return app


async def main(args: argparse.Namespace) -> None:
    from stepline.api import Engine
    from stepline.api.http.serve import serve_in_process

    if shutil.which("chromium") is None and shutil.which("chromium-browser") is None:
        args.pages = 0
    async with (
        Engine.open(args.model, max_num_seqs=args.max_num_seqs) as engine,
        serve_in_process(watched_app(engine, args)) as url,
        # idle connections dropped before the server's 5 s keep-alive timeout drops them: a
        # burst sent on one the server is closing fails (httpx.ReadError)
        httpx.AsyncClient(
            base_url=url, timeout=600, limits=httpx.Limits(keepalive_expiry=2.0)
        ) as http,
    ):
        await burst(http, args)  # warm
        # name -> (the page's path, light pages instead of browsers), each watched in turn
        ways: dict[str, tuple[str, bool]] = {}
        readers = f"+ {args.readers} readers"
        if args.pages or not args.light_pages:
            ways[f"{args.pages} pages {readers}"] = ("/dashboard/", False)
        if args.light_pages:
            ways[f"{args.light_pages} light pages {readers}"] = ("/dashboard/", True)
        if args.compare_page is not None:
            ways[f"{args.pages} --compare-page {readers}"] = ("/compare-page/", False)
        runs: dict[str, list[Burst]] = {"alone": []} | {name: [] for name in ways}
        for _ in range(args.rounds):
            runs["alone"].append(await burst(http, args))
            for name, (page, light) in ways.items():
                async with watchers(url, args, page, light=light) as watching:
                    runs[name].append(await burst(http, args, watching))
        med = statistics.median
        print(f"model {args.model}: bursts of {args.requests} chats x {args.tokens} tokens, "
              f"medians of {args.rounds} (a busy machine: noisy)")  # fmt: skip
        for name, got in runs.items():
            print(f"  {name:34} {med(r.tok_s for r in got):6.1f} tok/s   "
                  f"TTFT {1000 * med(r.ttft_s for r in got):6.1f} ms   "
                  f"CPU s: event loop {med(r.loop_cpu_s for r in got):.2f}, "
                  f"browsers {med(r.browsers_cpu_s for r in got):.2f}, "
                  f"readers {med(r.readers_cpu_s for r in got):.2f}, "
                  f"light pages {med(r.light_cpu_s for r in got):.2f}")  # fmt: skip
            if args.show_rounds:
                for r in got:
                    print(f"      {r.tok_s:6.1f} tok/s   TTFT {1000 * r.ttft_s:6.1f} ms   "
                          f"event loop {r.loop_cpu_s:.2f} s")  # fmt: skip
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
    p.add_argument(
        "--light-pages",
        type=int,
        default=0,
        help="also watch with this many pages that make a page's requests and draw nothing",
    )
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--show-rounds", action="store_true", help="print every round's figures")
    p.add_argument("--as-page", metavar="URL", help=argparse.SUPPRESS)  # one light page
    p.add_argument(
        "--compare-page",
        metavar="DIR",
        help="also watch with the page files in DIR (another version of api/http/dashboard/, "
        "e.g. `git archive REV api/http/dashboard | tar -x -C DIR`), alternating in the run",
    )
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--settle-s", type=float, default=30.0, help="at most, for the watchers")
    p.add_argument("--stall-s", type=float, default=0.0)
    parsed = p.parse_args()
    if parsed.as_page is not None:
        asyncio.run(light_page(parsed.as_page))
    else:
        asyncio.run(main(parsed))
