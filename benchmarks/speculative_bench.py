"""Speculative decoding (`--speculative-config`, ngram) against none, on the same engine model.

Two workloads, each run with and without drafts in alternating order (`--repeats`), in one
process, through the Python API:
- agent edit: the prompt holds a source file of ~`--file-tokens` tokens and asks for it back
  with one function renamed (what an agent's edit looks like); greedy;
- chat: questions with nothing in the prompt to copy; greedy;
- loops: for a demo with random weights, which copies nothing it is shown (the continuation
  of a prompt P + S + P is not S, whatever S): token prompts on the demo built with weights
  of std `--init-std`, small enough that its greedy output falls into loops and out again,
  so prompt lookup drafts its own earlier output, kept while it loops and rejected where
  it leaves one, as an agent's copy is kept and rejected where the copy is edited.
At batch 1 and batch `--batch` (that many requests sent together, different files or
questions). Prints, per workload and batch, decode tokens/s (output tokens after the first
over the time from each request's first token to its last, summed over the batch's wall
time) with and without drafts, their ratio (median of the repeats), whether the outputs
were the same token for token, and the drafts kept.

    .venv/bin/python benchmarks/speculative_bench.py [--model M] [--repeats 3] [--batches 1,8]
    .venv/bin/python benchmarks/speculative_bench.py --model stepline-demo-hybrid-mid \
        --workloads loops --init-std 0.006 --batches 1 --max-tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

from stepline.api import Engine, SamplingParams
from stepline.engine.cache_dirs import cache_root
from stepline.engine.models import DEMO_MODELS, demo_model_path
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


def token_prompt(seed: int, tokens: int = 48) -> list[int]:
    """A loops workload's prompt: ids of ordinary vocabulary, different for each `seed`."""
    return [100 + (seed * 37 + i * 11) % 800 for i in range(tokens)]


def looping_demo(name: str, init_std: float) -> str:
    """Demo `name` built with weights of std `init_std` (where a random model's greedy output
    falls into loops, see `DemoSpec.init_std`), in a cache folder of this benchmark's."""
    spec = dataclasses.replace(DEMO_MODELS[name], init_std=init_std)
    DEMO_MODELS[f"{name}-loops"] = spec
    try:
        return str(demo_model_path(f"{name}-loops", cache_dir=cache_root() / "bench-loops"))
    finally:
        del DEMO_MODELS[f"{name}-loops"]


async def run_batch(
    engine: Engine,
    batch: list[list[dict]] | list[list[int]],
    max_tokens: int,
):
    """Outputs and decode tokens/s of one batch sent together (each a chat's messages, or a
    prompt's token ids), the outputs sorted."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    firsts: list[float] = []
    lasts: list[float] = []
    outs: list[list[int]] = [[] for _ in batch]

    async def one(i: int, item: list) -> None:
        tokens = outs[i]
        first = last = None
        ask = {"messages": item} if item and isinstance(item[0], dict) else {"prompt": item}
        async for o in engine.generate(**ask, params=params):
            now = time.perf_counter()
            if o.token_ids:
                first = first or now
                last = now
                tokens.extend(o.token_ids)
        if first is not None and last is not None:
            firsts.append(first)
            lasts.append(last)

    await asyncio.gather(*(one(i, m) for i, m in enumerate(batch)))
    decoded = sum(max(0, len(t) - 1) for t in outs)
    seconds = max(lasts) - min(firsts)
    rate = decoded / seconds if seconds > 0 else float("nan")
    return sorted(outs), rate


async def measure(model: str | None, spec: str | None, batch: list, max_tokens: int, options: dict):
    log = Path(tempfile.mkdtemp()) / "run.jsonl"
    options = {**options, "event_log": str(log)}
    if spec:
        options["speculative_config"] = spec
    async with Engine.open(model, **options) as engine:
        await run_batch(engine, batch[:1], 8)  # warm
        outs, rate = await run_batch(engine, batch, max_tokens)
    drafts = summarize(log).drafts
    kept = f"{drafts.num_accepted}/{drafts.num_proposed}" if drafts else "-"
    return outs, rate, kept


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2 (stepline's default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--file-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--workloads", default="edit,chat", help="of edit, chat, loops")
    ap.add_argument("--init-std", type=float, default=0.006, help="loops: the demo's weights")
    ap.add_argument(
        "--max-step-ms",
        default=None,
        help="the step-time target (none: untimed); default: the engine's",
    )
    args = ap.parse_args()
    options: dict = {}
    if args.max_step_ms is not None:
        options["max_step_ms"] = None if args.max_step_ms == "none" else float(args.max_step_ms)
    for workload in args.workloads.split(","):
        model = args.model
        if workload == "loops":
            model = looping_demo(args.model or "stepline-demo-hybrid-mid", args.init_std)
        for n in (int(b) for b in args.batches.split(",")):
            batch: list
            if workload == "edit":
                batch = [edit_messages(i, args.file_tokens) for i in range(n)]
            elif workload == "loops":
                batch = [token_prompt(i) for i in range(n)]
            else:
                batch = [chat_messages(i) for i in range(n)]
            ratios, same = [], True
            rows = []
            for r in range(args.repeats):
                order = [None, NGRAM] if r % 2 == 0 else [NGRAM, None]
                got = {}
                for spec in order:
                    got[spec] = await measure(model, spec, batch, args.max_tokens, options)
                (base, base_rate, _), (drafted, rate, kept) = got[None], got[NGRAM]
                same &= base == drafted
                ratios.append(rate / base_rate)
                rows.append(f"{base_rate:.1f} -> {rate:.1f} tok/s (kept {kept})")
            print(
                f"{workload} batch {n} (max_step_ms {args.max_step_ms or 'default'}): "
                "ngram/none decode tokens/s "
                f"{statistics.median(ratios):.2f}x (median of {args.repeats}: "
                f"{', '.join(f'{x:.2f}' for x in ratios)}); same output: {same}; "
                + "; ".join(rows),
                flush=True,
            )


if __name__ == "__main__":
    asyncio.run(main())
