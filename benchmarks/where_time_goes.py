"""Where a model's time goes, layer part by layer part: stepline's engine against mlx-lm's
`BatchGenerator`, in one process, on the same model; a lone long prompt and a burst.

    .venv/bin/python benchmarks/where_time_goes.py [--model stepline-demo-hybrid]
        [--scenarios alone,burst] [--requests 16] [--prompt 64-1024] [--output 64-128]
        [--alone-prompt 3500] [--alone-output 32] [--seed 0] [--engine-arg K=V ...]

Each scenario runs each engine twice. First plainly: output tokens/s, makespan and TTFT p50,
and their ratio. Then profiled: each part of each decoder layer (the mlx-lm modules a layer
holds: attention, a recurrent mixer such as Gated DeltaNet, Mamba2 or a short convolution,
an MoE block, an MLP) evaluated on its own, its inputs before it starts and its output
before it returns, so that its seconds are its own; the model's body (`forward.body_of`)
likewise, its calls counted. A profiled run is slower than a plain one (nothing overlaps,
each part waits for the last): read its shares, not its totals.

For each engine, profiled:
- its forwards (the body's calls), the tokens each took, and per step (stepline: by step
  kind, prefill only, prefill beside decode rows, decode only; BatchGenerator: by `next()`
  kind, a prefill pass or decode only);
- seconds in each part's class (with its kind), in the body outside them (embedding, norms,
  residuals, masks), in the steps outside the body (the output head, sampling, the engine's
  own Python), and outside the steps (stepline's event loop between steps; the caller's
  loop for BatchGenerator);
- stepline's decode groups and padding (as `burst.py` reports them).

Works on any mlx-lm model (a demo name, a directory, the default model). A measurement, not
a test: run it on a quiet machine.
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
from benchmarks.burst import (  # noqa: E402
    FIRST_ID,
    Burst,
    StepRecorder,
    figures,
    make_burst,
    mlx_lm_layers,
    p50,
    summarize_steps,
    type_of,
)
from stepline.api import Engine, SamplingParams  # noqa: E402

KINDS = (  # a part's kind, by words in its class's name (the first that matches)
    ("recurrent", ("DeltaNet", "Mamba", "Mixer", "ShortConv", "Conv", "SSM", "Linear")),
    ("moe", ("MoE", "Moe", "Sparse", "Expert", "Switch")),
    ("attention", ("Attention", "Attn")),
    ("mlp", ("MLP", "FeedForward", "FFN", "Dense")),
    ("norm", ("Norm",)),
)


def kind_of(name: str) -> str:
    return next((k for k, words in KINDS if any(w in name for w in words)), "other")


@dataclass
class Profile:
    """Seconds and calls by timed class, while `on`; a class's time is its own only where
    nothing timed runs inside it (the parts), the body's includes its parts'."""

    on: bool = False
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def snapshot(self) -> tuple[int, float]:
        return self.calls[BODY], self.seconds[BODY]

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.tokens.clear()


BODY = "body"


def _arrays(values: Any) -> list[Any]:
    import mlx.core as mx

    return [v for v in values if isinstance(v, mx.array)]


def tree_flatten(out: Any) -> list[Any]:
    """The leaves of a part's output (an array, or a tuple of them and other things)."""
    from mlx.utils import tree_flatten as flatten

    return [leaf for _, leaf in flatten(out)] if out is not None else []


@contextlib.contextmanager
def profiled(model: Any, profile: Profile) -> Iterator[list[str]]:
    """Time `model`'s body and the mlx-lm classes its decoder layers hold (class-wide: every
    instance, on any thread) while the block runs and `profile.on`; yields the part classes'
    names."""
    import mlx.core as mx
    import mlx.nn as nn

    from stepline.engine.forward import body_of

    body = body_of(model)
    parts: dict[type, str] = {}
    for layer in getattr(model, "layers", None) or body.layers:
        for child in layer.children().values():
            cls = type(child)
            if isinstance(child, nn.Module) and cls.__module__.startswith("mlx_lm.models"):
                parts[cls] = cls.__name__
    timed = {**parts, type(body): BODY}
    saved = {cls: cls.__dict__.get("__call__") for cls in timed}

    def wrap(cls: type, name: str) -> None:
        original = cls.__call__

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not profile.on:
                return original(self, *args, **kwargs)
            mx.eval(_arrays([*args, *kwargs.values()]))
            start = time.perf_counter()
            out = original(self, *args, **kwargs)
            mx.eval(_arrays(tree_flatten(out)))
            profile.seconds[name] += time.perf_counter() - start
            profile.calls[name] += 1
            if name == BODY and args and isinstance(args[0], mx.array):
                profile.tokens[name] += int(args[0].size)
            return out

        cls.__call__ = __call__  # type: ignore[method-assign]

    for cls, name in timed.items():
        wrap(cls, name)
    try:
        yield sorted(parts.values())
    finally:
        for cls, call in saved.items():
            if call is None:
                del cls.__call__  # type: ignore[misc]
            else:
                cls.__call__ = call  # type: ignore[method-assign]


