"""Where a burst's time goes: stepline's engine against mlx-lm's BatchGenerator, in-process.

    .venv/bin/python benchmarks/burst.py [--model SmolLM2-135M-Instruct] [--requests 16]
        [--prompt 64-256] [--output 96-160] [--repeats 3] [--seed 0] [--engine-arg K=V ...]

A burst of --requests requests that arrive together (prompts of random token ids, lengths
drawn from --prompt, greedy, every one generating its --output length: no stop tokens),
served in this process by stepline's `Engine` (its defaults, or --engine-arg) and by mlx-lm's
`BatchGenerator` (its defaults and mlx-lm's own attention, as mlx_lm.server runs it),
alternating, fresh prompts each repeat. For each: output tokens/s (every output token over
the makespan), makespan, TTFT p50, inter-token p50; the ratio of each repeat and their
median.

For stepline, where the time went (each repeat's): steps by kind (prefill only,
prefill beside decode rows, decode only) with their count, the forwards each ran (the
model body's calls inside the step, its look-ahead's aside: `StepRecorder`) and the
executor's seconds in them (a step's seconds
include the look-ahead forward it started), the rest of the makespan
(the event loop between steps), the decode groups a decode step ran and the keys its
attention read against the rows' own contexts (the padding). For BatchGenerator, its
`next()` calls by kind (a prefill pass, or decode only).

A measurement, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stepline.engine  # noqa: E402,F401  (OpenBLAS before MLX)
from stepline.api import Engine, SamplingParams  # noqa: E402

FIRST_ID = 1000  # prompt ids from here: past the special tokens of the models we serve


@dataclass
class Burst:
    prompts: list[list[int]]
    outputs: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.outputs)


def make_burst(rng: random.Random, args: argparse.Namespace, vocab: int) -> Burst:
    lo, hi = args.prompt
    olo, ohi = args.output
    top = min(vocab, FIRST_ID + 20_000)
    prompts = [
        [rng.randrange(FIRST_ID, top) for _ in range(rng.randint(lo, hi))]
        for _ in range(args.requests)
    ]
    return Burst(prompts, [rng.randint(olo, ohi) for _ in range(args.requests)])


@dataclass
class Figures:
    makespan: float
    tokens: int
    ttfts: list[float]
    itls: list[float]
    breakdown: dict[str, Any] = field(default_factory=dict)

    @property
    def tps(self) -> float:
        return self.tokens / self.makespan


def figures(t0: float, times: list[list[float]], breakdown: dict[str, Any]) -> Figures:
    end = max(ts[-1] for ts in times)
    itls = [b - a for ts in times for a, b in zip(ts, ts[1:], strict=False)]
    return Figures(
        end - t0, sum(len(ts) for ts in times), [ts[0] - t0 for ts in times], itls, breakdown
    )


# -- stepline ---------------------------------------------------------------------------------


def step_kind(plan: Any) -> str:
    if plan.chunks and plan.decodes:
        return "mixed"
    return "prefill" if plan.chunks else "decode"


class StepRecorder:
    """Wraps the runner's `run` (on the executor's thread): each step's kind, rows, chunk
    tokens, seconds, the forwards it ran (its model body's calls inside the step, less the
    decode rows' next forward that it builds as it ends, `LookAhead.build` and
    `.decode_only`: a decode step whose forward was built a step ahead counts none), and
    the decode groups' shape before it ran."""

    def __init__(self, runner: Any):
        self.runner, self.steps, self.plans = runner, [], []
        self._run = runner.run
        runner.run = self.run
        self._calls = count_calls(runner.model)
        self._ahead = 0  # body calls while building the next look-ahead
        self._lookahead = getattr(runner, "lookahead", None)
        self._builds = {
            name: getattr(self._lookahead, name)
            for name in ("build", "decode_only")
            if hasattr(self._lookahead, name)
        }
        for name, method in self._builds.items():
            setattr(self._lookahead, name, self._building(method))

    def _building(self, method: Any) -> Any:
        def build(*args: Any, **kwargs: Any) -> Any:
            calls = self._calls[0]
            try:
                return method(*args, **kwargs)
            finally:
                self._ahead += self._calls[0] - calls

        return build

    def run(self, work: Any) -> Any:
        plan = work.plan
        decode = getattr(getattr(self.runner, "batch", None), "caches", None)
        groups = list(getattr(decode, "sizes", []))
        padded = sum(
            rows * group[0].size()
            for rows, group in zip(groups, getattr(decode, "groups", []), strict=False)
        )
        batch = getattr(getattr(self.runner, "batch", None), "rows", None)
        contexts = sum(int(q.prompt.shape[0]) + len(q.output) for q in getattr(batch, "seqs", ()))
        calls, ahead = self._calls[0], self._ahead
        result = self._run(work)
        forwards = self._calls[0] - calls - (self._ahead - ahead)
        self.plans.append((plan, result.seconds))
        self.steps.append(
            {
                "kind": step_kind(plan),
                "decodes": len(plan.decodes),
                "chunk_tokens": sum(c.end - c.start for c in plan.chunks),
                "chunks": len(plan.chunks),
                "seconds": result.seconds,
                "forwards": forwards,
                "groups": len(groups),
                "padded_keys": padded,
                "own_keys": contexts,
            }
        )
        return result

    def close(self) -> None:
        self.runner.run = self._run
        for name, method in self._builds.items():
            setattr(self._lookahead, name, method)
        self._calls[1]()


