"""Drafted decoding over HTTP: `stepline serve --speculative-config` (ngram) against
`mlx_lm.server` with and without `--draft-model`, on an agent's edit.

The workload is `speculative_bench.py`'s agent edit (a ~`--file-tokens`-token file asked
back with one rename), greedy, `--max-tokens` each, at each of `--batches` (that many
requests sent together, different files), streamed with usage. The servers run one at a time
on 127.0.0.1, each over `--repeats` rounds in alternating order:
- stepline, `--speculative-config '{"method": "ngram", "num_speculative_tokens": 6}'`;
- stepline without drafts;
- mlx_lm.server without a draft model (its default: batched);
- mlx_lm.server `--draft-model` (the same model as its own draft where no smaller one with the
  same tokenizer is at hand: SmolLM2-135M is the smallest of its family; mlx_lm turns
  batching off with a draft model) `--num-draft-tokens 3`.
Prints each server's decode tokens/s (completion tokens after the first, over the time from
each stream's first token to its last, summed over the batch's wall time), medians of the
repeats, and stepline's ratio to the best mlx_lm configuration.

    .venv/bin/python benchmarks/speculative_http.py [--model M] [--repeats 3] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.http_load import Spawned  # noqa: E402
from benchmarks.served_model import served_dir  # noqa: E402
from benchmarks.speculative_bench import NGRAM, edit_messages  # noqa: E402
from stepline.engine.default_model import DEFAULT_MODEL  # noqa: E402


async def one(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int):
    """(first token time, last token time, completion tokens, text) of one stream."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = last = None
    tokens = 0
    text = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(piece)
    return first, last, tokens, "".join(text)


async def batch_rate(base_url: str, model: str, batch: list[list[dict]], max_tokens: int):
    async with httpx.AsyncClient(base_url=base_url, timeout=1800) as client:
        # Warm with another file: mlx_lm.server 0.32 with --draft-model answers a prompt it
        # has cached with one token and no text.
        await one(client, model, edit_messages(len(batch) + 99, 200), 4)
        got = await asyncio.gather(*(one(client, model, m, max_tokens) for m in batch))
    firsts = [g[0] for g in got if g[0] is not None]
    lasts = [g[1] for g in got if g[1] is not None]
    decoded = sum(max(0, g[2] - 1) for g in got)
    if not firsts or max(lasts) <= min(firsts):  # no text streamed: say so, go on
        return float("nan"), [g[3] for g in got]
    return decoded / (max(lasts) - min(firsts)), [g[3] for g in got]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--file-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--draft-model", default=None, help="mlx_lm's draft (default: the model)")
    args = ap.parse_args()
    draft = args.draft_model or str(served_dir(args.model))
    servers = {
        "stepline ngram": ("stepline", ["--speculative-config", NGRAM]),
        "stepline": ("stepline", []),
        "mlx_lm": ("mlx_lm", []),
        "mlx_lm --draft-model": ("mlx_lm", ["--draft-model", draft, "--num-draft-tokens", "3"]),
    }
    logs = Path(tempfile.mkdtemp())
    for n in (int(b) for b in args.batches.split(",")):
        batch = [edit_messages(i, args.file_tokens) for i in range(n)]
        rates: dict[str, list[float]] = {name: [] for name in servers}
        texts: dict[str, list[str]] = {}
        for r in range(args.repeats):
            names = list(servers) if r % 2 == 0 else list(reversed(servers))
            for name in names:
                kind, extra = servers[name]
                stepline_args = extra if kind == "stepline" else []
                peer_args = extra if kind != "stepline" else []
                server = Spawned(kind, args.model, logs, stepline_args, peer_args)
                try:
                    await server.wait_ready()
                    rate, out = await batch_rate(
                        server.base_url, server.model, batch, args.max_tokens
                    )
                finally:
                    server.stop()
                rates[name].append(rate)
                texts[name] = out
        medians = {name: statistics.median(v) for name, v in rates.items()}
        peer = max(medians["mlx_lm"], medians["mlx_lm --draft-model"])
        same = texts["stepline ngram"] == texts["stepline"]
        print(
            f"batch {n}: "
            + "; ".join(f"{name} {m:.1f} tok/s" for name, m in medians.items())
            + f" | stepline ngram / best mlx_lm {medians['stepline ngram'] / peer:.2f}x"
            + f" | stepline ngram / stepline {medians['stepline ngram'] / medians['stepline']:.2f}x"
            + f" | stepline's text the same with and without drafts: {same}",
            flush=True,
        )


if __name__ == "__main__":
    asyncio.run(main())
