"""One rank of a distributed test job (tests/test_distributed.py starts one per rank).

    python tests/distributed_worker.py MODEL PARALLEL OUT.json [EVENT_LOG]

Runs `workload` on `Engine.open(MODEL, parallel=PARALLEL)`; rank 0 writes what every
request produced to OUT.json. PARALLEL "none" runs one process (the reference).
"""

from __future__ import annotations

import json
import os
import sys

import anyio

from stepline.api import Engine, SamplingParams

ENGINE_KWARGS = dict(max_step_tokens=16, max_num_seqs=8)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 37 + salt * 11) % 250 for i in range(n)]


async def _run(engine: Engine, rid: str, ids, params, checkpoints=()) -> dict:
    stream = await engine.submit(ids, params=params, request_id=rid, checkpoints=checkpoints)
    outs = [o async for o in stream]
    return {
        "tokens": [t for o in outs for t in o.token_ids],
        "finish": outs[-1].finish_reason,
        "cached": outs[-1].num_cached_tokens,
    }


async def workload(engine: Engine) -> dict:
    """A mixed batch (greedy and seeded, prompts longer than the step budget, so prefill is
    chunked beside decodes, one with a checkpoint), then a request that starts from the
    checkpointed prefix."""
    shared = prompt(24, salt=1)
    batch = [
        ("greedy", prompt(40), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), ()),
        (
            "seeded",
            prompt(7, salt=2),
            SamplingParams(max_tokens=16, temperature=0.9, seed=7, ignore_eos=True),
            (),
        ),
        (
            "checkpointed",
            [*shared, *prompt(9, salt=3)],
            SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
            (24,),
        ),
        # Its admission and lookup carry ~5 KB of token ids: more than one all_sum's buffer.
        (
            "long",
            [3 + i * 131 % 980 for i in range(1800)],
            SamplingParams(max_tokens=3, temperature=0),
            (),
        ),
    ]
    results: dict[str, dict] = {}

    async def one(rid, ids, params, checkpoints) -> None:
        results[rid] = await _run(engine, rid, ids, params, checkpoints)

    async with anyio.create_task_group() as tg:
        for rid, ids, params, checkpoints in batch:
            tg.start_soon(one, rid, ids, params, checkpoints)
    results["prefix-hit"] = await _run(
        engine,
        "prefix-hit",
        [*shared, *prompt(5, salt=4)],
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    )
    return results


async def main(model: str, parallel: str, event_log: str | None) -> dict:
    kwargs = dict(ENGINE_KWARGS, event_log=event_log)
    if parallel != "none":
        kwargs["parallel"] = parallel
    async with Engine.open(model, **kwargs) as engine:  # ranks > 0 never enter the block
        return await workload(engine)


if __name__ == "__main__":
    model, parallel, out = sys.argv[1:4]
    results = anyio.run(main, model, parallel, sys.argv[4] if len(sys.argv) > 4 else None)
    with open(out, "w") as f:
        json.dump(results, f)
    # Rank 0 ends as `stepline serve --parallel` does: MLX's ring backend can abort at
    # interpreter teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