# -- stepline ---------------------------------------------------------------------------------


class ForwardCounter(StepRecorder):
    """`burst.StepRecorder`, and each step's body calls and body seconds."""

    def __init__(self, runner: Any, profile: Profile):
        self.profile = profile
        self.forwards: dict[str, list[int]] = defaultdict(list)
        super().__init__(runner)

    def run(self, work: Any) -> Any:
        calls = self.profile.snapshot()[0]
        result = super().run(work)
        self.forwards[self.steps[-1]["kind"]].append(self.profile.snapshot()[0] - calls)
        return result


async def run_stepline(
    path: str, burst: Burst, options: dict[str, Any], profile: Profile | None
) -> tuple[Any, dict[str, Any]]:
    async with Engine.open(path, **options) as engine:
        loop = engine.step_loop
        await loop.wait_until(lambda: not loop.warming_up)  # a first start's warm-up
        recorder = ForwardCounter(loop.runner, profile or Profile())
        if profile is not None:
            profile.on = True
        times: list[list[float]] = [[] for _ in burst.prompts]

        async def consume(i: int, stream: Any) -> None:
            async for out in stream:
                if out.token_ids:
                    times[i].extend([time.perf_counter()] * len(out.token_ids))

        t0 = time.perf_counter()
        streams = await asyncio.gather(
            *(
                engine.submit(p, params=SamplingParams(max_tokens=n, ignore_eos=True))
                for p, n in zip(burst.prompts, burst.outputs, strict=True)
            )
        )
        await asyncio.gather(*(consume(i, s) for i, s in enumerate(streams)))
        if profile is not None:
            profile.on = False
        recorder.close()
        f = figures(t0, times, {})
        steps = summarize_steps(recorder.steps, f.makespan)
        return f, {"steps": steps, "forwards": dict(recorder.forwards)}


# -- mlx-lm -----------------------------------------------------------------------------------


def run_batchgen(model: Any, burst: Burst, profile: Profile | None) -> tuple[Any, dict[str, Any]]:
    from mlx_lm.generate import BatchGenerator

    with mlx_lm_layers(model):
        gen = BatchGenerator(model)
        kinds: dict[str, list[float]] = defaultdict(list)
        forwards: dict[str, list[int]] = defaultdict(list)
        counter = profile or Profile()
        try:
            if profile is not None:
                profile.on = True
            t0 = time.perf_counter()
            uids = gen.insert(burst.prompts, max_tokens=burst.outputs)
            times: dict[int, list[float]] = {u: [] for u in uids}
            done = 0
            while done < len(uids):
                t, calls = time.perf_counter(), counter.snapshot()[0]
                out = gen.next()
                prompt_responses, responses = out if isinstance(out, tuple) else ((), out)
                now = time.perf_counter()
                kind = "prefill" if prompt_responses else "decode"
                kinds[kind].append(now - t)
                forwards[kind].append(counter.snapshot()[0] - calls)
                for r in responses:
                    times[r.uid].append(now)
                    done += r.finish_reason is not None
        finally:
            if profile is not None:
                profile.on = False
            gen.close()
    f = figures(t0, [times[u] for u in uids], {})
    steps = {k: {"steps": len(v), "seconds": sum(v)} for k, v in kinds.items()}
    executor = sum(s["seconds"] for s in steps.values())
    return f, {
        "steps": {"kinds": steps, "executor_s": executor, "outside_s": f.makespan - executor},
        "forwards": dict(forwards),
    }


# -- report -----------------------------------------------------------------------------------


def plain_line(name: str, f: Any) -> str:
    return (
        f"    {name:<15} {f.tps:7.1f} tok/s  makespan {f.makespan:7.2f} s  "
        f"TTFT p50 {1e3 * p50(f.ttfts):8.0f} ms  ({f.tokens} tokens)"
    )


