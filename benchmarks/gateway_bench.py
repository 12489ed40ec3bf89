"""Several engines behind SGLang's model gateway: `cache_aware` against `round_robin`, and one
engine alone, on a multi-tenant workload, measured from the engines' own event logs.

The workload: `--prefixes` system prompts of ~`--prefix-tokens` tokens each (tenants), and
`--requests` chats over them (users of each tenant, each with a question of its own), all
sent together, streamed, `--max-tokens` each, greedy. Three setups, one after another on
127.0.0.1:
- one engine alone (`stepline serve`);
- `stepline gateway --engines 2 --policy cache_aware`;
- `stepline gateway --engines 2 --policy round_robin`.
Each engine writes its own event log; the figures come from them (`stepline replay`'s
summary): prompt tokens computed (not served from the prefix cache), in all and as a ratio
to one engine alone, the prefix-cache hit rate, and how the requests split between the
engines; with TTFT at p50/p95 as the clients saw it, and whether every request succeeded.

On a 2-core machine two engines share the cores: measure hit rate and correctness here, not
throughput.

    .venv/bin/python benchmarks/gateway_bench.py [--model M] [--prefixes 8] [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stepline.api.cli.gateway import free_port  # noqa: E402
from stepline.engine.default_model import DEFAULT_MODEL  # noqa: E402
from stepline.events.replay.summary import summarize  # noqa: E402

WORDS = (
    "ledger invoice harbour glacier violin orchard satellite lantern copper meadow falcon "
    "quartz canyon biscuit tractor marble compass velvet thunder saddle pepper ribbon"
).split()


def system_prompt(tenant: int, tokens: int) -> str:
    """A tenant's policy text: ~`tokens` tokens (~1.3 tokens a word), its own words."""
    rng = random.Random(tenant)
    rules = [f"You are the assistant of tenant {tenant}. Follow these rules."]
    while len(" ".join(rules).split()) * 1.3 < tokens:
        rules.append(f"Rule {len(rules)}: " + " ".join(rng.choice(WORDS) for _ in range(12)) + ".")
    return "\n".join(rules)


def workload(prefixes: int, requests: int, tokens: int) -> list[list[dict]]:
    systems = [system_prompt(t, tokens) for t in range(prefixes)]
    return [
        [
            {"role": "system", "content": systems[i % prefixes]},
            {"role": "user", "content": f"User {i}: which rule mentions a {WORDS[i % 22]}?"},
        ]
        for i in range(requests)
    ]


def start(command: list[str], ready: str, timeout_s: float = 900) -> subprocess.Popen:
    """Start `command`; return once a line of its output contains `ready`."""
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    for line in proc.stdout:
        if ready in line:
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"{command[:6]} did not start")


async def wait_serving(url: str, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                r = await client.get(f"{url}/v1/models", timeout=5)
                if r.status_code == 200 and r.json().get("data"):
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} never served")


async def send_all(url: str, batch: list[list[dict]], max_tokens: int) -> tuple[list, int]:
    """Every chat at once, streamed: (each one's TTFT in seconds, failures)."""
    ttfts: list[float] = []
    failures = 0

    async def one(client: httpx.AsyncClient, messages: list[dict]) -> None:
        nonlocal failures
        body = {
            "model": "default",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        t0 = time.perf_counter()
        first = None
        try:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    failures += 1
                    return
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            first = time.perf_counter() - t0
        except httpx.HTTPError:
            failures += 1
            return
        if first is not None:
            ttfts.append(first)

    async with httpx.AsyncClient(timeout=1800) as client:
        await asyncio.gather(*(one(client, m) for m in batch))
    return ttfts, failures


def summaries_of(logs: Path) -> list:
    """Each engine's log's replay summary, in engine order."""
    return [summarize(log) for log in sorted(logs.glob("engine-*.jsonl"))]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def measure(setup: str, args: argparse.Namespace, batch: list[list[dict]]) -> dict:
    logs = Path(tempfile.mkdtemp(prefix=f"gw-{setup}-"))
    port = free_port()
    engine_args = ["--model", args.model, "--served-model-name", "default"]
    if setup == "one engine":
        command = [sys.executable, "-m", "stepline.api.cli", "serve", *engine_args]
        command += ["--port", str(port), "--event-log", str(logs / "engine-0.jsonl")]
        proc = start(command, "serving")
    else:
        policy = setup.split()[-1]
        command = [sys.executable, "-m", "stepline.api.cli", "gateway", "--engines", "2"]
        command += ["--port", str(port), "--policy", policy, "--event-log-dir", str(logs)]
        proc = start([*command, "--", *engine_args], f"({policy})")
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_serving(url)
        t0 = time.perf_counter()
        ttfts, failures = await send_all(url, batch, args.max_tokens)
        wall = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    summaries = summaries_of(logs)
    computed = sum(s.num_prompt_tokens - s.num_cached_tokens for s in summaries)
    prompt = sum(s.num_prompt_tokens for s in summaries)
    return {
        "setup": setup,
        "computed": computed,
        "prompt": prompt,
        "split": [s.num_requests for s in summaries],
        "ttft_p50": pct(ttfts, 0.5),
        "ttft_p95": pct(ttfts, 0.95),
        "failures": failures,
        "wall": wall,
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    batch = workload(args.prefixes, args.requests, args.prefix_tokens)
    rows: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for setup in ("one engine", "gateway cache_aware", "gateway round_robin"):
            rows.setdefault(setup, []).append(await measure(setup, args, batch))
    alone = statistics.median(r["computed"] for r in rows["one engine"])
    print(
        f"{args.requests} chats over {args.prefixes} system prompts of ~{args.prefix_tokens} "
        f"tokens, sent together; medians of {args.repeats}"
    )
    for setup, runs in rows.items():
        computed = statistics.median(r["computed"] for r in runs)
        prompt = statistics.median(r["prompt"] for r in runs)
        last = runs[-1]
        print(
            f"{setup:22s} prompt tokens computed {computed:>7.0f} ({computed / alone:.2f}x one "
            f"engine; prefix-cache hits {1 - computed / prompt:.0%}); requests per engine "
            f"{last['split']}; TTFT p50 {statistics.median(r['ttft_p50'] for r in runs):.2f} s "
            f"p95 {statistics.median(r['ttft_p95'] for r in runs):.2f} s; failed "
            f"{sum(r['failures'] for r in runs)}; "
            f"wall {statistics.median(r['wall'] for r in runs):.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    asyncio.run(main())
