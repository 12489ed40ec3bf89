"""LoRA adapters in the base model's batch: throughput of requests for 3 adapters and the
base model sent together, against the same requests all for the base model.

    .venv/bin/python benchmarks/lora.py [--model SmolLM2-135M-Instruct] [--per-model 4]
        [--max-tokens 64] [--rank 8] [--num-layers 16] [--repeats 2]

The adapters are built here with random matrices (nonzero B) in mlx_lm.lora's format, on
`--num-layers` of the model's last blocks and all 7 of a llama block's Linears (mlx_lm.lora's
default keys), rank `--rank`. Each run sends `4 x --per-model` greedy requests at once
(different prompts, `--max-tokens` each) and times them from the first submit to the last
token: generated tokens / second, and the mean step time from the engine's metrics. The
adapters' run also checks, from the event log, that requests of all four shared steps.

A measurement, not a test: run it on a quiet machine, and say if it was not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # lora_files: the tests' adapter builder

KEYS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List five uses for a paperclip.",
    "Describe the water cycle to a child.",
    "What makes bread rise?",
    "Give three tips for learning a language.",
    "Why do leaves change colour in autumn?",
    "Summarise the plot of a heist film you invent.",
]


async def one_run(model: str, lora: list[str], adapters: list[str | None], args) -> dict:
    from stepline.api import Engine, SamplingParams
    from stepline.events.log_reader import read_events
    from stepline.events.models import Admitted, StepPlanned

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "events.jsonl"
        async with Engine.open(
            model,
            lora=lora,
            max_num_seqs=len(adapters),
            max_step_tokens=512,
            event_log=str(log),
        ) as engine:
            import anyio

            # one warm request first: compile, caches
            async with await engine.submit("hi", params=SamplingParams(max_tokens=4)) as s:
                async for _ in s:
                    pass
            tokens = 0
            t0 = time.perf_counter()

            async def run(i: int, adapter: str | None) -> None:
                nonlocal tokens
                prompt = PROMPTS[i % len(PROMPTS)] + f" ({i})"
                stream = await engine.submit(
                    messages=[{"role": "user", "content": prompt}], params=params, adapter=adapter
                )
                async with stream:
                    async for out in stream:
                        tokens += len(out.token_ids)

            async with anyio.create_task_group() as tg:
                for i, adapter in enumerate(adapters):
                    tg.start_soon(run, i, adapter)
            seconds = time.perf_counter() - t0
        events = list(read_events(log))
    adapter_of = {e.request_id: e.adapter for e in events if isinstance(e, Admitted)}
    kinds = set(adapters)
    shared = sum(
        1
        for e in events
        if isinstance(e, StepPlanned) and {adapter_of.get(r, "?") for r in e.request_ids} == kinds
    )
    steps = [e for e in events if isinstance(e, StepPlanned)]
    return {"tok_s": tokens / seconds, "seconds": seconds, "shared": shared, "steps": len(steps)}


async def main(args) -> None:
    from lora_files import make_adapter

    from stepline.engine.models import load_model

    loaded = load_model(args.model)
    root = Path(tempfile.mkdtemp(prefix="stepline-lora-"))
    names = ["a", "b", "c"]
    lora = [
        f"{n}={make_adapter(root / n, loaded.model, seed=i, rank=args.rank, keys=KEYS, num_layers=args.num_layers, std=0.02, scale=1.0)}"  # noqa: E501
        for i, n in enumerate(names)
    ]
    del loaded
    mixed: list[str | None] = [[None, *names][i % 4] for i in range(4 * args.per_model)]
    base: list[str | None] = [None] * len(mixed)
    results: dict[str, list[dict]] = {"base": [], "adapters": []}
    for _ in range(args.repeats):  # alternated, so that a busier moment hits both
        results["base"].append(await one_run(args.model, lora, base, args))
        results["adapters"].append(await one_run(args.model, lora, mixed, args))
    med = {k: statistics.median(r["tok_s"] for r in v) for k, v in results.items()}
    print(
        f"model {args.model}; 3 adapters (rank {args.rank}, {args.num_layers} blocks x 7 "
        f"Linears) + base; {len(mixed)} requests x {args.max_tokens} tokens, sent together"
    )
    for k, v in results.items():
        runs = ", ".join(f"{r['tok_s']:.1f}" for r in v)
        print(f"  {k:9s} median {med[k]:7.1f} tok/s  (runs: {runs})")
    shared = [r["shared"] for r in results["adapters"]]
    steps = [r["steps"] for r in results["adapters"]]
    print(f"  steps with requests of all 3 adapters and the base: {shared} of {steps}")
    print(f"  adapters / base: {med['adapters'] / med['base']:.2f}x  (target >= 0.8x)")


if __name__ == "__main__":
    import anyio

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--per-model", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    anyio.run(main, p.parse_args())
