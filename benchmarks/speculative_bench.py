"""Speculative decoding (`--speculative-config`, ngram) against none, on the same engine model.

Two workloads, each run with and without drafts in alternating order (`--repeats`), in one
process, through the Python API:
- agent edit: the prompt holds a source file of ~`--file-tokens` tokens and asks for it back
  with one function renamed (what an agent's edit looks like); greedy;
- chat: questions with nothing in the prompt to copy; greedy.
At batch 1 and batch `--batch` (that many requests sent together, different files or
questions). Prints, per workload and batch, decode tokens/s (output tokens after the first
over the time from each request's first token to its last, summed over the batch's wall
time) with and without drafts, their ratio (median of the repeats), whether the outputs
were the same token for token, and the drafts kept.

    .venv/bin/python benchmarks/speculative_bench.py [--model M] [--repeats 3] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from stepline.api import Engine, SamplingParams
from stepline.events.replay.summary import summarize

NGRAM = '{"method": "ngram", "num_speculative_tokens": 6}'

QUESTIONS = [
    "Why is the sky blue?",
    "Give three tips for sleeping better.",
    "What is a prime number?",
    "Describe a cat to someone who has never seen one.",
    "How do airplanes stay in the air?",
    "What makes a good friend?",
    "Why do leaves change colour in autumn?",
    "How does a bicycle work?",
]


def source_file(seed: int, tokens: int) -> str:
    """A plausible Python module of about `tokens` tokens (~9 tokens a line)."""
    lines = [f'"""Helpers for inventory batch {seed}."""', "", "import math", ""]
    i = 0
    while len(lines) * 9 < tokens:
        lines += [
            f"def item_{seed}_{i}(count, price):",
            f'    """The value of stock {i}, with {seed + i}% tax."""',
            f"    total = count * price * {1 + (seed + i) / 100:.2f}",
            "    return math.floor(total * 100) / 100",
            "",
        ]
        i += 1
    return "\n".join(lines)


def edit_messages(seed: int, tokens: int) -> list[dict]:
    code = source_file(seed, tokens)
    return [
        {
            "role": "user",
            "content": f"Here is a file:\n\n```python\n{code}\n```\n\nRewrite the whole file "
            f"with the function item_{seed}_0 renamed to first_item. Reply with the file only.",
        }
    ]


def chat_messages(i: int) -> list[dict]:
    return [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


async def run_batch(engine: Engine, batch: list[list[dict]], max_tokens: int):
    """Outputs and decode tokens/s of one batch sent together."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    firsts: list[float] = []
    lasts: list[float] = []
    outs: list[list[int]] = []

    async def one(messages: list[dict]) -> None:
        tokens: list[int] = []
        first = last = None
        async for o in engine.generate(messages=messages, params=params):
            now = time.perf_counter()
            if o.token_ids:
                first = first or now
                last = now
                tokens.extend(o.token_ids)
        outs.append(tokens)
        if first is not None and last is not None:
            firsts.append(first)
            lasts.append(last)

    await asyncio.gather(*(one(m) for m in batch))
    decoded = sum(max(0, len(t) - 1) for t in outs)
    seconds = max(lasts) - min(firsts)
    return outs, decoded / seconds if seconds > 0 else float("nan")


async def measure(model: str | None, spec: str | None, batch: list[list[dict]], max_tokens: int):
    log = Path(tempfile.mkdtemp()) / "run.jsonl"
    options: dict = {"event_log": str(log)}
    if spec:
        options["speculative_config"] = spec
    async with Engine.open(model, **options) as engine:
        await run_batch(engine, batch[:1], 8)  # warm
        outs, rate = await run_batch(engine, batch, max_tokens)
    drafts = summarize(log).drafts
    kept = f"{drafts.num_accepted}/{drafts.num_proposed}" if drafts else "-"
    return sorted(outs), rate, kept


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2 (stepline's default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--file-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--workloads", default="edit,chat")
    args = ap.parse_args()
    for workload in args.workloads.split(","):
        for n in (int(b) for b in args.batches.split(",")):
            if workload == "edit":
                batch = [edit_messages(i, args.file_tokens) for i in range(n)]
            else:
                batch = [chat_messages(i) for i in range(n)]
            ratios, same = [], True
            rows = []
            for r in range(args.repeats):
                order = [None, NGRAM] if r % 2 == 0 else [NGRAM, None]
                got = {}
                for spec in order:
                    got[spec] = await measure(args.model, spec, batch, args.max_tokens)
                (base, base_rate, _), (drafted, rate, kept) = got[None], got[NGRAM]
                same &= base == drafted
                ratios.append(rate / base_rate)
                rows.append(f"{base_rate:.1f} -> {rate:.1f} tok/s (kept {kept})")
            print(
                f"{workload} batch {n}: ngram/none decode tokens/s "
                f"{statistics.median(ratios):.2f}x (median of {args.repeats}: "
                f"{', '.join(f'{x:.2f}' for x in ratios)}); same output: {same}; "
                + "; ".join(rows),
                flush=True,
            )


if __name__ == "__main__":
    asyncio.run(main())