def report_profile(names: list[str], runs: dict[str, tuple[Any, dict[str, Any], Profile]]) -> None:
    print("  profiled (each part evaluated on its own: read the shares)")
    who = list(runs)
    print("    " + f"{'':<44}" + "".join(f"{w:>26}" for w in who))

    def row(label: str, values: list[float], makespans: list[float]) -> None:
        cells = "".join(
            f"{v:>16.2f} s {100 * v / m:5.1f}%" for v, m in zip(values, makespans, strict=True)
        )
        print(f"    {label:<44}{cells}")

    makespans = [runs[w][0].makespan for w in who]
    parts_total = [sum(runs[w][2].seconds[n] for n in names) for w in who]
    for name in names:
        row(f"{name} ({kind_of(name)})", [runs[w][2].seconds[name] for w in who], makespans)
    body = [runs[w][2].seconds[BODY] for w in who]
    row(
        "body, other (embedding, norms, residuals)",
        [b - p for b, p in zip(body, parts_total, strict=True)],
        makespans,
    )
    executor = [runs[w][1]["steps"]["executor_s"] for w in who]
    row(
        "steps outside the body (head, sampling, host)",
        [e - b for e, b in zip(executor, body, strict=True)],
        makespans,
    )
    row("outside the steps", [runs[w][1]["steps"]["outside_s"] for w in who], makespans)
    for w in who:
        f, info, prof = runs[w]
        calls, tokens = prof.calls[BODY], prof.tokens[BODY]
        per = ", ".join(
            f"{kind} {statistics.fmean(v):.2f} ({len(v)} steps)"
            for kind, v in sorted(info["forwards"].items())
            if v
        )
        print(
            f"    {w}: {calls} forwards, {tokens / max(calls, 1):.1f} tokens each; "
            f"forwards a step: {per}"
        )
        if info["steps"].get("decode_padding", -1) > -1:  # -1: no layer counts keys
            s = info["steps"]
            print(
                f"    {w}: decode groups a decode step mean {s['decode_groups_mean']:.2f}, "
                f"keys attended past the rows' own (padding) {100 * s['decode_padding']:.0f}%"
            )


def scenario(name: str, burst: Burst, path: str, model: Any, options: dict[str, Any]) -> None:
    print(
        f"{name}: {len(burst.prompts)} requests, {sum(map(len, burst.prompts))} prompt tokens, "
        f"{burst.tokens} output tokens"
    )
    plain = {
        "stepline": asyncio.run(run_stepline(path, burst, options, None))[0],
        "BatchGenerator": run_batchgen(model, burst, None)[0],
    }
    print("  plain")
    for who, f in plain.items():
        print(plain_line(who, f))
    s, b = plain["stepline"], plain["BatchGenerator"]
    print(
        f"    stepline / BatchGenerator: {s.tps / b.tps:.3f}x tok/s, "
        f"TTFT p50 {p50(s.ttfts) / p50(b.ttfts):.2f}x"
    )
    runs: dict[str, tuple[Any, dict[str, Any], Profile]] = {}
    names: list[str] = []  # the parts' classes (the same for each engine)
    for who in ("stepline", "BatchGenerator"):
        prof = Profile()
        with profiled(model, prof) as parts:
            names = parts
            if who == "stepline":
                f, info = asyncio.run(run_stepline(path, burst, options, prof))
            else:
                f, info = run_batchgen(model, burst, prof)
        runs[who] = (f, info, prof)
    report_profile(names, runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="stepline-demo-hybrid")
    p.add_argument("--scenarios", default="alone,burst")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=lambda s: tuple(map(int, s.split("-"))), default=(64, 1024))
    p.add_argument("--output", type=lambda s: tuple(map(int, s.split("-"))), default=(64, 128))
    p.add_argument("--alone-prompt", type=int, default=3500)
    p.add_argument("--alone-output", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--engine-arg", action="append", default=[], help="an Engine.open option, K=V (repeatable)"
    )
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
    # mlx-lm's first batch in a process pays for its kernels' first use: not in the figures
    run_batchgen(model, Burst([[FIRST_ID] * 8], [2]), None)
    for name in args.scenarios.split(","):
        if name == "alone":
            lone = argparse.Namespace(
                requests=1,
                prompt=(args.alone_prompt, args.alone_prompt),
                output=(args.alone_output, args.alone_output),
            )
            scenario("alone", make_burst(rng, lone, vocab), str(path), model, options)
        elif name == "burst":
            scenario("burst", make_burst(rng, args, vocab), str(path), model, options)
        else:
            raise SystemExit(f"unknown scenario {name!r}: alone, burst")


if __name__ == "__main__":
    main()
