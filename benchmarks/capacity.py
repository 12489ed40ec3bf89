"""Capacity under a latency SLO: the highest Poisson arrival rate at which a server still
serves 90% of its requests within their SLO (goodput, as Sarathi-Serve and DistServe
measure it), for stepline against mlx_lm.server and vllm-mlx in their best chunked
configurations.

    # each server spawned in turn on the same model directory, rates swept upwards:
    python -m benchmarks.capacity --spawn stepline,mlx_lm --model stepline-demo \\
        --rates 0.25,0.5,1,2,4 --duration 60
    # the real default model (every server reads the float32 weights stepline serves):
    python -m benchmarks.capacity --spawn stepline,mlx_lm --model SmolLM2-135M-Instruct

The workload, seeded so every server gets the same requests at the same times: Poisson
arrivals at the rate; prompt lengths heavy-tailed (70% 64-512 tokens, 25% 512-2,000, 5%
2,000-4,000, cut to the model's context); outputs of 32-160 tokens; greedy, streamed. A
request meets the SLO when its time to first token is at most `--ttft-base-s` +
`--ttft-per-token-ms` per prompt token (1 s + 2 ms by default) and the longest gap between
two of its streamed chunks is at most `--max-gap-s` (0.5 s); one that fails or times out
does not. Goodput at a rate is the share of its requests that met the SLO; a server's
capacity is the highest rate of the sweep at which goodput is at least `--goodput` (0.9).
A server's sweep stops after two rates below that (it is saturated).

Peers are spawned in their best chunked configuration unless told otherwise:
mlx_lm.server with `--prefill-step-size 512`, vllm-mlx (when `vllm-mlx` is on PATH) with
`--continuous-batching --chunked-prefill-tokens 512`; stepline with its defaults.
Bounded: a fixed number of requests per rate, a per-request timeout and `--time-limit`;
it only talks to servers it spawns on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.http_load import (
    Prompts,
    Result,
    Spawned,
    load_tokenizer,
    percentiles,
    stream_request,
)
from benchmarks.http_load import chat as chat_body

PEER_ARGS = {
    "mlx_lm": "--prefill-step-size 512",
    "vllm_mlx": "--continuous-batching --chunked-prefill-tokens 512",
    "stepline": "",
}


@dataclass(frozen=True)
class Slo:
    ttft_base_s: float = 1.0
    ttft_per_token_s: float = 0.002
    max_gap_s: float = 0.5

    def ttft_limit(self, prompt_tokens: int) -> float:
        return self.ttft_base_s + self.ttft_per_token_s * prompt_tokens

    def met(self, r: Result, prompt_tokens: int) -> bool:
        return (
            r.ok
            and r.ttft is not None
            and r.ttft <= self.ttft_limit(prompt_tokens)
            and worst_gap(r) <= self.max_gap_s
        )


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the first arrival
    prompt_tokens: int
    max_tokens: int


def worst_gap(r: Result) -> float:
    return max(r.itls, default=0.0)


def prompt_length(rng: random.Random, context: int | None) -> int:
    u = rng.random()
    if u < 0.70:
        n = rng.randint(64, 512)
    elif u < 0.95:
        n = rng.randint(512, 2000)
    else:
        n = rng.randint(2000, 4000)
    return n if context is None else min(n, context - 200)


def arrivals(rate: float, count: int, seed: int, context: int | None) -> list[Arrival]:
    """`count` requests of the heavy-tailed mix, arriving as a Poisson process at `rate`/s."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for _ in range(count):
        out.append(Arrival(at, prompt_length(rng, context), rng.randint(32, 160)))
        at += rng.expovariate(rate)
    return out


def text_seed(seed: int, rate: float) -> int:
    """Where a rate's prompt texts start: each rate's own (request i of every rate had the
    same text, so every rate after the first was served from the prefix cache of the one
    before it: a capacity that grew with the sweep), the same for every server."""
    return random.Random(f"{seed}:{rate}").randrange(2**31)


async def run_rate(
    server: Spawned,
    client: httpx.AsyncClient,
    prompts: Prompts,
    plan: list[Arrival],
    args,
    texts: int,
) -> tuple[list[Result], float]:
    t0 = time.perf_counter()

    async def one(i: int, a: Arrival) -> Result:
        await asyncio.sleep(max(0.0, t0 + a.at - time.perf_counter()))
        text = prompts.text(a.prompt_tokens, seed=texts + i)
        body = chat_body(server.model, text, a.max_tokens)
        return await stream_request(
            client, "/v1/chat/completions", body, limit_s=args.request_timeout
        )

    results = await asyncio.gather(*[one(i, a) for i, a in enumerate(plan)])
    return list(results), time.perf_counter() - t0


