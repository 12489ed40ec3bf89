"""A mixed step (decode rows beside a prompt chunk) as one fused forward against separate
forwards: the same plan on two runners of the same model, interleaved, median of several.

    .venv/bin/python benchmarks/fused_step.py [--model SmolLM2-135M-Instruct] [--rows 4]
        [--chunk 256] [--offset 256] [--context 200] [--repeats 7] [--dtype auto]

Each trial starts from fresh requests: `--rows` prompts of `--context` tokens are prefilled
and decode once, and a long prompt has had its first `--offset` tokens (default: one
chunk); the timed step is the decode rows plus the long prompt's next `--chunk` tokens (the
runner's own measured `seconds`). With `--rows 0` it is the chunk alone.

With `--checkpoint` the chunk is the long prompt's last, with a checkpoint one token before
its end (as a model whose prefixes serve only at their own offset gives every prompt: a
hybrid's, a sliding window's), and the runners compared are the model's own fused one (the
chunk rides the step's forward, its snapshot taken inside it, where proven) and one whose
such chunks run apart, a forward a piece (`step.FusedForwards`).
"""

from __future__ import annotations

import argparse
import random
import statistics

import stepline.engine  # noqa: F401  (OpenBLAS before MLX)
from stepline.actors.scheduler.plan import ScheduledChunk, StepPlan
from stepline.actors.scheduler.work import Housekeeping, NewRequest, StepWork
from stepline.engine.models import DTYPES, load_model
from stepline.engine.runner import ModelRunner
from stepline.engine.step import FusedForwards
from stepline.events.models import RequestParams

GREEDY = RequestParams(max_tokens=64, temperature=0, top_p=1, top_k=0, min_p=0, seed=None)


def trial(
    runner: ModelRunner,
    rows: int,
    context: int,
    chunk: int,
    offset: int,
    seed: int,
    checkpoint: bool = False,
) -> float:
    rng = random.Random(seed)

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, 5000) for _ in range(n))

    news = [NewRequest(f"d{i}", prompt(context), GREEDY) for i in range(rows)]
    long = NewRequest("long", prompt(offset + chunk + (not checkpoint)), GREEDY)
    ids = tuple(n.request_id for n in news)

    def plan(step: int, decodes: tuple[str, ...], chunks: tuple[ScheduledChunk, ...]):
        num = {r: 1 for r in decodes} | {c.request_id: c.num_tokens for c in chunks}
        return StepPlan(step=step, decodes=decodes, chunks=chunks, num_scheduled_tokens=num)

    prefill = tuple(ScheduledChunk(r, 0, context, (), True) for r in ids)
    if news:
        runner.run(StepWork(plan=plan(1, (), prefill), admit=tuple(news)))
    first = (ScheduledChunk("long", 0, offset, (), False),)
    runner.run(StepWork(plan=plan(2, ids, first), admit=(long,)))
    end = offset + chunk
    second = (ScheduledChunk("long", offset, end, (end - 1,) if checkpoint else (), checkpoint),)
    seconds = runner.run(StepWork(plan=plan(3, ids, second))).seconds
    runner.housekeep(Housekeeping(free=(*ids, "long")))
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--offset", type=int, default=0, help="the chunk's (default: --chunk)")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", choices=DTYPES, default="auto", help="the weights' (load_model)")
    ap.add_argument("--checkpoint", action="store_true", help="see the module docstring")
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=args.dtype)
    print(f"{args.model}: {loaded.weights}")
    fused = ModelRunner(loaded)
    if not fused.fuse:
        raise SystemExit(f"{args.model}: this architecture runs separate forwards")
    if args.checkpoint:
        if not fused.forwards.fuses_snapshots:
            raise SystemExit(f"{args.model}: its snapshots in a fused forward are not proven")
        apart = ModelRunner(loaded, forwards=(FusedForwards, fused.forwards.split_head))
        runners = {"fused": fused, "apart": apart}
    else:
        runners = {"fused": fused, "separate": ModelRunner(loaded, fuse=False)}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(args.repeats + 1):  # the first round warms both up, and is dropped
        for name in runners if i % 2 else reversed(runners):
            offset = args.offset or args.chunk
            t = trial(
                runners[name], args.rows, args.context, args.chunk, offset, i, args.checkpoint
            )
            if i:
                times[name].append(t)
    for name, ts in times.items():
        print(f"{name:9s} median {1e3 * statistics.median(ts):7.1f} ms  ({len(ts)} steps)")
    other = "apart" if args.checkpoint else "separate"
    ratio = statistics.median(times["fused"]) / statistics.median(times[other])
    what = "its checkpoint's pieces apart" if args.checkpoint else "separate"
    print(
        f"fused / {what}: {ratio:.2f}  ({args.rows} decode rows of ~{args.context} "
        f"tokens beside a {args.chunk}-token chunk at offset {args.offset or args.chunk})"
    )


if __name__ == "__main__":
    main()
