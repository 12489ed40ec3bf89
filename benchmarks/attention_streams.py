"""A long prompt's prefill with its attention's blocks on one CPU stream or on several
(`engine/cpu_attention.py` `STREAMS`), in one process, on each model given.

    .venv/bin/python benchmarks/attention_streams.py [--models SmolLM2-135M-Instruct
        stepline-demo-hybrid-mid] [--prompt 3500] [--repeats 5] [--streams 1 2]

Each repeat sends a new random prompt of `--prompt` tokens (so the prefix cache serves
nothing) for one token, once for each stream count, the order alternating between repeats;
it prints each count's TTFT median and its ratio to the first count's. MLX's CPU backend
runs a stream's elementwise work (the softmax's `exp`) on one thread: at long context that
is most of a chunk's attention. A measurement, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stepline.engine  # noqa: E402,F401  (OpenBLAS before MLX)
from stepline.api import Engine, SamplingParams  # noqa: E402
from stepline.engine import cpu_attention  # noqa: E402


async def one_model(name: str, args: argparse.Namespace) -> None:
    rng = random.Random(0)
    ttfts: dict[int, list[float]] = {n: [] for n in args.streams}
    async with Engine.open(name) as engine:
        loop = engine.step_loop
        await loop.wait_until(lambda: not loop.warming_up)  # a first start's warm-up
        top = min(len(engine.tokenizer.vocab), 20_000)
        for r in range(args.repeats):
            order = args.streams if r % 2 == 0 else list(reversed(args.streams))
            for n in order:
                cpu_attention.STREAMS = n
                prompt = [rng.randrange(100, top) for _ in range(args.prompt)]
                t0 = time.perf_counter()
                stream = await engine.submit(prompt, params=SamplingParams(max_tokens=1))
                async for out in stream:
                    if out.token_ids:
                        ttfts[n].append(time.perf_counter() - t0)
                        break
                async for _ in stream:
                    pass
    base = statistics.median(ttfts[args.streams[0]])
    for n, xs in ttfts.items():
        med = statistics.median(xs)
        print(
            f"{name}: {args.prompt}-token prompt, {n} stream(s): TTFT median {med:.2f} s "
            f"({med / base:.2f}x), runs {', '.join(f'{x:.2f}' for x in xs)}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["SmolLM2-135M-Instruct"])
    p.add_argument("--prompt", type=int, default=3500)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    for name in args.models:
        asyncio.run(one_model(name, args))


if __name__ == "__main__":
    main()