def count_calls(model: Any) -> list[Any]:
    """Count the calls of `model`'s body (`forward.body_of`: its class's, on any thread):
    [the count so far, a function that stops counting]."""
    from stepline.engine.forward import body_of

    cls = type(body_of(model))
    saved = cls.__dict__.get("__call__")
    original = cls.__call__
    state: list[Any] = [0, None]

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        state[0] += 1
        return original(self, *args, **kwargs)

    def stop() -> None:
        if saved is None:
            del cls.__call__  # type: ignore[misc]
        else:
            cls.__call__ = saved  # type: ignore[method-assign]

    cls.__call__ = __call__  # type: ignore[method-assign]
    state[1] = stop
    return state


def summarize_steps(steps: list[dict], makespan: float) -> dict[str, Any]:
    by: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in steps:
        k = by[s["kind"]]
        k["steps"] += 1
        k["seconds"] += s["seconds"]
        k["rows"] += s["decodes"]
        k["chunk_tokens"] += s["chunk_tokens"]
        k["forwards"] += s.get("forwards", 0)
        k["longest"] = max(k["longest"], s["seconds"])
    decode = [s for s in steps if s["kind"] == "decode"]
    executor = sum(s["seconds"] for s in steps)
    own = sum(s["own_keys"] for s in decode)
    return {
        "kinds": {k: dict(v) for k, v in by.items()},
        "executor_s": executor,
        "outside_s": makespan - executor,
        "decode_groups_mean": statistics.fmean(s["groups"] for s in decode) if decode else 0,
        "decode_groups_max": max((s["groups"] for s in decode), default=0),
        "decode_padding": sum(s["padded_keys"] for s in decode) / own - 1 if own else 0.0,
    }


async def run_stepline(model: str, burst: Burst, options: dict[str, Any]) -> Figures:
    async with Engine.open(model, **options) as engine:
        loop = engine.step_loop
        await loop.wait_until(lambda: not loop.warming_up)  # a first start's warm-up
        recorder = StepRecorder(loop.runner)
        times: list[list[float]] = [[] for _ in burst.prompts]

        async def consume(i: int, stream: Any) -> None:
            async for out in stream:
                if out.token_ids:
                    now = time.perf_counter()
                    times[i].extend([now] * len(out.token_ids))

        t0 = time.perf_counter()
        # submitted together, as clients of a server send them: the engine's first step
        # waits (briefly) for the requests still being prepared
        streams = await asyncio.gather(
            *(
                engine.submit(p, params=SamplingParams(max_tokens=n, ignore_eos=True))
                for p, n in zip(burst.prompts, burst.outputs, strict=True)
            )
        )
        await asyncio.gather(*(consume(i, s) for i, s in enumerate(streams)))
        recorder.close()
        f = figures(t0, times, {})
        f.breakdown = summarize_steps(recorder.steps, f.makespan)
        return f


# -- mlx-lm -----------------------------------------------------------------------------------


@contextlib.contextmanager
def mlx_lm_layers(model: Any) -> Iterator[None]:
    """mlx-lm's own layers while the block runs (the attention function of `model`'s
    module, the Gated DeltaNet recurrence, the expert layers): stepline's engine swaps them
    for the whole process (engine/fused.py, engine/cpu_attention.py, engine/gated_delta.py,
    engine/experts.py), and BatchGenerator is measured as mlx_lm.server runs it."""
    import importlib

    from mlx_lm.models import base

    from stepline.engine import experts, gated_delta
    from stepline.engine.forward import body_of

    # a wrapper's attention is its language model's
    module = importlib.import_module(type(body_of(model) or model).__module__)
    mine = getattr(module, "scaled_dot_product_attention", None)
    if mine is not None:
        module.scaled_dot_product_attention = base.scaled_dot_product_attention
    try:
        with gated_delta.mlx_lm_own(), experts.mlx_lm_own():
            yield
    finally:
        if mine is not None:
            module.scaled_dot_product_attention = mine


def run_batchgen(model: Any, burst: Burst) -> Figures:
    with mlx_lm_layers(model):
        return _run_batchgen(model, burst)