def rate_row(server: str, rate: float, plan, results: list[Result], slo: Slo, wall: float):
    met = [slo.met(r, a.prompt_tokens) for r, a in zip(results, plan, strict=True)]
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps = [worst_gap(r) for r in ok]
    return {
        "server": server,
        "rate": rate,
        "requests": len(results),
        "ok": len(ok),
        "goodput": sum(met) / len(met) if met else 0.0,
        "ttft_p50_ms": 1000 * percentiles(ttft, (50,))[0],
        "ttft_p90_ms": 1000 * percentiles(ttft, (90,))[0],
        "worst_gap_p50_ms": 1000 * percentiles(gaps, (50,))[0],
        "worst_gap_p90_ms": 1000 * percentiles(gaps, (90,))[0],
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall if wall else 0.0,
        "errors": sorted({r.error for r in results if r.error})[:2],
        # each request: its arrival (s after the first), prompt tokens, TTFT and worst gap
        # (s), and whether it met the SLO
        "each": [
            [a.at, a.prompt_tokens, r.ttft, worst_gap(r) if r.ok else None, m]
            for r, a, m in zip(results, plan, met, strict=True)
        ],
    }


def capacity(rows: list[dict[str, Any]], server: str, target: float) -> float:
    """The highest rate at which `server` met the goodput target (0 if none)."""
    return max(
        (r["rate"] for r in rows if r["server"] == server and r["goodput"] >= target), default=0.0
    )


def print_row(r: dict[str, Any]) -> None:
    print(
        f"{r['server']:<10} {r['rate']:>6.2f}/s {r['ok']:>3}/{r['requests']:<3} "
        f"goodput {r['goodput']:5.2f}  "
        f"TTFT p50/p90 {r['ttft_p50_ms']:7.0f}/{r['ttft_p90_ms']:<7.0f} "
        f"worst gap p50/p90 {r['worst_gap_p50_ms']:6.0f}/{r['worst_gap_p90_ms']:<6.0f} ms  "
        f"{r['output_tokens_per_s']:6.1f} tok/s"
        + (f"  errors: {r['errors']}" if r["errors"] else ""),
        flush=True,
    )


async def sweep(kind: str, args, slo: Slo, prompts: Prompts, log_dir: Path, deadline: float):
    peer_args = (args.peer_args.get(kind) or "").split()
    server = Spawned(kind, args.model, log_dir, args.stepline_args.split(), peer_args)
    rows: list[dict[str, Any]] = []
    try:
        await server.wait_ready()
        async with httpx.AsyncClient(base_url=server.base_url, timeout=None) as client:
            warm = chat_body(server.model, prompts.text(64, seed=12345), 8)
            await stream_request(client, "/v1/chat/completions", warm, limit_s=args.request_timeout)
            misses = 0
            for rate in args.rates:
                if time.monotonic() > deadline:
                    print(f"{kind}: --time-limit reached", flush=True)
                    break
                count = max(args.min_requests, round(rate * args.duration))
                plan = arrivals(rate, count, args.seed, server.context)
                texts = text_seed(args.seed, rate)
                results, wall = await run_rate(server, client, prompts, plan, args, texts)
                row = rate_row(kind, rate, plan, results, slo, wall)
                rows.append(row)
                print_row(row)
                misses = misses + 1 if row["goodput"] < args.goodput else 0
                if misses >= 2:
                    break
    finally:
        server.stop()
    return rows


async def main_async(args) -> list[dict[str, Any]]:
    slo = Slo(args.ttft_base_s, args.ttft_per_token_ms / 1000, args.max_gap_s)
    prompts = Prompts(load_tokenizer(args.model))
    deadline = time.monotonic() + args.time_limit
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="stepline-capacity-") as log_dir:
        for kind in args.spawn:
            rows += await sweep(kind, args, slo, prompts, Path(log_dir), deadline)
    print(
        f"\ncapacity (highest rate with goodput >= {args.goodput}; SLO: TTFT <= "
        f"{slo.ttft_base_s:g} s + {1000 * slo.ttft_per_token_s:g} ms/prompt token, "
        f"worst gap <= {slo.max_gap_s:g} s) on {args.model}:"
    )
    for kind in args.spawn:
        print(f"  {kind:<10} {capacity(rows, kind, args.goodput):.2f} req/s")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--spawn", default="stepline,mlx_lm", help="servers, in turn (comma-separated)")
    p.add_argument("--model", default="stepline-demo", help="what every server serves")
    p.add_argument("--rates", default="0.25,0.5,1,2,4", help="arrival rates, req/s, ascending")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--min-requests", type=int, default=12, help="fewest requests per rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-base-s", type=float, default=1.0)
    p.add_argument("--ttft-per-token-ms", type=float, default=2.0)
    p.add_argument("--max-gap-s", type=float, default=0.5)
    p.add_argument("--goodput", type=float, default=0.9, help="goodput a rate must reach")
    p.add_argument("--stepline-args", default="", help="extra `stepline serve` arguments")
    p.add_argument(
        "--peer-args",
        default=None,
        help="JSON {server: 'arguments'} replacing the peers' best configurations "
        f"(default {json.dumps(PEER_ARGS)})",
    )
    p.add_argument("--request-timeout", type=float, default=180.0)
    p.add_argument("--time-limit", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--json", default=None, help="also write every row to this file")
    args = p.parse_args(argv)
    args.spawn = [s for s in args.spawn.split(",") if s]
    args.rates = sorted(float(r) for r in args.rates.split(","))
    args.peer_args = {**PEER_ARGS, **(json.loads(args.peer_args) if args.peer_args else {})}
    rows = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
