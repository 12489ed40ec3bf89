"""The prefix cache: a request served from a cached prefix computes what a cold one does."""

from __future__ import annotations

import random

import anyio
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from prefix_parts import Prefixes

from stepline.api import Engine, SamplingParams
from stepline.engine.runner import snapshot_cache

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
MODELS = ["stepline-demo", "stepline-demo-hybrid", "stepline-demo-sliding"]


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


async def run(engine: Engine, prompt=None, messages=None, checkpoints=(), params=GREEDY):
    stream = await engine.submit(prompt, messages=messages, params=params, checkpoints=checkpoints)
    outs = [o async for o in stream]
    tokens = [t for o in outs for t in o.token_ids]
    logprobs = [lp.logprob for o in outs for lp in o.logprobs]
    return tokens, logprobs, outs[-1].num_cached_tokens


async def cold(model: str, prompt=None, messages=None):
    async with Engine.open(model, prefix_cache_gb=0, max_step_tokens=64, max_num_seqs=4) as e:
        tokens, logprobs, cached = await run(e, prompt, messages)
    assert cached == 0
    return tokens, logprobs


def same(a, b) -> None:
    assert a[0] == b[0]
    assert mx.allclose(mx.array(a[1]), mx.array(b[1]), atol=1e-4)


@pytest.mark.parametrize("model", MODELS)
async def test_an_exact_checkpoint_hit_computes_what_a_cold_prefill_does(model, model_cache_dir):
    system = ids(40, 1)
    question = ids(9, 2)
    async with Engine.open(model, max_step_tokens=16, max_num_seqs=4) as engine:
        await run(engine, system + ids(5, 3), checkpoints=(40,))
        warm = await run(engine, system + question)
    assert warm[2] == 40
    same(warm, await cold(model, system + question))


@pytest.mark.parametrize("model", MODELS)
async def test_a_partial_match_falls_back_to_the_nearest_usable_prefix(model, model_cache_dir):
    base = ids(60, 4)
    query = base[:45] + ids(10, 5)  # shares 45 tokens: between the checkpoints at 20 and 50
    async with Engine.open(model, max_step_tokens=16, max_num_seqs=4) as engine:
        await run(engine, base, checkpoints=(20, 50))
        warm = await run(engine, query)
    if model == "stepline-demo":
        assert warm[2] == 45  # attention caches are cut back to the common prefix
    else:
        # Recurrent state exists only at its snapshot offsets, and a sliding window that
        # has wrapped (window 16 < 60 tokens) has lost what cutting back would need.
        assert warm[2] == 20
    same(warm, await cold(model, query))


@pytest.mark.parametrize("model", MODELS)
async def test_a_five_turn_chat_reuses_earlier_turns_and_matches_cold(model, model_cache_dir):
    messages = [{"role": "system", "content": "You are a terse assistant. " * 4}]
    async with Engine.open(model, max_step_tokens=32, max_num_seqs=4) as engine:
        for turn in range(5):
            messages.append({"role": "user", "content": f"question number {turn} please"})
            warm = await run(engine, messages=messages)
            if turn > 0:
                assert warm[2] > 0
            same(warm, await cold(model, messages=messages))
            answer = engine.tokenizer.decode(warm[0])
            messages.append({"role": "assistant", "content": answer})
        # the last turn started at least from the end of the previous turn's prompt
        prev = engine.render_chat(messages[:-3], add_generation_prompt=True)
        assert warm[2] >= len(engine.tokenizer.encode(prev, add_special_tokens=False))


def test_a_hybrid_entry_is_never_used_at_an_offset_it_was_not_taken_at(demo_hybrid):
    model = demo_hybrid.model
    prompt = ids(50, 6)

    def snapshot(n: int):
        cache = make_prompt_cache(model)
        model(mx.array(prompt[:n])[None], cache=cache)
        return snapshot_cache(cache)

    pc = Prefixes(1 << 30)
    pc.put(prompt[:20], snapshot(20))
    pc.put(prompt[:50], snapshot(50))
    # A naive trie lookup would cut the 50-token entry back to the 40 shared tokens.
    hit = pc.lookup(prompt[:40] + ids(5, 7))
    assert hit is not None and hit.num_tokens == 20
    assert all(layer.offset == 20 for layer in hit.cache if hasattr(layer, "offset"))
    # The whole prompt again: 50 would leave nothing to compute, so the entry at 20 it is.
    assert (hit := pc.lookup(prompt)) is not None and hit.num_tokens == 20
    assert (hit := pc.lookup(prompt + [5, 6])) is not None and hit.num_tokens == 50
    assert pc.lookup(ids(30, 8)) is None


def test_a_trimmable_entry_serves_any_shorter_common_prefix(demo):
    model = demo.model
    prompt = ids(50, 9)
    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    pc = Prefixes(1 << 30)
    pc.put(prompt, snapshot_cache(cache))
    hit = pc.lookup(prompt[:33] + ids(4, 10))
    assert hit is not None and hit.num_tokens == 33
    assert all(layer.offset == 33 for layer in hit.cache)
    again = pc.lookup(prompt[:10] + [7, 7])
    assert again is not None and again.num_tokens == 10
    # the first hit's trim did not touch the shared entry
    assert all(layer.offset == 10 for layer in again.cache)


@pytest.mark.parametrize("model", ["stepline-demo", "stepline-demo-hybrid"])
async def test_a_tiny_byte_budget_evicts_but_stays_correct(model, model_cache_dir):
    prompts = [ids(30, 20 + i) for i in range(4)]
    async with Engine.open(model, max_step_tokens=16, max_num_seqs=4, prefix_cache_gb=2e-5) as e:
        results = [await run(e, p, checkpoints=(10, 20)) for p in prompts]
        results += [await run(e, p + [11, 12]) for p in prompts]
        evictions = e.metrics.registry.get_sample_value("stepline_prefix_cache_evictions")
    assert evictions > 0
    queries = prompts + [p + [11, 12] for p in prompts]
    for query, got in zip(queries, results, strict=True):
        same(got, await cold(model, query))


@pytest.mark.parametrize("model", ["stepline-demo", "stepline-demo-hybrid"])
async def test_concurrent_requests_sharing_one_entry_do_not_disturb_each_other(
    model, model_cache_dir
):
    system = ids(48, 30)
    questions = [ids(6 + i, 40 + i) for i in range(6)]
    async with Engine.open(model, max_step_tokens=32, max_num_seqs=8) as engine:
        await run(engine, system + [5], checkpoints=(48,))
        results: dict[int, tuple] = {}

        async def ask(i: int) -> None:
            results[i] = await run(engine, system + questions[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(questions)):
                tg.start_soon(ask, i)
    for i, q in enumerate(questions):
        assert results[i][2] == 48
        same(results[i], await cold(model, system + q))


@pytest.mark.parametrize("lookahead", [True, False], ids=["looking-ahead", "not-looking-ahead"])
async def test_a_follow_up_reuses_the_previous_answer_as_soon_as_it_finished(
    model_cache_dir, lookahead
):
    prompt = ids(30, 50)
    async with Engine.open("stepline-demo", max_step_tokens=64, max_num_seqs=4) as engine:
        engine.step_loop.runner.lookahead.enabled = lookahead
        first = await run(engine, prompt)
        follow_up = prompt + first[0] + ids(5, 51)
        warm = await run(engine, follow_up)
    # The finished request's cache holds its prompt and the tokens it made: all of them
    # once the forward that looked ahead took in the last one, else all but the last.
    assert warm[2] == len(prompt) + len(first[0]) - (0 if lookahead else 1)
    same(warm, await cold("stepline-demo", follow_up))
