"""Constrained-decoding benchmark (issue 12): what grammar masks cost a decode batch.

    .venv/bin/python benchmarks/constrained_bench.py            # stepline-demo-large, 3 repeats
    .venv/bin/python benchmarks/constrained_bench.py --quick    # stepline-demo, 1 repeat

1. Decode tokens/s of a batch of 16 requests (steady state: from the moment every request
   has its first token to the first request's last one) with 0, 4 and 16 of them under a
   JSON schema; the unconstrained rows are plain sampling. The schema's one string has a
   minLength longer than the run, so constrained rows decode for the whole window instead of
   finishing early and shrinking the batch. Median of `--repeats`, runs interleaved.
2. The masks' own cost per step (no forward pass): llguidance, MLX unpack and select, and
   advancing the matchers, for the same row counts; to set against the step time above.
3. Compile time of a 20-property JSON schema: llguidance's tokenizer set-up (once per
   model) and the grammar itself (once per schema; the engine caches it), then a cache hit.

The demo vocabulary has 1,024 tokens; a mask's cost grows with the vocabulary (a 150k-token
model costs more per constrained row), so these figures are the engine's overhead with a
small vocabulary, not a real model's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import stepline.engine  # noqa: F401 - loads OpenBLAS before MLX
from stepline.api import Engine, SamplingParams
from stepline.engine.grammar import GrammarCompiler, json_schema_grammar

LONG_STRING = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 4000}},
    "required": ["text"],
}


def twenty_properties() -> dict:
    kinds = [
        {"type": "string", "maxLength": 40},
        {"type": "integer", "minimum": 0, "maximum": 10_000},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(20)}
    return {
        "type": "object",
        "properties": props,
        "required": list(props)[:12],
        "additionalProperties": False,
    }


async def decode_rate(engine: Engine, num_constrained: int, batch: int, tokens: int) -> float:
    """Tokens/s of the whole batch while every request decodes."""
    grammar = json_schema_grammar(LONG_STRING)
    arrivals: dict[int, list[tuple[float, int]]] = {}  # request -> (time, tokens in output)

    async def run(i: int) -> None:
        params = SamplingParams(
            max_tokens=tokens,
            temperature=0.8,
            seed=i,
            ignore_eos=True,
            grammar=grammar if i < num_constrained else None,
        )
        seen = arrivals.setdefault(i, [])
        async for out in engine.generate(f"Request {i}: tell me a story.", params=params):
            if out.token_ids:
                seen.append((time.perf_counter(), len(out.token_ids)))

    await asyncio.gather(*(run(i) for i in range(batch)))
    start = max(seen[0][0] for seen in arrivals.values())
    end = min(seen[-1][0] for seen in arrivals.values())
    count = sum(n for seen in arrivals.values() for t, n in seen if start < t <= end)
    return count / (end - start) if end > start else float("nan")


def mask_cost(engine: Engine, num_rows: int, batch: int, steps: int = 200) -> float:
    """Microseconds per step that masking `num_rows` rows of a (batch, V) logits array adds:
    llguidance's masks, the MLX unpack and select, and advancing each matcher."""
    import mlx.core as mx
    import numpy as np

    from stepline.engine.constraints import advance, apply_grammar_masks

    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size)
    grammar = json_schema_grammar(LONG_STRING)
    matchers = [compiler.matcher(grammar) for _ in range(num_rows)]
    rng = np.random.default_rng(0)
    logits = mx.array(rng.standard_normal((batch, engine.vocab_size)).astype(np.float32))
    mx.eval(logits)
    rows = list(range(num_rows))
    t0 = time.perf_counter()
    for _ in range(steps):
        masked = apply_grammar_masks(logits, rows, matchers)
        tokens = mx.argmax(masked[:num_rows], axis=-1).tolist()
        for m, t in zip(matchers, tokens, strict=True):
            advance(m, t)
    return (time.perf_counter() - t0) / steps * 1e6


async def bench(args: argparse.Namespace) -> None:
    async with Engine.open(args.model, max_num_seqs=args.batch, max_step_tokens=1024) as engine:
        await decode_rate(engine, 0, args.batch, 8)  # warm up
        rates: dict[int, list[float]] = {n: [] for n in args.constrained}
        for _ in range(args.repeats):
            for n in args.constrained:
                rates[n].append(await decode_rate(engine, n, args.batch, args.tokens))
        base = statistics.median(rates[0]) if 0 in rates else None
        print(f"decode, batch {args.batch}, {args.tokens} tokens each, {args.model}:")
        for n, values in rates.items():
            rate = statistics.median(values)
            loss = f"  ({(1 - rate / base) * 100:+.1f}% slower)" if base and n else ""
            print(f"  {n:2d} constrained rows: {rate:8.1f} tok/s{loss}")

        print(f"mask cost per step, batch {args.batch} (no forward pass; argmax included):")
        for n in args.constrained:
            if n:
                us = mask_cost(engine, n, args.batch)
                print(f"  {n:2d} constrained rows: {us:8.1f} us/step")

        compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size)
        grammar = json_schema_grammar(twenty_properties())
        t0 = time.perf_counter()
        compiler._tokenizer()
        t1 = time.perf_counter()
        compiler.compile(grammar)
        t2 = time.perf_counter()
        compiler.compile(grammar)
        t3 = time.perf_counter()
        print("compile, 20-property JSON schema:")
        print(f"  llguidance tokenizer (once per model): {(t1 - t0) * 1e3:8.2f} ms")
        print(f"  grammar (once per schema):             {(t2 - t1) * 1e3:8.2f} ms")
        print(f"  cache hit:                             {(t3 - t2) * 1e6:8.2f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="stepline-demo-large")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--constrained", type=int, nargs="+", default=[0, 4, 16])
    p.add_argument("--quick", action="store_true", help="stepline-demo, 1 repeat")
    args = p.parse_args()
    if args.quick:
        args.model, args.repeats = "stepline-demo", 1
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
