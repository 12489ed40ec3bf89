"""A prompt sent again reuses all but its last token on every cache kind, and a request that
reuses less is told why: the event log records where its prompt stopped matching what the
cache held, and for what reason (`PrefixIndex.explain`)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers import replay

from stepline.actors.scheduler.prefix_index import EVICTED_KEYS, EntryInfo, PrefixIndex
from stepline.api import Engine, SamplingParams
from stepline.events.log import read_events
from stepline.events.models import ChunkPrefilled

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
MODELS = ["stepline-demo", "stepline-demo-hybrid", "stepline-demo-sliding"]


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


async def generate(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    stream = await engine.submit(prompt, params=GREEDY)
    outs = [o async for o in stream]
    return [t for o in outs for t in o.token_ids], outs[-1].num_cached_tokens


def first_chunks(path: Path) -> list[ChunkPrefilled]:
    """Each request's first chunk, in the order they came."""
    seen: set[str] = set()
    out = []
    for e in read_events(path):
        if isinstance(e, ChunkPrefilled) and e.request_id not in seen:
            seen.add(e.request_id)
            out.append(e)
    return out


@pytest.mark.parametrize("model", MODELS)
async def test_a_prompt_sent_again_reuses_all_but_its_last_token(model, model_cache_dir):
    prompt = ids(90, 1)  # longer than the sliding demo's window: it wraps
    async with Engine.open(model, max_step_tokens=32, max_num_seqs=4) as engine:
        first, cached = await generate(engine, prompt)
        assert cached == 0
        again, cached = await generate(engine, prompt)
    assert cached == len(prompt) - 1
    assert again == first
    async with Engine.open(model, prefix_cache_gb=0, max_step_tokens=32, max_num_seqs=4) as e:
        assert (await generate(e, prompt))[0] == first


async def test_each_miss_names_where_the_prompt_broke_and_why(model_cache_dir, tmp_path: Path):
    path = tmp_path / "events.jsonl"
    base = ids(60, 2)
    async with Engine.open(
        "stepline-demo-hybrid", max_step_tokens=32, max_num_seqs=4, event_log=path
    ) as engine:
        await generate(engine, base)  # cold: nothing cached
        # differs from `base` at token 40, and the hybrid's state exists only where it was
        # taken (59 and the end of the request): no snapshot at 40
        await generate(engine, base[:40] + ids(20, 3))
        await generate(engine, ids(30, 4))  # starts as nothing cached does
        await generate(engine, base)  # all but its last token: no miss
    cold, no_snapshot, other, again = first_chunks(path)
    assert (cold.prefix_miss, cold.prefix_shared) == ("cold", 0)
    assert (no_snapshot.prefix_miss, no_snapshot.prefix_shared) == ("no-snapshot", 40)
    assert no_snapshot.num_cached_tokens == 0
    assert other.prefix_miss == "cold"
    assert again.prefix_miss is None and again.num_cached_tokens == 59
    # the replay says it, per request and in the summary
    code, text = replay(str(path), "--request", no_snapshot.request_id)
    assert code == 0
    assert "prefix cache: 0 of 60 reused; a cached entry shares its first 40 tokens" in text
    assert "serves an entry only at the offset it was taken at" in text
    code, text = replay(str(path))
    assert "prefix-cache hits short of the prompt, by why: cold 2, no-snapshot 1" in text


@pytest.mark.parametrize("model", ["stepline-demo-hybrid", "stepline-demo-sliding"])
async def test_a_prompt_rewritten_at_the_same_place_every_turn_misses_there_once(
    model, model_cache_dir, tmp_path: Path
):
    """A client that changes one line inside its prompt every turn (a clock in its system
    prompt): the second turn finds no snapshot where it parts from the first, and leaves one
    there, so every later turn computes only from that line on."""
    path = tmp_path / "events.jsonl"
    head, tail = ids(40, 7), ids(30, 8)  # longer than the sliding demo's window: it wraps
    async with Engine.open(model, max_step_tokens=32, max_num_seqs=4, event_log=path) as engine:
        cached = [(await generate(engine, [*head, 5 + turn, *tail]))[1] for turn in range(4)]
    assert cached == [0, 0, 40, 40]
    second = first_chunks(path)[1]
    assert (second.prefix_miss, second.prefix_shared) == ("no-snapshot", 40)


