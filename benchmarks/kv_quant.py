"""Quantized KV (`--kv-bits`): how many concurrent requests a fixed KV budget admits, and
decode speed, at 16/32-bit (unquantized), 8 and 4 bits.

    .venv/bin/python benchmarks/kv_quant.py [--model SmolLM2-135M-Instruct] [--kv-gb 1]
        [--prompt 2000] [--max-tokens 64] [--batch 4] [--context 1000] [--output 32]
        [--repeats 2] [--skip-speed]

Admission: for each dtype the KV can be held in (float32, the CPU's; bfloat16, a GPU's)
and each `--kv-bits`, the engine is opened with `--max-kv-gb` and measures its KV bytes a
token as it always does; the figure is how many requests of `--prompt` + `--max-tokens`
tokens the scheduler's own rule (`batch_geometry.batch_kv_tokens`: every row padded to the
longest, plus its fixed cost) lets run at once in that budget.

Decode speed: on the model's runner (the executor's MLX work, as the engine runs it),
`--batch` requests of `--context` prompt tokens prefilled, then `--output` decode-only
steps of all of them, timed each (the step and its look-ahead); decode tokens/s is
`--batch` over the median step, the settings alternating `--repeats` times. At 8 and 4 bits
twice: mlx-lm's quantized attention (`quantized_matmul` over the packed keys and values),
and the keys and values dequantized each step into the float attention
(`cpu_attention.DEQUANTIZE`, the CPU backend's path only).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import stepline.engine  # noqa: F401  (OpenBLAS before MLX)
from stepline.actors.scheduler.batch_geometry import batch_kv_tokens
from stepline.actors.scheduler.plan import ScheduledChunk, StepPlan
from stepline.actors.scheduler.work import Housekeeping, NewRequest, StepWork
from stepline.api import Engine
from stepline.engine import cpu_attention
from stepline.engine.kv_quant import kv_quant
from stepline.engine.models import load_model
from stepline.engine.runner import ModelRunner, mx_synchronize
from stepline.events.models import RequestParams

GREEDY = RequestParams(max_tokens=10**6, temperature=0, top_p=1, top_k=0, min_p=0, seed=None)


def admitted(config, prompt: int, max_tokens: int) -> int:
    """The most requests of `prompt` + `max_tokens` tokens that fit `config`'s budget."""
    n = 0
    while batch_kv_tokens([prompt + max_tokens] * (n + 1), config) <= config.max_kv_tokens:
        n += 1
    return n


async def admission(args) -> None:
    print(f"# admission: requests of {args.prompt} + {args.max_tokens} tokens in {args.kv_gb} GB")
    print("dtype     kv     bytes/token  admitted  x unquantized")
    for dtype in ("float32", "bfloat16"):
        base = None
        for bits in (None, 8, 4):
            async with Engine.open(
                args.model, dtype=dtype, kv_bits=bits, max_kv_gb=args.kv_gb, max_step_ms=0
            ) as engine:
                config = engine.step_loop.config
            n = admitted(config, args.prompt, args.max_tokens)
            base = base or n
            label = "16" if bits is None and dtype == "bfloat16" else "32" if bits is None else bits
            print(f"{dtype:9} {label!s:6} {config.kv_bytes_per_token:11}  {n:8}  {n / base:12.2f}")


def decode_steps(runner: ModelRunner, args, seed: int) -> list[float]:
    """`--batch` requests of `--context` tokens prefilled, then `--output` decode-only steps
    of all of them: each step's seconds (the step and its look-ahead, as the engine runs
    them)."""
    rng = random.Random(seed)
    news = tuple(
        NewRequest(f"r{i}", tuple(rng.randrange(3, 5000) for _ in range(args.context)), GREEDY)
        for i in range(args.batch)
    )
    ids = tuple(n.request_id for n in news)
    for i, new in enumerate(news):  # one prompt a step, the others' rows decoding
        chunk = (ScheduledChunk(new.request_id, 0, args.context, (), True),)
        decodes = ids[:i]
        num = {r: 1 for r in decodes} | {new.request_id: args.context}
        plan = StepPlan(step=i + 1, decodes=decodes, chunks=chunk, num_scheduled_tokens=num)
        runner.run(StepWork(plan=plan, admit=(new,)))
        runner.look_ahead()
    seconds = []
    for step in range(args.output):
        plan = StepPlan(step=100 + step, decodes=ids, num_scheduled_tokens=dict.fromkeys(ids, 1))
        t0 = time.perf_counter()
        runner.run(StepWork(plan=plan))
        runner.look_ahead()
        mx_synchronize()
        seconds.append(time.perf_counter() - t0)
    runner.housekeep(Housekeeping(free=ids))
    return seconds


def speed(args) -> None:
    loaded = load_model(args.model)
    settings = [("unquantized", None, False)]
    for bits in (8, 4):
        settings += [(f"{bits} bits, mlx-lm's quantized attention", bits, False)]
        settings += [(f"{bits} bits, dequantized each step", bits, True)]
    runners = {
        name: ModelRunner(loaded, kv=kv_quant(bits, args.group_size)) for name, bits, _ in settings
    }
    steps: dict[str, list[float]] = {name: [] for name, _, _ in settings}
    for repeat in range(args.repeats):  # the settings alternate: a busy machine hits each
        for name, _, dequantize in settings:
            cpu_attention.DEQUANTIZE = dequantize
            steps[name] += decode_steps(runners[name], args, seed=repeat)[1:]
    print(
        f"# decode: {args.batch} rows of {args.context}+ tokens, {args.output} decode-only "
        f"steps, {args.repeats} repeats; median step"
    )
    base = statistics.median(steps["unquantized"])
    for name, got in steps.items():
        step = statistics.median(got)
        print(
            f"{name:38} {args.batch / step:8.1f} tok/s  {1000 * step:7.1f} ms/step  "
            f"{base / step:5.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--kv-gb", type=float, default=1.0)
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    asyncio.run(admission(args))
    if not args.skip_speed:
        speed(args)


if __name__ == "__main__":
    main()
