"""Requests that arrive together with one new system prompt compute it about once."""

from __future__ import annotations

import json
import random

import anyio
from helpers import replay

from stepline.api import Engine, SamplingParams
from stepline.events.log import read_events
from stepline.events.models import ChunkPrefilled

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]


def chat(system: str, i: int, rng: random.Random) -> list[dict]:
    question = " ".join(rng.choice(WORDS) for _ in range(12))
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"question {i}: {question}"},
    ]


async def answers(engine: Engine, chats: list[list[dict]]) -> list[list[int]]:
    got: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        got[i] = [
            t async for o in engine.generate(messages=chats[i], params=GREEDY) for t in o.token_ids
        ]

    async with anyio.create_task_group() as tg:
        for i in range(len(chats)):
            tg.start_soon(one, i)
    return [got[i] for i in range(len(chats))]


async def test_sixteen_chats_sent_at_once_compute_their_shared_system_prompt_once(
    model_cache_dir, tmp_path
):
    rng = random.Random(3)
    system = " ".join(rng.choice(WORDS) for _ in range(300))
    chats = [chat(system, i, rng) for i in range(16)]
    log = tmp_path / "run.jsonl"
    async with Engine.open(
        "stepline-demo", max_step_tokens=128, max_num_seqs=16, event_log=log
    ) as engine:
        warm = await answers(engine, chats)
        prompts = [engine.encode(messages=c) for c in chats]
        system_end = min(engine.chat_checkpoints(chats[0], prompts[0]))
    computed = sum(e.end - e.start for e in read_events(log) if isinstance(e, ChunkPrefilled))
    needed = len(prompts[0]) + sum(len(p) - system_end for p in prompts[1:])
    assert system_end > 250  # the shared part is most of each prompt
    assert computed <= 1.5 * needed  # without sharing: 16 x the system prompt
    hits = [e for e in read_events(log) if isinstance(e, ChunkPrefilled) and e.num_cached_tokens]
    assert len(hits) == 15 and all(h.cache_source == "memory" for h in hits)
    # Replay tells the same story: the request's timeline and the run's summary.
    code, text = replay(str(log), "--request", hits[0].request_id, "--json")
    assert code == 0 and json.loads(text)["num_cached_tokens"] == hits[0].num_cached_tokens
    code, text = replay(str(log), "--json")
    assert code == 0
    assert json.loads(text)["num_cached_tokens"] == sum(h.num_cached_tokens for h in hits)

    async with Engine.open(
        "stepline-demo", max_step_tokens=128, max_num_seqs=16, prefix_cache_gb=0
    ) as engine:
        cold = await answers(engine, chats)
    assert warm == cold  # starting from the shared snapshot changes no token