async def test_a_dense_model_misses_where_its_prompt_diverges(model_cache_dir, tmp_path: Path):
    path = tmp_path / "events.jsonl"
    base = ids(50, 5)
    async with Engine.open(
        "stepline-demo", max_step_tokens=32, max_num_seqs=4, event_log=path
    ) as engine:
        await generate(engine, base)
        _, cached = await generate(engine, base[:33] + ids(10, 6))
    assert cached == 33  # attention caches are cut back to the common prefix
    diverged = first_chunks(path)[1]
    assert (diverged.prefix_miss, diverged.prefix_shared) == ("diverged", 33)


def test_the_index_tells_an_eviction_from_a_prompt_never_seen():
    index = PrefixIndex(max_bytes=100)
    a, b = tuple(range(1, 41)), tuple(range(100, 140))
    assert index.explain(a, 0) == ("cold", 0)
    index.apply([EntryInfo(a, 80, trimmable=True)])
    assert index.explain(a + (7,), 40) == (None, 40)  # all but its last token
    index.apply([EntryInfo(b, 80, trimmable=True)])  # a is evicted: the budget holds one
    assert a not in index
    assert index.explain(a + (7,), 0) == ("evicted", 40)
    assert index.explain(a[:10] + (999, 998), 0) == ("evicted", 10)
    assert index.explain(b[:20] + (5, 6), 20) == ("diverged", 20)
    # only the last EVICTED_KEYS evictions are remembered
    for i in range(EVICTED_KEYS + 1):
        index.apply([EntryInfo(tuple(range(1000 * (i + 2), 1000 * (i + 2) + 5)), 80, True)])
    assert index.explain(a + (7,), 0) == ("cold", 0)


async def test_a_chat_miss_names_the_message_its_prompt_broke_in(model_cache_dir, tmp_path: Path):
    path = tmp_path / "events.jsonl"
    system = {"role": "system", "content": "You are a terse assistant. " * 6}
    async with Engine.open(
        "stepline-demo", max_step_tokens=64, max_num_seqs=4, event_log=path
    ) as engine:
        for question in ("What is bread made of?", "Why is the sky blue?"):
            messages = [system, {"role": "user", "content": question}]
            stream = await engine.submit(messages=messages, params=GREEDY)
            _ = [o async for o in stream]
    second = first_chunks(path)[1]
    assert second.prefix_miss == "diverged"
    code, text = replay(str(path), "--request", second.request_id)
    assert f"differs from everything the cache held at token {second.prefix_shared} " in text
    assert "(in message 2)" in text  # the system prompt was reused; the question differs


async def test_a_whole_answer_says_in_a_header_what_the_cache_served_and_why_not_more():
    """Every door's non-streamed answer carries `x-stepline-prefix-cache`: the cached count
    its usage also gives, and where it reused less than it could, the reason its log gives."""
    from helpers import open_served

    model = "stepline-demo-hybrid"
    words = " ".join(f"w{n}" for n in ids(40, 7))
    chat = [{"role": "user", "content": words}]
    async with open_served(model, engine={"max_step_tokens": 32}) as served:
        async with served.http() as http:

            async def header(path: str, body: dict) -> dict[str, str]:
                r = await http.post(path, json=body)
                assert r.status_code == 200, r.text
                pairs = (p.split("=") for p in r.headers["x-stepline-prefix-cache"].split("; "))
                return dict(pairs)

            completion = {"prompt": words, "max_tokens": 2}
            cold = await header("/v1/completions", completion)
            assert cold["cached"] == "0" and cold["miss"] == "cold"
            again = await header("/v1/completions", completion)
            assert again["cached"] == str(int(again["prompt"]) - 1) and "miss" not in again
            # The same words, but the last one changed: a hybrid model's recurrent state
            # exists at its snapshots only, so the hit stops at the last one before it.
            changed = await header("/v1/completions", {**completion, "prompt": words + "x"})
            assert changed["miss"] == "no-snapshot"
            assert int(changed["cached"]) < int(changed["shared"]) < int(changed["prompt"])
            for path, body in [
                ("/v1/chat/completions", {"messages": chat, "max_tokens": 2}),
                ("/v1/messages", {"model": model, "messages": chat, "max_tokens": 2}),
                ("/v1/responses", {"input": words, "max_output_tokens": 2}),
                (
                    "/api/chat",
                    {
                        "model": model,
                        "messages": chat,
                        "stream": False,
                        "options": {"num_predict": 2},
                    },
                ),
            ]:
                seen = await header(path, body)
                assert int(seen["prompt"]) > 0 and "cached" in seen, path
