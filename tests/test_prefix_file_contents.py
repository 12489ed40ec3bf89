"""A prefix-cache file that is whole (its crc32 right, its tokens and its model its own) but
whose arrays are wrong is never served from: NaN data, or fewer rows on the token axis than
the entry claims. The request computes its prompt instead, answers as a cold run does, and a
warning names the file; a restart finds the bad file gone."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache
from structlog.testing import capture_logs

from stepline.api import Engine, SamplingParams
from stepline.engine.models import demo_model_path
from stepline.engine.prefix_files import (
    entry_file_name,
    model_fingerprint,
    serialize_entry,
    write_entry_file,
)
from stepline.engine.runner import snapshot_cache

PROMPT = [5 + (i * 37) % 900 for i in range(43)]  # the cached prefix
QUESTION = [7, 11, 13, 17]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def write(cache_dir, layers) -> None:
    model_id = model_fingerprint(demo_model_path("stepline-demo"))
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / entry_file_name(model_id, PROMPT)
    payload = serialize_entry(PROMPT, layers, model_id=model_id, trimmable=True, path=path)
    write_entry_file(payload)


def real_entry(model) -> list:
    cache = make_prompt_cache(model)
    model(mx.array(PROMPT)[None], cache=cache)
    return snapshot_cache(cache)


def nan_data(layers) -> list:
    out = []
    for layer in layers:
        keys, values, offset = layer.state
        kv = KVCache()
        kv.state = (keys * math.nan, values, offset)
        out.append(kv)
    return out


def two_rows(layers) -> list:
    """Arrays of 2 tokens under an offset (and a token list) of 43."""
    out = []
    for layer in layers:
        keys, values, offset = layer.state
        kv = KVCache()
        kv.state = (keys[..., :2, :], values[..., :2, :], offset)
        out.append(kv)
    return out


async def answer(cache_dir) -> tuple[list[int], int]:
    async with Engine.open(
        "stepline-demo", prefix_cache_dir=cache_dir, max_step_tokens=16, max_num_seqs=4
    ) as engine:
        outs = [o async for o in engine.generate(PROMPT + QUESTION, params=GREEDY)]
        assert engine.healthy
    return [t for o in outs for t in o.token_ids], outs[-1].num_cached_tokens


@pytest.mark.parametrize(("spoil", "why"), [(nan_data, "NaN"), (two_rows, "holds 2 tokens")])
async def test_a_whole_file_with_wrong_data_is_not_served_from(demo, tmp_path, spoil, why):
    async with Engine.open(
        "stepline-demo", prefix_cache_gb=0, max_step_tokens=16, max_num_seqs=4
    ) as engine:
        cold = [o async for o in engine.generate(PROMPT + QUESTION, params=GREEDY)]
    cold_tokens = [t for o in cold for t in o.token_ids]
    cache_dir = tmp_path / "prefix-cache"
    write(cache_dir, spoil(real_entry(demo.model)))

    with capture_logs() as logs:
        tokens, cached = await answer(cache_dir)
    assert (tokens, cached) == (cold_tokens, 0)  # computed, not taken from the file
    [skipped] = [e for e in logs if e["event"] == "prefix_cache_file_skipped"]
    assert why in skipped["reason"]
    assert len(tokens) == 6  # not ended at its first token with empty content

    with capture_logs() as logs:  # a restart: the bad file is gone
        await answer(cache_dir)
    assert not [e for e in logs if e["event"] == "prefix_cache_file_skipped"]