def _run_batchgen(model: Any, burst: Burst) -> Figures:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model)
    kinds: dict[str, list[float]] = defaultdict(list)
    try:
        t0 = time.perf_counter()
        uids = gen.insert(burst.prompts, max_tokens=burst.outputs)
        times: dict[int, list[float]] = {u: [] for u in uids}
        done = 0
        while done < len(uids):
            t = time.perf_counter()
            prompt_responses, responses = _next(gen)
            now = time.perf_counter()
            kinds["prefill" if prompt_responses else "decode"].append(now - t)
            for r in responses:
                times[r.uid].append(now)
                done += r.finish_reason is not None
    finally:
        gen.close()
    breakdown = {k: {"calls": len(v), "seconds": sum(v)} for k, v in kinds.items()}
    return figures(t0, [times[u] for u in uids], breakdown)


def _next(gen: Any) -> tuple[Any, Any]:
    """BatchGenerator.next(): (prompt progress, generation responses)."""
    out = gen.next()
    if isinstance(out, tuple):
        return out
    return (), out


# -- report -----------------------------------------------------------------------------------


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def line(name: str, f: Figures) -> str:
    return (
        f"  {name:<14} {f.tps:7.1f} tok/s  makespan {f.makespan:6.2f} s  "
        f"TTFT p50 {1e3 * p50(f.ttfts):7.0f} ms  ITL p50 {1e3 * p50(f.itls):5.0f} ms  "
        f"({f.tokens} tokens)"
    )


def report_breakdown(f: Figures) -> None:
    b = f.breakdown
    print("  stepline's steps (this repeat):")
    for kind in ("prefill", "mixed", "decode"):
        k = b["kinds"].get(kind)
        if not k:
            continue
        n = k["steps"]
        print(
            f"    {kind:<8} {int(n):4d} steps {k['seconds']:6.2f} s "
            f"({1e3 * k['seconds'] / n:6.1f} ms each; {k['rows'] / n:4.1f} decode rows, "
            f"{k['chunk_tokens'] / n:6.1f} prompt tokens, {k.get('forwards', 0) / n:4.2f} "
            f"forwards a step; longest {1e3 * k['longest']:.0f} ms)"
        )
    print(
        f"    executor {b['executor_s']:.2f} s of the makespan's {f.makespan:.2f} s; "
        f"outside it {b['outside_s']:.2f} s; decode groups a decode step: mean "
        f"{b['decode_groups_mean']:.2f}, max {b['decode_groups_max']}; keys attended past "
        f"the rows' own (padding): {100 * b['decode_padding']:.0f}%"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=lambda s: tuple(map(int, s.split("-"))), default=(64, 256))
    p.add_argument("--output", type=lambda s: tuple(map(int, s.split("-"))), default=(96, 160))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--engine-arg", action="append", default=[], help="an Engine.open option, K=V (repeatable)"
    )
    p.add_argument("--only", choices=["stepline", "batchgen"], default=None)
    args = p.parse_args()
    options: dict[str, Any] = {}
    for kv in args.engine_arg:
        k, v = kv.split("=", 1)
        options[k] = None if v == "None" else type_of(v)

    from mlx_lm.utils import load

    from benchmarks.served_model import served_dir

    path = served_dir(args.model)
    model, tokenizer = load(str(path))
    vocab = len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else 32_000
    rng = random.Random(args.seed)
    ratios, runs = [], []
    for r in range(args.repeats):
        burst = make_burst(rng, args, vocab)
        order = ["stepline", "batchgen"] if r % 2 == 0 else ["batchgen", "stepline"]
        if args.only:
            order = [args.only]
        got: dict[str, Figures] = {}
        for who in order:
            if who == "stepline":
                got[who] = asyncio.run(run_stepline(str(path), burst, options))
            else:
                got[who] = run_batchgen(model, burst)
        print(f"repeat {r + 1}: {len(burst.prompts)} requests, {burst.tokens} output tokens")
        for who in ("stepline", "batchgen"):
            if who in got:
                print(line(who, got[who]))
        if len(got) == 2:
            ratio = got["stepline"].tps / got["batchgen"].tps
            ttft = p50(got["stepline"].ttfts) / p50(got["batchgen"].ttfts)
            ratios.append((ratio, ttft))
            print(f"  stepline / BatchGenerator: {ratio:.3f}x tok/s, TTFT p50 {ttft:.2f}x")
            print(f"  BatchGenerator's calls: {got['batchgen'].breakdown}")
        if "stepline" in got:
            runs.append(got["stepline"])
            report_breakdown(got["stepline"])
    if ratios:
        print(
            f"median of {len(ratios)}: stepline / BatchGenerator "
            f"{statistics.median(r for r, _ in ratios):.3f}x output tok/s, TTFT p50 "
            f"{statistics.median(t for _, t in ratios):.2f}x"
        )


def type_of(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


if __name__ == "__main__":
    main()
